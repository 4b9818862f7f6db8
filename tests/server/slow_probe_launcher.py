"""``python -m tests.server.slow_probe_launcher <ratchet serve args>``: the real server whose step-cost
probe (run by the engine thread right after the model loads) repeats each of its timed forwards
``PROBE_REPEATS`` times, so that it is still inside real forwards minutes after /health says ok, as
the probe is for seconds on a busy CPU."""

from __future__ import annotations

import functools

import ratchetlm.engine.llm_engine as llm_engine
from ratchetlm.server.cli import main

PROBE_REPEATS = 100_000
llm_engine.probe_prior = functools.partial(llm_engine.probe_prior, repeats=PROBE_REPEATS)

if __name__ == "__main__":
    raise SystemExit(main())
