"""The families from GGUF files written as llama.cpp's converter writes them (tests/models/tiny.py):
metadata read (windows, soft-caps, RoPE scaling and factor tensors, Gemma's layer pattern and
local RoPE base), tensors mapped through gguf-py's own name table, Gemma norms' stored ``1 + w``
undone, Phi-3's fused tensors kept fused. Oracle: the HF model the file was written from; and HF
transformers' own GGUF loader where it reproduces that model."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM
from ratchetlm.models.loader import ModelLoadError
from tests.models.tiny import engine_logits, hf_logits, hf_model, write_gguf

WINDOW = 24
FAMILIES = {
    "llama3": ("LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen3": ("Qwen3ForCausalLM", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 64})),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0, query_pre_attn_scalar=16)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=16,  # layers 0-4 local, 5 global
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}})),
    "phi3": ("Phi3ForCausalLM", dict(
        sliding_window=WINDOW, partial_rotary_factor=0.5, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "original_max_position_embeddings": 64,
                         "short_factor": [1.0 + 0.1 * i for i in range(4)],
                         "long_factor": [1.0 + 0.7 * i for i in range(4)]})),
}
IDS = list(b"GGUF files carry the same model: the window slides past these bytes, and the caps hold.")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, cfg = FAMILIES[request.param]
    model = hf_model(arch, **cfg)
    path = write_gguf(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf", model)
    return request.param, model, path


def _check(llm: LLM, ref: torch.Tensor, atol: float) -> None:
    ours = engine_logits(llm, IDS, rows=list(range(len(IDS) - 3)), n_decode=3)
    for r, lg in ours.items():
        assert torch.allclose(lg, ref[r], atol=atol, rtol=0), (r, (lg - ref[r]).abs().max())


def test_gguf_config_and_logits_match_the_source_model(family):
    name, model, path = family
    llm = LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=32, block_size=8)
    c, hc = llm.model_config, model.config
    assert c.architecture == ("LlamaForCausalLM" if name == "mistral" else FAMILIES[name][0])
    types = tuple(getattr(hc, "layer_types", None) or ()) or (("sliding_attention",) * c.num_layers
                                                               if getattr(hc, "sliding_window", None) else ())
    types = types if "sliding_attention" in types else ()
    assert c.layer_types == types and c.sliding_window == (WINDOW if types else None)
    if name == "gemma2":
        assert (c.attn_logit_softcap, c.final_logit_softcap) == (2.0, 3.0)
    if name == "gemma3":
        assert c.rope_local_theta == 5000.0 and c.rope_scaling is not None and c.rope_scaling.factor == 2.0
    if name == "phi3":
        assert c.rotary_dim == 8 and c.rope_scaling is not None and c.rope_scaling.type == "longrope"
    assert len(IDS) > 3 * WINDOW
    _check(llm, hf_logits(model, IDS), atol=1e-4)


def test_gemma_layer_pattern_as_per_layer_flags(tmp_path):
    """A file may carry the layer pattern as one flag per layer (gguf-py's
    ``add_sliding_window_pattern`` with a list; llama.cpp: true = sliding) instead of the period
    llama.cpp assumes per architecture: the flags are read, whatever pattern they make."""
    types = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]  # no period fits
    model = hf_model("Gemma3ForCausalLM", num_hidden_layers=4, sliding_window=WINDOW, query_pre_attn_scalar=16,
                     layer_types=types)
    path = write_gguf(tmp_path / "tiny-gemma3-flags.gguf", model, window_flags=True)
    llm = LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=32, block_size=8)
    assert llm.model_config.layer_types == tuple(types)
    _check(llm, hf_logits(model, IDS), atol=1e-4)
    bad = write_gguf(tmp_path / "tiny-gemma3-3-flags.gguf", model, window_flags=[True, False, True])
    with pytest.raises(ModelLoadError, match="sliding_window_pattern has 3 entries for 4 layers"):
        LLM(str(bad), progress=False, dtype="float32")


# transformers' GGUF loader reads only part of the metadata: it drops windows on ``llama`` files,
# rope_freqs, YaRN, LongRoPE factors and partial rotary, reads no Gemma soft-caps (uses 50/30) and
# sets query_pre_attn_scalar = 256. These configs stay inside what it reads (checked first against
# the source model), so it is an independent oracle for the file: its own reader, its own dequantization.
HF_GGUF_READABLE = {
    "llama": ("LlamaForCausalLM", {}),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=WINDOW, head_dim=256, query_pre_attn_scalar=256)),
    "gemma3": ("Gemma3ForCausalLM", dict(num_hidden_layers=6, sliding_window=WINDOW, head_dim=256,
                                         query_pre_attn_scalar=256)),
    "phi3": ("Phi3ForCausalLM", {}),
}


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("name", list(HF_GGUF_READABLE))
def test_hf_gguf_loader_agrees(name, quant, tmp_path):
    """Block-quantized files (our block kernels on) against transformers' own GGUF loader."""
    import transformers

    arch, cfg = HF_GGUF_READABLE[name]
    model = hf_model(arch, **cfg)
    path = write_gguf(tmp_path / f"tiny-{name}.gguf", model, quant=quant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    ref = hf_logits(hf, IDS)
    if quant == "Q8_0":  # it reads the same model, up to rounding (a dropped option moves logits by ~0.5)
        assert torch.allclose(ref, hf_logits(model, IDS), atol=0.1)
    llm = LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=32, block_size=8)
    _check(llm, ref, atol=2e-4)
