"""Fault isolation (the engine's bisection over a failed step) for DeepSeek-V4: a request whose
step raises fails alone, and every other request commits exactly a clean run's tokens — also
when the discarded step had already written its rows (a V4 ring slot is shared by positions
``W`` apart, so a prefill chunk's rows overwrite rows its own first tokens read)."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.sampling_params import SamplingParams

from .conftest import v4_engine

FAULT_SEED = 4242  # the request carrying this seed makes the injected fault fire


def _requests():
    g = torch.Generator().manual_seed(7)
    # prefilled in chunks of ~60: the fault hits the chunk [123, 186), whose rows from 128 on take
    # the ring slots of positions 0.. that its first tokens read
    long = torch.randint(0, 96, (200,), generator=g).tolist()
    mid = torch.randint(0, 96, (150,), generator=g).tolist()
    return [
        ([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, seed=FAULT_SEED)),
        (long, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)),
        (mid, SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, seed=5, logprobs=0)),
    ]


def _run(engine, requests):
    sids = [engine.add_request(p, sp) for p, sp in requests]
    while engine.has_unfinished():
        engine.step()
    out = [(engine.seqs[s].output_ids, engine.seqs[s].finish_reason,
            [lp[t] for lp, t in zip(engine.seqs[s].logprobs, engine.seqs[s].output_ids, strict=False)])
           for s in sids]
    assert engine.blocks.num_free == engine.blocks.num_blocks, "every pool is back"
    return out


def _faulty(engine, where: str, after_outputs: int = 2):
    """Make the step raise once the culprit has ``after_outputs`` tokens: ``"after"`` the forward
    (every layer wrote its rows, as when the sampler raises), or ``"inside"`` its last call — a
    prefill chunk's, after the first layers wrote their rows — or in ``"propose"``, before any."""
    runner = engine.runner

    def culprit_due(seqs):
        return any(s.params.seed == FAULT_SEED and s.num_output_tokens >= after_outputs for s in seqs)

    if where == "propose":  # before any forward of the step: the previous step's rows stay
        strategy = engine.strategy
        real_propose = strategy.propose

        def propose(seqs, budgets):
            if culprit_due(seqs):
                raise RuntimeError("injected fault")
            return real_propose(seqs, budgets)

        strategy.propose = propose
    elif where == "after":
        real_execute = runner.execute

        def execute(seqs, proposals, *a, **kw):
            result = real_execute(seqs, proposals, *a, **kw)
            if culprit_due(seqs):
                raise RuntimeError("injected fault")
            return result

        runner.execute = execute
    else:
        layers = list(engine.model.model.decoder_layers())
        target = layers[2]  # after layers 0 and 1 wrote their ring rows
        real_attn_in = target.attn_in
        state = {"seqs": []}
        real_execute = runner.execute

        def execute(seqs, proposals, *a, **kw):
            state["seqs"] = seqs
            return real_execute(seqs, proposals, *a, **kw)

        def attn_in(streams):  # [B, S, hc, hidden]; S > state_span: a prefill chunk's own call
            seqs = state["seqs"]
            if culprit_due(seqs) and (streams.shape[1] > 16 or len(seqs) == 1):
                raise RuntimeError("injected fault")
            return real_attn_in(streams)

        runner.execute = execute
        target.attn_in = attn_in  # an instance attribute over the method (popped after the test)


def _engine_kw(decoding: str) -> dict:
    kw: dict = dict(max_num_seqs=4, max_num_batched_tokens=64)
    if decoding == "mtp":
        kw.update(decoding="speculative", decoding_options={"method": "mtp"})
    return kw


@pytest.fixture(scope="module")
def clean_runs(model):
    """decoding -> the requests' outputs without a fault (computed once per decoding)."""
    cache: dict[str, list] = {}

    def get(decoding: str) -> list:
        if decoding not in cache:
            cache[decoding] = _run(v4_engine(model, **_engine_kw(decoding)), _requests())
        return cache[decoding]

    return get


@pytest.mark.parametrize("where", ["propose", "after", "inside"])
@pytest.mark.parametrize("decoding", ["autoregressive", "mtp"])
def test_a_failing_request_fails_alone_and_the_others_are_unchanged(model, clean_runs, where, decoding):
    reqs = _requests()
    clean = clean_runs(decoding)
    engine = v4_engine(model, **_engine_kw(decoding))
    _faulty(engine, where)
    try:
        got = _run(engine, reqs)
    finally:
        for layer in engine.model.model.decoder_layers():
            layer.__dict__.pop("attn_in", None)
    assert got[0][:2] == (clean[0][0][:2], "error")
    for (tokens, reason, lps), (want_tokens, want_reason, want_lps) in zip(got[1:], clean[1:], strict=True):
        assert (tokens, reason) == (want_tokens, want_reason)
        # the survivors ran in smaller batches after the fault: equal up to batch-size rounding
        assert lps == pytest.approx(want_lps, abs=1e-4)
    assert engine.stats.extra["failed_requests"] == 1
