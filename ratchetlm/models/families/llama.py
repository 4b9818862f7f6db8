"""Llama, Mistral, Qwen2, Qwen3: the pre-norm SwiGLU decoder with separate q/k/v projections.

Mistral is Llama with a sliding window on every layer when its config sets one; Qwen2 adds
q/k/v biases (and per-layer windows where ``use_sliding_window``); Qwen3 adds per-head q/k RMSNorm.
"""

from __future__ import annotations

from typing import Any

from ratchetlm.models.families.base import Family


def _llama(c: Any) -> dict[str, Any]:
    return {}


def _qwen2(c: Any) -> dict[str, Any]:
    return {"attention_bias": True}  # Qwen2's q/k/v projections always carry a bias


def _qwen3(c: Any) -> dict[str, Any]:
    return {"qk_norm": True}


FAMILIES = {
    "LlamaForCausalLM": Family("llama", _llama),
    "MistralForCausalLM": Family("mistral", _llama),
    "Qwen2ForCausalLM": Family("qwen2", _qwen2),
    "Qwen3ForCausalLM": Family("qwen3", _qwen3),
}
