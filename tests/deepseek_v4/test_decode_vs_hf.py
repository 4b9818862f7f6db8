"""Paged decode calls against HF's own incremental decode (its DynamicCache path)."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.models.deepseek_v4.paging import DecodeCapacity
from ratchetlm.models.deepseek_v4.runner import DeepseekV4Runner, generate, greedy

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


@pytest.mark.parametrize("decode_seq", [2, 1])
@pytest.mark.parametrize("prompt_len", [1, 3, 124, 252, 508])
def test_decode_matches_hf_across_boundaries(hf_model, model, prompt_len, decode_seq):
    # 8 steps from these prompt lengths cross 3->4, 127->128, 255->256 and 511->512.
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 96, (prompt_len,), generator=g)
    fed = torch.randint(0, 96, (8,), generator=g).tolist()
    want = _hf_incremental(hf_model, prompt, fed)
    runner = DeepseekV4Runner(model, max_seqs=1, cap=DecodeCapacity.for_model(model.config, decode_seq=decode_seq),
                              shuffle_seed=prompt_len)
    got = [runner.prefill(0, prompt)]
    for t in fed:
        got.append(runner.decode({0: t})[0])
    for step, (a, b) in enumerate(zip(got, want, strict=False)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4, msg=f"step {step}")


def test_closed_loop_generation_matches_hf_generate(hf_model, model):
    prompt = torch.randint(0, 96, (120,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf_out = hf_model.generate(prompt[None], max_new_tokens=20, do_sample=False, min_new_tokens=20)
    want = hf_out[0, 120:].tolist()
    runner = DeepseekV4Runner(model, max_seqs=1)
    got = list(generate(runner, prompt.tolist(), max_new_tokens=20, sampler=greedy))
    assert got == want
    assert runner.lengths == {}  # the sequence was released
