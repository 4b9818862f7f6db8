"""The real Gemma 3 270M (Q4_K_M GGUF made by llama.cpp) equals HF transformers' GGUF loader on the
same file: logits at positions before and past the 512-token sliding window, from prefill and from
paged decode steps, and greedy text; n-gram speculative decoding gives the same text.

Memory: the HF model (~3 GB while loading) is dropped before ours is loaded."""

from __future__ import annotations

import gc

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from tests.models.tiny import engine_logits, engine_on, run

TEXT = "The history of the ratchet begins with simple pawls and toothed wheels. " * 50  # ~750 tokens
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(gemma3_270m_path):
    import transformers
    from transformers import AutoTokenizer

    p = gemma3_270m_path
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    ids = [tok.bos_token_id] + tok.encode(TEXT, add_special_tokens=False)
    rows = list(range(0, len(ids) - 4, 37))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                           dtype=torch.float32).eval()
    assert hf.config.sliding_window == 512 and len(ids) > 700
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
        keep = rows + list(range(len(ids) - 5, len(ids)))  # + the prefill's last row and 4 decode rows
        logits = dict(zip(keep, hf.lm_head(hidden[keep]).float(), strict=True))
        gen = hf.generate(torch.tensor([ids[:600]]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
    del hf, hidden
    gc.collect()
    return ids, rows, logits, gen[0, 600:].tolist()


@pytest.fixture(scope="module")
def gemma(gemma3_270m_path, reference):
    return LLM(str(gemma3_270m_path), progress=False, dtype="float32", kv_cache_blocks=128)


def test_config_read_from_the_file(gemma):
    c = gemma.model_config
    assert c.architecture == "Gemma3ForCausalLM" and c.sliding_window == 512 and c.qk_norm
    assert c.layer_types.count("full_attention") == 3 and c.layer_types[5] == "full_attention"
    assert (c.rope_theta, c.rope_local_theta, c.query_scale) == (1e6, 10000.0, 256**-0.5)


def test_logits_match_hf_gguf_before_and_past_the_window(gemma, reference):
    ids, rows, ref, _ = reference
    ours = engine_logits(gemma, ids, rows=rows, n_decode=4)
    assert set(ours) == set(ref)
    for r, lg in ours.items():
        # fp32 both sides, the same dequantized weights; logits of magnitude ~30
        assert torch.allclose(lg, ref[r], atol=5e-4, rtol=0), (r, (lg - ref[r]).abs().max())


def test_greedy_and_ngram_speculative_match_hf(gemma, reference):
    ids, _, _, gen = reference
    assert gemma.generate([ids[:600]], GREEDY)[0].token_ids == gen
    spec = engine_on(gemma, kv_cache_blocks=64, decoding="speculative",
                     decoding_options={"method": "ngram", "depth": 4, "depth_schedule": "constant"})
    assert run(spec, [ids[:600]], GREEDY.max_tokens) == [gen]
    assert spec.strategy.metrics()["spec_decode_num_accepted_tokens"] > 0
