"""Fault isolation under WeDLM (issue 12): a request whose step raises mid-decoding fails alone,
and every other request's window resumes exactly where it was, so their output equals the
no-cache reference decoder's (a dropped window would re-decode from masks and diverge)."""

from __future__ import annotations

from ratchetlm.sampling_params import SamplingParams

from .test_engine_vs_reference import TINY_PROMPTS

OPTS = dict(window_size=8, entropy_threshold=0.8)  # several fills per step: windows carry history
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
POISON_SEED = 9191


def test_a_mid_decoding_fault_fails_one_request_and_the_others_keep_their_windows(tiny, monkeypatch):
    want = [tiny.reference(p, GREEDY, **OPTS).output_ids for p in TINY_PROMPTS]
    eng = tiny.engine(**OPTS)
    real_execute = eng.runner.execute
    faults = 0

    def execute(seqs, proposals, *a, **kw):
        nonlocal faults
        # fires once the culprit has decoded a few tokens, i.e. while its neighbours hold windows
        if any(s.params.seed == POISON_SEED and s.num_output_tokens >= 5 for s in seqs):
            faults += 1
            raise RuntimeError("injected forward fault")
        return real_execute(seqs, proposals, *a, **kw)

    monkeypatch.setattr(eng.runner, "execute", execute)
    ids = [eng.add_request(p, GREEDY) for p in TINY_PROMPTS]
    poison = eng.add_request(TINY_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=32, seed=POISON_SEED))
    while eng.has_unfinished():
        eng.step()
    assert faults > 0, "the fault never fired: the test would be vacuous"
    assert eng.seqs[poison].finish_reason == "error"
    for i, sid in enumerate(ids):
        assert eng.seqs[sid].output_ids == want[i], f"prompt {i} changed by its neighbour's fault"
        assert eng.seqs[sid].finish_reason == "length"
