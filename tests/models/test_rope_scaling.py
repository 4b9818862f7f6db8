"""RoPE scaling is applied, for HF folders and GGUF files: a scaled model's logits far past the
original context equal HF transformers' with the scaling on (and differ from the unscaled model's,
so dropping the scaling cannot pass)."""

from __future__ import annotations

import math

import pytest
import torch

from ratchetlm import LLM
from ratchetlm.layers.rope_scaling import RopeScaling, rope_frequencies
from tests.models.tiny import engine_logits, hf_logits, hf_model, save_hf, write_gguf

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 4.0},
    LLAMA3,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16, "beta_slow": 2,
     "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.8},
])
def test_frequencies_equal_hf_rope_init(params):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 50000.0, **params}
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=8192,
                                   rope_parameters=params)
    ref, ref_attn = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    ours, attn = rope_frequencies(params["rope_theta"], 64, RopeScaling.from_hf(cfg.rope_parameters, 8192), 8192)
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0), (ours - ref).abs().max()
    assert math.isclose(attn, ref_attn, rel_tol=1e-6)


@pytest.mark.parametrize("context_len", [100, 4096])
def test_longrope_picks_short_or_long_factors_like_hf(context_len):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    g = torch.Generator().manual_seed(0)
    short = (1 + torch.rand(16, generator=g)).tolist()
    long = (1 + 4 * torch.rand(16, generator=g)).tolist()
    cfg = transformers.Phi3Config(hidden_size=128, num_attention_heads=4, max_position_embeddings=4096,
                                  original_max_position_embeddings=256,
                                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "short_factor": short, "long_factor": long,
                                                   "original_max_position_embeddings": 256})
    ref, ref_attn = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=context_len)
    ours, attn = rope_frequencies(10000.0, 32, RopeScaling.from_hf(cfg.rope_parameters, 4096), context_len)
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0)
    assert math.isclose(attn, ref_attn, rel_tol=1e-6) and attn > 1


def _long_context_check(llm: LLM, scaled, unscaled) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1800,), generator=g).tolist()
    rows = list(range(1000, 1796, 7))
    ours = engine_logits(llm, ids, rows, n_decode=4)  # prefill to 1796, then 4 paged decode steps
    ref, ref_unscaled = hf_logits(scaled, ids), hf_logits(unscaled, ids)
    worst = max((ours[r].log_softmax(-1) - ref[r].log_softmax(-1)).abs().max().item() for r in ours)
    drift = max((ref_unscaled[r].log_softmax(-1) - ref[r].log_softmax(-1)).abs().max().item() for r in ours)
    assert worst < 2e-4, worst
    assert drift > max(100 * worst, 1e-3), (drift, worst)  # the scaling matters at these positions


@pytest.fixture(scope="module")
def llama3_models():
    scaled = hf_model("LlamaForCausalLM", max_position_embeddings=2048, num_hidden_layers=2, rope_parameters=LLAMA3)
    unscaled = hf_model("LlamaForCausalLM", max_position_embeddings=2048, num_hidden_layers=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    unscaled.load_state_dict(scaled.state_dict())
    return scaled, unscaled


def test_llama3_scaling_hf_folder_long_context(tmp_path, llama3_models):
    scaled, unscaled = llama3_models
    llm = LLM(str(save_hf(tmp_path, scaled)), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=160)
    assert llm.model_config.rope_scaling is not None and llm.model_config.rope_scaling.type == "llama3"
    _long_context_check(llm, scaled, unscaled)


def test_llama3_scaling_gguf_rope_freqs_long_context(tmp_path, llama3_models):
    scaled, unscaled = llama3_models
    path = write_gguf(tmp_path / "tiny-llama3.gguf", scaled)
    llm = LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=160)
    assert llm.model_config.rope_scaling is not None and llm.model_config.rope_scaling.type == "freq_factors"
    _long_context_check(llm, scaled, unscaled)


def test_yarn_hf_folder_long_context(tmp_path):
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 256}
    scaled = hf_model("Qwen3ForCausalLM", max_position_embeddings=2048, num_hidden_layers=2, rope_parameters=yarn)
    unscaled = hf_model("Qwen3ForCausalLM", max_position_embeddings=2048, num_hidden_layers=2)
    unscaled.load_state_dict(scaled.state_dict())
    llm = LLM(str(save_hf(tmp_path, scaled)), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=160)
    _long_context_check(llm, scaled, unscaled)


def test_unsupported_scaling_is_refused(tmp_path):
    model = hf_model("LlamaForCausalLM", num_hidden_layers=1,
                     rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        LLM(str(save_hf(tmp_path, model)), progress=False, numerics="exact", dtype="float32")
