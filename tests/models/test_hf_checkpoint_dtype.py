"""HF folders keep their checkpoint's dtype: a bf16 / fp16 checkpoint run with fp32 activations on
CPU holds its 2-D weights as views of the mmapped safetensors files (the block kernels widen them
exactly to fp32 as they multiply), never as an fp32 copy; HF transformers, loading the same
checkpoint in fp32, is the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.layers.block_quant import Embedding, Linear
from tests.models.tiny import EOS, engine_logits, hf_model, save_hf

IDS = list(b"The ratchet only moves forward, one committed token at a time.")


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def checkpoint(request, tmp_path_factory):
    dtype = getattr(torch, request.param)
    model = hf_model("Qwen2ForCausalLM")  # q/k/v biases: dense tensors beside the blocks
    path = save_hf(tmp_path_factory.mktemp(request.param), model.to(dtype))
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # exact widening
    return request.param, path, hf


def _blocked(llm: LLM) -> list[tuple[str, Linear | Embedding]]:
    return [(n, m) for n, m in llm.engine.model.named_modules()
            if isinstance(m, (Linear, Embedding)) and m.blocks is not None]


def test_weights_stay_in_checkpoint_dtype(checkpoint):
    name, path, hf = checkpoint
    llm = LLM(str(path), dtype="float32", progress=False, numerics="exact")
    blocked = _blocked(llm)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, (Linear, Embedding))]
    assert len(blocked) == len(linears) > 0  # every matmul weight and the embedding
    fmt = {"bfloat16": "BF16", "float16": "F16"}[name]
    for _, m in blocked:
        assert m.weight is None
        for p in m.blocks.parts:
            assert p.type_name == fmt
            assert isinstance(p.data.base, np.memmap) or isinstance(p.data, np.memmap)  # a view of the file
    # the only dense parameters are norms and biases (1-D), in fp32
    dense = {n: p for n, p in llm.engine.model.named_parameters()}
    assert dense and all(p.dim() == 1 and p.dtype == torch.float32 for p in dense.values())
    # the blocks widen exactly to HF's fp32 weights
    hf_q = hf.model.layers[1].self_attn.q_proj.weight
    ours = llm.engine.model.layers[1].qkv.blocks.dequantize()[: hf_q.shape[0]]
    assert torch.equal(ours, hf_q)


def test_logits_and_greedy_match_hf(checkpoint):
    _, path, hf = checkpoint
    llm = LLM(str(path), dtype="float32", progress=False, numerics="exact")
    ours = engine_logits(llm, IDS, rows=[0, 10, len(IDS) - 4], n_decode=3)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    for row, logits in ours.items():
        torch.testing.assert_close(logits, ref[row], atol=1e-4, rtol=1e-4)
    out = llm.generate([IDS], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        want = hf.generate(torch.tensor([IDS]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           pad_token_id=EOS)[0, len(IDS):].tolist()
    assert out[0].outputs[0].token_ids == want


def test_fp32_checkpoint_and_kernels_off_stay_dense(checkpoint, tmp_path):
    _, path, _ = checkpoint
    assert not _blocked(LLM(str(path), dtype="float32", gguf_kernels=False, progress=False, numerics="exact"))
    fp32 = save_hf(tmp_path / "fp32", hf_model("Qwen2ForCausalLM"))
    assert not _blocked(LLM(str(fp32), dtype="float32", progress=False, numerics="exact"))
