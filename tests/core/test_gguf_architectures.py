"""GGUF files of each supported architecture, every tensor format, against HF transformers' own
GGUF loader on the same file (its own dequantization and Q/K un-permutation): logits close
(prefill and paged decode), greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.models.loader import ModelLoadError
from tests.core.gguf_factory import BOS, EOS, VOCAB, write_tiny_gguf
from tests.core.test_model_parity import _engine_logits

ALL_TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "F16", "Q5_1", "Q4_1", "BF16", "Q5_0", "Q2_K", "Q3_K", "F32"]
ARCHS = {  # arch: (head_dim, tied head, formats cycled over the 2-D tensors)
    "llama": (64, True, ALL_TYPES),
    "qwen2": (64, False, ALL_TYPES[5:] + ALL_TYPES[:5]),
    "qwen3": (128, True, ALL_TYPES[9:] + ALL_TYPES[:9]),
}
IDS = [BOS, 256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101]


def _hf(path):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("kernels_on", [True, False], ids=["blocks", "dense"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_gguf_matches_hf_gguf_loader(tmp_path, arch, kernels_on):
    head_dim, tied, types = ARCHS[arch]
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, types, head_dim=head_dim, tied=tied)
    llm = LLM(str(path), progress=False, numerics="exact", dtype="float32", gguf_kernels=kernels_on, kv_cache_blocks=16)
    cfg = llm.model_config
    assert cfg.qk_norm == (arch == "qwen3") and cfg.attention_bias == (arch == "qwen2")
    assert cfg.head_dim == head_dim and cfg.tie_word_embeddings == tied and cfg.vocab_size == VOCAB
    model = llm.engine.model
    if kernels_on:  # every 2-D weight stays in its stored format
        used = {t for layer in model.layers for t in layer.qkv.blocks.type_names + layer.down.blocks.type_names
                + layer.gate_up.blocks.type_names + layer.o_proj.blocks.type_names}
        assert len(used) >= 10 and model.layers[0].qkv.weight is None
    hf = _hf(path)
    n_decode = 4
    ours = _engine_logits(llm, IDS, n_decode)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    start = len(IDS) - n_decode
    for j, lg in enumerate(ours):
        r = ref[start - 1 + j]
        assert torch.allclose(lg, r, atol=1e-4 * float(r.abs().max()), rtol=0), (arch, j, (lg - r).abs().max())
        assert int(lg.argmax()) == int(r.argmax())
    prompt = IDS[:6]
    ours_tokens = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0].token_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=EOS)
    assert ours_tokens == out[0, len(prompt):].tolist()


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "gpt2", ["F16"], head_dim=64)
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3"):
        LLM(str(path), progress=False, numerics="exact", dtype="float32")


def test_unsupported_tensor_format_is_refused_naming_tensor_type_and_list(tmp_path):
    path = write_tiny_gguf(tmp_path / "iq.gguf", "llama", ["F16"], override={"blk.1.ffn_down.weight": "IQ4_NL"})
    with pytest.raises(ModelLoadError) as e:
        LLM(str(path), progress=False, numerics="exact", dtype="float32")
    msg = str(e.value)
    assert "'blk.1.ffn_down.weight'" in msg and "IQ4_NL" in msg and "Q4_K" in msg and "Q6_K" in msg
