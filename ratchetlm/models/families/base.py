"""What a model family is (see the package's docstring): the data each family module fills in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Our per-layer parameters, and for fused ones the sizes of their parts: the q/k/v rows of ``qkv``
# and the gate/up rows of ``gate_up`` (HF keeps them separate, Phi-3 already fused).
FUSED_PARTS = {"qkv": ("q", "kv", "kv"), "gate_up": ("inter", "inter")}

# HF per-layer tensor (without ``model.layers.N.`` and ``.weight``/``.bias``) -> (our parameter,
# part of a fused parameter or None for the whole). The Llama layout; families override entries.
LLAMA_LAYER_NAMES: dict[str, tuple[str, int | None]] = {
    "self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
    "self_attn.o_proj": ("o_proj", None),
    "self_attn.q_norm": ("q_norm", None), "self_attn.k_norm": ("k_norm", None),
    "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1), "mlp.down_proj": ("down", None),
    "input_layernorm": ("input_norm", None), "post_attention_layernorm": ("post_norm", None),
}


@dataclass(frozen=True)
class Family:
    model_type: str  # HF ``model_type`` (transformers' config class that normalises config.json)
    hf_config: Callable[[Any], dict[str, Any]]  # family-specific ModelConfig fields from the HF config object
    layer_names: dict[str, tuple[str, int | None]] = field(default_factory=lambda: dict(LLAMA_LAYER_NAMES))
