"""The batch-1 decode chain (models/decode_chain.py): in the integer modes a decode step of one
sequence calls the layer kernels without the layer-by-layer Python, and its logits are bit-identical
to the general path's, step after step; it is built only where every op has that kernel form."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM
from ratchetlm.models.decode_chain import DecodeChain
from tests.models.tiny import engine_logits, hf_model, write_gguf

PROMPT = "The ratchet only moves forward: committed tokens are never taken back."


def _decode_logits(llm: LLM, chain: bool, monkeypatch) -> tuple[dict[int, torch.Tensor], int]:
    """Prefill logits and 12 single-token decode steps (engine_logits), with the chain on or off;
    and how many steps the chain ran."""
    model = llm.engine.model
    calls = []
    run = DecodeChain.run
    monkeypatch.setattr(DecodeChain, "run", lambda self, *a: calls.append(1) or run(self, *a))
    model.decode_chain = chain
    try:
        model.set_numerics(model.numerics)
        ids = llm.encode(PROMPT)
        return engine_logits(llm, ids, rows=[0, len(ids) - 13], n_decode=12), len(calls)
    finally:
        model.decode_chain = True
        model.set_numerics(model.numerics)


@pytest.mark.parametrize("numerics", ["int8", "int16"])
def test_chain_steps_are_bit_identical_to_the_layer_path(numerics, monkeypatch):
    llm = LLM(progress=False, numerics=numerics, kv_cache_blocks=32)
    on, ran = _decode_logits(llm, True, monkeypatch)
    off, ran_off = _decode_logits(llm, False, monkeypatch)
    assert ran == 12 and ran_off == 0  # every decode step took the chain, none with it off
    assert on.keys() == off.keys()
    for pos in on:
        assert torch.equal(on[pos], off[pos]), pos


def test_chain_is_built_only_where_every_op_is_one_kernel(tmp_path, llm_fp32):
    assert llm_fp32.engine.model._chain is None  # exact mode: torch's ops, HF-identical
    for arch, overrides in (("LlamaForCausalLM", {}), ("Qwen2ForCausalLM", {}),
                            ("Qwen3ForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": 24})):
        path = write_gguf(tmp_path / f"{arch}-{len(overrides)}.gguf", hf_model(arch, **overrides), "Q8_0")
        llm = LLM(str(path), progress=False, numerics="int8", kv_cache_blocks=16)
        plain = arch == "LlamaForCausalLM"  # Q/K/V biases, QK-norms, a window: the general path
        assert (llm.engine.model._chain is not None) == plain, (arch, overrides)
