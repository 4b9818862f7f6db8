"""The default dtype (engine/dtype.py): fp32 on CPU for every model kind (HF-identical), the
checkpoint's dtype for HF folders on CUDA; a folder holding one GGUF runs exactly as the file."""

from __future__ import annotations

import json

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.engine.dtype import checkpoint_dtype, choose_dtype
from ratchetlm.layers.block_quant import Linear
from ratchetlm.models.loader import default_model_path


def _hf_folder(tmp_path, dtype: str | None):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": dtype} if dtype else {}))
    return str(tmp_path)


@pytest.mark.parametrize("stored", ["bfloat16", "float16", "float32", None])
def test_cpu_default_is_fp32_for_every_hf_checkpoint(tmp_path, stored):
    c = choose_dtype("auto", "cpu", _hf_folder(tmp_path, stored), gguf_kernels=True)
    assert c.dtype == torch.float32
    assert c.describe().startswith("dtype=float32 (HF folder on CPU, block kernels: ")


def test_cuda_default_is_the_checkpoint_dtype(tmp_path):
    assert checkpoint_dtype(tmp_path) == torch.float32  # no config.json
    for stored, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32),
                         (None, torch.float32)):
        c = choose_dtype("auto", "cuda", _hf_folder(tmp_path, stored), gguf_kernels=True)
        assert c.dtype == want and "checkpoint's dtype" in c.reason


def test_explicit_dtype_and_vllm_names():
    assert choose_dtype("half", "cpu", None, True).dtype == torch.float16
    assert choose_dtype("float", "cpu", None, True).dtype == torch.float32
    assert "as requested" in choose_dtype("bfloat16", "cpu", None, True).reason
    assert choose_dtype("auto", "cpu", None, gguf_kernels=False).describe() == \
        "dtype=float32 (GGUF on CPU, block kernels: off)"


def test_folder_with_one_gguf_takes_the_file_path(tmp_path, llm_fp32):
    folder = tmp_path / "smollm"
    folder.mkdir()
    # a link, not a copy: the same file seen from a folder (a copy is another file to the tokenizer cache,
    # keyed by the resolved path: its vocabulary converted again, ~10 s of CPU, and 140 MB written)
    (folder / default_model_path().name).symlink_to(default_model_path())
    as_file = choose_dtype("auto", "cpu", str(default_model_path()), True)
    assert choose_dtype("auto", "cpu", str(folder), True) == as_file
    assert as_file.describe().startswith("dtype=float32 (GGUF on CPU, block kernels: ")
    llm = LLM(str(folder), progress=False, numerics="exact", kv_cache_blocks=64)
    assert llm.engine.dtype == torch.float32
    blocked = [m for m in llm.engine.model.modules() if isinstance(m, Linear) and m.blocks is not None]
    assert blocked  # the GGUF block kernels, not dense bf16 copies
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "List three colors:"]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == \
        [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, greedy)]
