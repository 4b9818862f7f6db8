"""DeepSeek-V4's MTP module as a speculative proposer on the common engine.

The tiny checkpoint carries random MTP weights in the official layout (conftest.write_mtp_weights),
so its drafts are nearly always wrong; the tests that need accepted drafts wrap the proposer so
that, after the module has drafted (its ring, catch-up and chain all run), the chain is replaced
by the known greedy continuation on a schedule of right and wrong tokens.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from ratchetlm.decoding.speculative.proposers import DraftBeam
from ratchetlm.models.deepseek_v4.loader import load_deepseek_v4
from ratchetlm.models.deepseek_v4.reference import mtp_reference, reference_streams
from ratchetlm.sampling_params import SamplingParams

from .conftest import add_restored, v4_engine

V = 96


def mtp_engine(model, depth: int, **kw):
    return v4_engine(model, "speculative",
                     decoding_options={"method": "mtp", "depth": depth, "depth_schedule": "constant"}, **kw)


def run(engine, prompts, params, restored=None):
    sids = [add_restored(engine, p, params, *(restored[i] if restored else (None, 0))) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [engine.seqs[s].output_ids for s in sids]


def steer(engine, truth: dict[tuple[int, ...], list[int]], wrong_every: int = 3):
    """After the MTP module drafts, replace each chain by the true greedy continuation of the
    sequence (``truth``: prompt -> plain greedy output), with draft ``j`` of every
    ``wrong_every``-th step made wrong (``wrong_every = 1``: every draft is wrong)."""
    prop = engine.strategy.proposer
    real = prop.propose
    calls = [0]

    def propose(seqs, depths):
        beams = real(seqs, depths)
        out = []
        for s, b in zip(seqs, beams, strict=True):
            if b is None:
                out.append(None)
                continue
            full = truth[tuple(s.token_ids[: s.num_prompt_tokens])]
            done = s.num_output_tokens
            chain = (full[done : done + b.tokens.shape[1]] + [0] * b.tokens.shape[1])[: b.tokens.shape[1]]
            calls[0] += 1
            if calls[0] % wrong_every == 0:
                j = (calls[0] // wrong_every) % len(chain)
                chain[j] = (chain[j] + 1) % V
            out.append(DraftBeam(torch.tensor([chain]), b.scores))
        return out

    prop.propose = propose


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


# ------------------------------------------------------------------ weights layout


def test_mtp_weights_load_from_the_official_layout(tiny_v4_dir, model, tmp_path):
    saved = load_file(str(tiny_v4_dir / "mtp.safetensors"))
    m = model.mtp[0]
    assert model.config.num_nextn_predict_layers == 1  # HF's config field decides the module count
    assert torch.equal(m.e_proj.weight, saved["mtp.0.e_proj.weight"])
    assert torch.equal(m.h_proj.weight, saved["mtp.0.h_proj.weight"])
    assert torch.equal(m.hc_head.hc_fn, saved["mtp.0.hc_head_fn"])
    assert torch.equal(m.self_attn.q_a_proj.weight, saved["mtp.0.attn.wq_a.weight"])
    assert torch.equal(m.self_attn.sinks, saved["mtp.0.attn.attn_sink"])
    assert torch.equal(m.attn_hc.fn, saved["mtp.0.hc_attn_fn"])
    want = torch.cat([saved["mtp.0.ffn.experts.1.w1.weight"], saved["mtp.0.ffn.experts.1.w3.weight"]])
    assert torch.equal(m.mlp.experts.gate_up_proj[1], want)
    assert torch.equal(m.mlp.gate.e_score_correction_bias, saved["mtp.0.ffn.gate.bias"])
    assert m.self_attn.kind == "sliding_attention" and not m.mlp.gate.hashed
    # without MTP weights, the method is refused with the reason
    plain = tmp_path / "no_mtp"
    shutil.copytree(tiny_v4_dir, plain)
    (plain / "mtp.safetensors").unlink()
    bare = load_deepseek_v4(plain)
    assert bare.mtp is None
    with pytest.raises(ValueError, match="MTP"):
        mtp_engine(bare, 1)
    with pytest.raises(ValueError, match="chains only"):
        v4_engine(model, "speculative", decoding_options={"method": "mtp", "num_candidates": 2})
    with pytest.raises(ValueError, match="not supported for DeepSeek-V4"):
        v4_engine(model, "speculative", decoding_options={"method": "eagle"})


# ------------------------------------------------------------------ the module's own math


@pytest.mark.parametrize("depth", [1, 3])
def test_drafts_equal_the_unpaged_module(model, depth):
    """Every chain the proposer drafts (paged ring, incremental catch-up across steps, write-free
    chained steps) equals the module run unpaged over the whole sequence on reference streams."""
    prompt = _prompts([150], seed=7)[0]  # the module's ring wraps (window 128)
    engine = mtp_engine(model, depth)
    prop = engine.strategy.proposer
    real, record = prop.propose, []

    def propose(seqs, depths):
        beams = real(seqs, depths)
        record.extend((list(s.token_ids), b.tokens[0].tolist()) for s, b in zip(seqs, beams, strict=True) if b)
        return beams

    prop.propose = propose
    (out,) = run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert len(record) >= 8
    full = torch.tensor(prompt + out)
    streams, _ = reference_streams(model, full)
    checked = 0
    for tokens, drafts in record:
        t = len(tokens) - 1
        prev, nxt = streams[:t], full[1 : t + 1]
        for d in drafts:
            logits, out_streams = mtp_reference(model, model.mtp[0], prev, nxt)
            top2 = logits[-1].topk(2).values
            if float(top2[0] - top2[1]) > 1e-3:  # a near tie may round either way
                assert d == int(logits[-1].argmax())
                checked += 1
            prev = torch.cat([prev, out_streams[-1:]])  # chained: the module's own output
            nxt = torch.cat([nxt, torch.tensor([d])])
    assert checked >= len(record) * depth * 0.9


# ------------------------------------------------------------------ speculative == plain


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
# generation crosses 127/128 (CSA + HCA boundary), 255/256, 511/512; a tiny prompt too
LENGTHS = [120, 250, 500, 9]


@pytest.fixture(scope="module")
def plain_greedy(model) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, plain greedy outputs) of LENGTHS: the reference of both depths below, computed once."""
    prompts = _prompts(LENGTHS, seed=1)
    return prompts, run(v4_engine(model, max_num_seqs=8), prompts, GREEDY)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_greedy_equals_plain_alone_and_batched(model, plain_greedy, depth):
    prompts, want = plain_greedy
    truth = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    # the module's own drafts (random weights: almost all rejected), batched
    engine = mtp_engine(model, depth, max_num_seqs=8)
    assert run(engine, prompts, GREEDY) == want
    assert engine.strategy.metrics()["spec_decode_num_drafts"] > 0
    # steered drafts, mostly right: 1 to depth + 1 tokens per call, batched and alone
    engine = mtp_engine(model, depth, max_num_seqs=8)
    steer(engine, truth)
    assert run(engine, prompts, GREEDY) == want
    m = engine.strategy.metrics()
    assert m["spec_decode_acceptance_rate"] > 0.5 and m["spec_decode_num_accepted_tokens"] > 10
    for p, w in zip(prompts, want, strict=True):
        alone = mtp_engine(model, depth)
        steer(alone, truth, wrong_every=2)
        assert run(alone, [p], GREEDY) == [w]
        assert alone.stats.steps < len(w) + 1  # fewer calls than tokens: multi-token commits


@pytest.mark.slow
def test_mtp_greedy_equals_plain_across_8191_8192(model, long_run):
    ids, _, traces = long_run
    starts = [8180, 8190]  # generation crosses 8191/8192 (CSA block 16 -> 17, HCA entry 63)
    prompts = [ids[: p + 1].tolist() for p in starts]
    restored = [(traces, p) for p in starts]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = run(v4_engine(model, max_num_seqs=2), prompts, params, restored)
    truth = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    for depth in (1, 3):
        engine = mtp_engine(model, depth, max_num_seqs=2)
        steer(engine, truth)
        assert run(engine, prompts, params, restored) == want
        assert engine.strategy.metrics()["spec_decode_num_accepted_tokens"] > 0
        alone = mtp_engine(model, depth)
        assert run(alone, prompts[:1], params, restored[:1]) == want[:1]


# ------------------------------------------------------------------ sampling is exact


N_REQ = 300
SAMPLING_PROMPT = _prompts([6], seed=9)[0]


def _sampling_params(seed: int) -> SamplingParams:
    # max_tokens 4: after the prefill's token a depth-2 chain covers tokens 2 and 3
    return SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=seed)


@pytest.fixture(scope="module")
def hf_probs(hf_model):
    import functools

    from ratchetlm.layers.sampler import filtered_probs

    @functools.cache
    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf_model(torch.tensor([list(SAMPLING_PROMPT) + list(prefix)])).logits[0, -1:]
        return filtered_probs(logits, _sampling_params(0))[0].double()

    return probs


@pytest.fixture(scope="module")
def exact(hf_probs) -> dict[tuple[int, ...], float]:
    out = {}
    for t1 in hf_probs(()).nonzero().flatten().tolist():
        for t2 in hf_probs((t1,)).nonzero().flatten().tolist():
            for t3 in hf_probs((t1, t2)).nonzero().flatten().tolist():
                out[(t1, t2, t3)] = float(hf_probs(())[t1] * hf_probs((t1,))[t2] * hf_probs((t1, t2))[t3])
    assert abs(sum(out.values()) - 1) < 1e-6 and len([q for q in out.values() if q * N_REQ >= 5]) >= 6
    return out


def _sample_counts(model, hf_probs):
    """N_REQ seeded requests, batched, MTP depth 2 with plausible drafts: each chain is replaced
    (after the module drafted) by the target's most likely token, then its second most likely,
    so drafts are accepted and rejected at every depth."""
    from collections import Counter

    engine = mtp_engine(model, 2, max_num_seqs=N_REQ)
    prop = engine.strategy.proposer
    real = prop.propose

    def propose(seqs, depths):
        out = []
        for s, b in zip(seqs, real(seqs, depths), strict=True):
            if b is not None:
                prefix = tuple(s.output_ids)
                d1 = int(hf_probs(prefix).argsort(descending=True)[0])
                chain = [d1, int(hf_probs(prefix + (d1,)).argsort(descending=True)[1])][: b.tokens.shape[1]]
                b = DraftBeam(torch.tensor([chain]), b.scores)
            out.append(b)
        return out

    prop.propose = propose
    ids = [engine.add_request(SAMPLING_PROMPT, _sampling_params(seed)) for seed in range(N_REQ)]
    while engine.has_unfinished():
        engine.step()
    return Counter(tuple(engine.seqs[i].output_ids[:3]) for i in ids), engine.metrics()


@pytest.mark.slow
def test_mtp_sampling_matches_the_target_distribution(model, hf_probs, exact, monkeypatch):
    from ratchetlm.decoding import tentative
    from ratchetlm.decoding.speculative.draft_tree import sample_verify
    from tests.speculative.test_rejection_sampling import chi_square_pvalue, wrong_full_resample

    counts, m = _sample_counts(model, hf_probs)
    assert m["spec_decode_num_drafts"] >= N_REQ and 0.2 < m["spec_decode_acceptance_rate"] < 0.9, m
    p = chi_square_pvalue(counts, exact, N_REQ)
    assert p > 1e-3, f"MTP speculative sampling deviates from the target (p={p:.2e})"
    # the test has power: a wrong acceptance rule plugged into the same engine fails it
    import functools

    # the verify step speculative decoding uses
    monkeypatch.setattr(tentative, "sample_verify", functools.partial(sample_verify, rule=wrong_full_resample))
    counts, _ = _sample_counts(model, hf_probs)
    p = chi_square_pvalue(counts, exact, N_REQ)
    assert p < 1e-6, f"the chi-square test missed a wrong acceptance rule (p={p:.2e})"
