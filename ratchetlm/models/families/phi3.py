"""Phi-3 (and Phi-3.5/Phi-4-mini, same class): the Llama decoder with fused projections.

Checkpoints store q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (gate rows
first) — exactly our fused layout. Partial rotary (``partial_rotary_factor``), LongRoPE ("su")
scaling and an optional sliding window come from the shared config reading.
"""

from __future__ import annotations

from typing import Any

from ratchetlm.models.families.base import LLAMA_LAYER_NAMES, Family

_SEPARATE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
PHI3_LAYER_NAMES = {
    **{k: v for k, v in LLAMA_LAYER_NAMES.items() if k not in _SEPARATE},
    "self_attn.qkv_proj": ("qkv", None),
    "mlp.gate_up_proj": ("gate_up", None),
}


def _phi3(c: Any) -> dict[str, Any]:
    return {}


FAMILIES = {"Phi3ForCausalLM": Family("phi3", _phi3, PHI3_LAYER_NAMES)}
