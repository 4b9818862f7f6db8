"""Paged V4 steps through the common engine against HF's own incremental decode (its DynamicCache path)."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.sampling_params import SamplingParams

from .conftest import forced_run, v4_engine

ATOL = 5e-5


def _hf_incremental(hf_model, prompt: torch.Tensor, fed: list[int]) -> list[torch.Tensor]:
    """HF logits after the prompt and after each fed token (one token per forward)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    out = []
    with torch.no_grad():
        lg = hf_model(prompt[None], past_key_values=cache, use_cache=True).logits[0, -1]
        out.append(lg)
        for t in fed:
            lg = hf_model(torch.tensor([[t]]), past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(lg)
    return out


@pytest.fixture(scope="module")
def hf_boundary_runs(hf_model):
    """prompt_len -> (prompt, fed tokens, HF's logits): one HF run per prompt, read by both decode_seq cases."""
    runs: dict[int, tuple[torch.Tensor, list[int], list[torch.Tensor]]] = {}

    def get(prompt_len: int):
        if prompt_len not in runs:
            g = torch.Generator().manual_seed(prompt_len)
            prompt = torch.randint(0, 96, (prompt_len,), generator=g)
            fed = torch.randint(0, 96, (8,), generator=g).tolist()
            runs[prompt_len] = (prompt, fed, _hf_incremental(hf_model, prompt, fed))
        return runs[prompt_len]

    return get


@pytest.mark.parametrize("decode_seq", [2, 1])
@pytest.mark.parametrize("prompt_len", [1, 3, 124, 252, 508])
def test_decode_matches_hf_across_boundaries(hf_boundary_runs, model, prompt_len, decode_seq):
    # 8 steps from these prompt lengths cross 3->4, 127->128, 255->256 and 511->512.
    prompt, fed, want = hf_boundary_runs(prompt_len)
    engine = v4_engine(model, "teacher_forced", decode_seq=decode_seq, shuffle_seed=prompt_len)
    (sid,) = forced_run(engine, [prompt.tolist()], [fed + [0]])
    got = engine.strategy.logits[sid]
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4, msg=f"step {step}")


def test_chunked_prefill_matches_hf(hf_model, model):
    # A 700-token prompt in chunks of 96 (the scheduler's token budget): chunk edges fall inside
    # ring, CSA and HCA windows, so every chunk reads its predecessors' rows from the pools.
    prompt = torch.randint(0, 96, (700,), generator=torch.Generator().manual_seed(3))
    fed = torch.randint(0, 96, (4,), generator=torch.Generator().manual_seed(4)).tolist()
    want = _hf_incremental(hf_model, prompt, fed)
    engine = v4_engine(model, "teacher_forced", max_num_batched_tokens=96, shuffle_seed=1)
    (sid,) = forced_run(engine, [prompt.tolist()], [fed + [0]])
    for step, (a, b) in enumerate(zip(engine.strategy.logits[sid], want, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4, msg=f"step {step}")


def test_closed_loop_generation_matches_hf_generate(hf_model, model):
    prompt = torch.randint(0, 96, (120,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf_out = hf_model.generate(prompt[None], max_new_tokens=20, do_sample=False, min_new_tokens=20)
    engine = v4_engine(model)
    sid = engine.add_request(prompt.tolist(), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert engine.seqs[sid].output_ids == hf_out[0, 120:].tolist()
    assert engine.blocks.mapped(sid) == {}  # the sequence's blocks were released
    assert engine.blocks.num_free == engine.blocks.num_blocks
