"""``python -m tests.server.fault_launcher <ratchet serve args>``: the real server with one fault
injected — the sampler raises for any request with ``top_k == POISON_TOP_K`` (a valid value), as a
sampler bug triggered by one request's parameters would."""

from __future__ import annotations

import ratchetlm.layers.sampler as sampler
from ratchetlm.server.cli import main

POISON_TOP_K = 7777
_real = sampler.filtered_probs


def _faulty(logits, p):
    if p.top_k == POISON_TOP_K:
        raise RuntimeError("injected sampler fault")
    return _real(logits, p)


sampler.filtered_probs = _faulty

if __name__ == "__main__":
    raise SystemExit(main())
