"""Supported model families: how each maps onto the one decoder (models/llama.py).

A family is data, not a model class: the :class:`~ratchetlm.models.config.ModelConfig` values its
HF config implies, and where its checkpoint's per-layer tensors go. Adding a family is adding one
of these (a page), not copying a model file.
"""

from __future__ import annotations

from ratchetlm.models.families import gemma, llama, phi3
from ratchetlm.models.families.base import FUSED_PARTS, LLAMA_LAYER_NAMES, Family

__all__ = ["FAMILIES", "FUSED_PARTS", "LLAMA_LAYER_NAMES", "Family"]

FAMILIES: dict[str, Family] = {**llama.FAMILIES, **gemma.FAMILIES, **phi3.FAMILIES}
