"""Memory a run gives back: activations freed before the MLP, the heap after a long forward, and a
load that does not import what it never uses."""

from __future__ import annotations

import subprocess
import sys
import weakref

import torch

from ratchetlm import SamplingParams
from ratchetlm.engine import model_runner


def test_attention_tensors_are_freed_before_the_mlp(llm_default):
    """A layer's fused QKV output (and Q, K, V: views of it or rotated from it) is dead by the time
    the MLP runs, so a long prefill's peak does not hold them (the layer path, not the decode chain)."""
    model = llm_default.engine.model
    layer = model.layers[3]
    seen: list[weakref.ref] = []
    alive_at_mlp: list[bool] = []
    qkv_forward, mlp = layer.qkv.forward, layer.mlp

    def qkv(x: torch.Tensor) -> torch.Tensor:
        y = qkv_forward(x)
        seen.append(weakref.ref(y))
        return y

    def mlp_spy(hn: torch.Tensor) -> torch.Tensor:
        alive_at_mlp.append(seen[-1]() is not None)
        return mlp(hn)

    layer.qkv.forward, layer.mlp = qkv, mlp_spy
    try:
        ids = llm_default.tokenize("The quick brown fox jumps over the lazy dog. " * 12)  # > the chain's 64 rows
        llm_default.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    finally:
        del layer.qkv.forward, layer.mlp
    assert alive_at_mlp and not any(alive_at_mlp)


def test_a_long_forward_hands_its_freed_heap_back(llm_default, monkeypatch):
    """After a forward over TRIM_ROWS or more rows the runner returns the free heap to the OS once;
    decode steps and short prompts never pay for that."""
    calls: list[int] = []
    monkeypatch.setattr(model_runner, "trim_heap", lambda: calls.append(1) or True)
    short = llm_default.tokenize("Hello there, how are you?")
    llm_default.generate([short], SamplingParams(max_tokens=8, temperature=0))
    assert calls == []
    text = llm_default.tokenize("A different text, so that no cached prefix shortens the prefill. ")
    long = (text * 50)[: model_runner.TRIM_ROWS + 10]
    llm_default.generate([long], SamplingParams(max_tokens=4, temperature=0))
    assert calls == [1]  # the prefill; not the decode steps after it


def test_loading_a_model_does_not_import_sympy():
    """Allocating the model's meta tensors must not go through torch's reference ``empty_like``, which
    imports torch.fx's symbolic shapes and sympy (~30 MB of RSS); nor must a generation."""
    code = ("import sys\nfrom ratchetlm import LLM, SamplingParams\n"
            "llm = LLM(progress=False)\nllm.generate(['Hi'], SamplingParams(max_tokens=2))\n"
            "print(sorted(m for m in ('sympy', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
