"""Every supported family, from a tiny random HF folder whose config turns on every option the
family has (sliding window smaller than the prompt, alternating local/global layers, soft-caps,
partial rotary, LongRoPE, llama3 / YaRN / linear scaling, q/k norms), equals HF transformers in fp32:
logits of prefill and of paged decode steps, greedy text past the window; and our own modes
agree with each other on it: batched == alone, preempted == not, n-gram speculative == plain."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from tests.models.tiny import engine_logits, engine_on, hf_logits, hf_model, run, save_hf

WINDOW = 24
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}

FAMILIES = {
    "llama3": ("LlamaForCausalLM", dict(rope_parameters=LLAMA3)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=WINDOW, rope_parameters=YARN)),
    "qwen2-swa": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}})),
    "phi3": ("Phi3ForCausalLM", dict(
        sliding_window=WINDOW, partial_rotary_factor=0.5, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "original_max_position_embeddings": 64,
                         "short_factor": [1.0 + 0.1 * i for i in range(4)],
                         "long_factor": [1.0 + 0.7 * i for i in range(4)]})),
}

PROMPTS = [
    "The ratchet only moves forward: committed tokens are never taken back, and the window slides.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n",
    "abcabcabcabc",
    "Sliding windows keep memory flat; global layers keep everything they need.",
]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, cfg = FAMILIES[request.param]
    model = hf_model(arch, **cfg)
    path = save_hf(tmp_path_factory.mktemp(request.param), model)
    llm = LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=64, block_size=8)
    return request.param, model, path, llm


def _ids(text: str) -> list[int]:
    return list(text.encode())


def test_config_reads_every_option(family):
    name, model, _, llm = family
    c = llm.model_config
    assert c.architecture == FAMILIES[name][0]
    expected_types = tuple(getattr(model.config, "layer_types", None) or ()) or (
        ("sliding_attention",) * c.num_layers if getattr(model.config, "sliding_window", None) else ())
    assert c.layer_types == expected_types
    assert c.sliding_window == (WINDOW if "sliding_attention" in expected_types else None)
    if name.startswith("gemma"):
        assert c.norm_offset == 1.0 and c.sandwich_norms and c.embed_scale == pytest.approx(8.0)
        assert c.hidden_act == "gelu_tanh" and c.query_scale == pytest.approx(24**-0.5)
    if name == "llama3":
        assert c.rope_scaling is not None and c.rope_scaling.type == "llama3"
    if name == "mistral":  # YaRN past its 64 original positions: the prompts below are longer
        assert c.rope_scaling is not None and c.rope_scaling.type == "yarn" and c.rope_scaling.factor == 4.0
    if name == "gemma2":
        assert (c.attn_logit_softcap, c.final_logit_softcap) == (2.0, 3.0)
    if name == "gemma3":
        assert c.qk_norm and c.rope_local_theta == 5000.0 and c.rope_theta == 100000.0
        assert c.rope_scaling is not None and c.rope_scaling.type == "linear"
    if name == "phi3":
        assert c.rotary_dim == 8 and c.rope_scaling is not None and c.rope_scaling.type == "longrope"


def test_logits_match_hf_past_the_window(family):
    name, model, _, llm = family
    ids = _ids(PROMPTS[0])  # 95 tokens, ~4 windows
    assert len(ids) > 3 * WINDOW
    ours = engine_logits(llm, ids, rows=list(range(len(ids) - 6)), n_decode=6)
    ref = hf_logits(model, ids)
    for r, lg in ours.items():
        assert torch.allclose(lg, ref[r], atol=1e-4, rtol=1e-4), (name, r, (lg - ref[r]).abs().max())


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy by full re-forward each step: HF's own math, no cache shortcuts."""
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logits(model, out)[-1].argmax()))
    return out[len(ids):]


def test_greedy_matches_hf(family):
    name, model, _, llm = family
    ids = _ids(PROMPTS[1])
    got = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    assert got == _hf_greedy(model, ids, 24), name


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_batched_preempted_and_speculative_equal_alone(family):
    name, _, _, llm = family
    prompts = [_ids(p) for p in PROMPTS]
    alone = [llm.generate([p], _greedy(32))[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(32))]
    assert batched == alone, name
    # every layer sliding, a sequence holds only its window's blocks (test_window_memory.py): tighter still
    small = {} if llm.engine.blocks.window is None else {"kv_cache_blocks": 10, "max_num_batched_tokens": 16}
    tight = engine_on(llm, **{"kv_cache_blocks": 24, "block_size": 8, "max_model_len": 160, **small})
    assert run(tight, prompts, 32) == alone, name
    assert tight.scheduler.num_preemptions > 0
    ngram = {"method": "ngram", "depth": 4, "num_candidates": 2, "depth_schedule": "constant"}
    spec = engine_on(llm, kv_cache_blocks=64, block_size=8, decoding="speculative", decoding_options=ngram)
    assert run(spec, prompts, 32) == alone, name
    m = spec.strategy.metrics()
    assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
