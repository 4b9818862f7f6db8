"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's changes.

* embeddings scaled by sqrt(hidden); tied head;
* GeGLU MLP (tanh-approximated GELU on the gate);
* "sandwich" norms: RMSNorm before *and after* attention and MLP, every RMSNorm scaling by (1 + w);
* attention scale ``query_pre_attn_scalar ** -0.5``;
* sliding-window layers alternating with global ones (Gemma 2: every other; Gemma 3: 5 local : 1);
* Gemma 2: tanh soft-capping of attention scores and of the final logits;
* Gemma 3: per-head q/k RMSNorm and a separate RoPE base for the sliding layers.
"""

from __future__ import annotations

from typing import Any

from ratchetlm.models.families.base import LLAMA_LAYER_NAMES, Family

GEMMA_LAYER_NAMES = {
    **LLAMA_LAYER_NAMES,
    "post_attention_layernorm": ("attn_out_norm", None),  # Gemma: applied to the attention output
    "pre_feedforward_layernorm": ("post_norm", None),  # our pre-MLP norm
    "post_feedforward_layernorm": ("mlp_out_norm", None),
}


def _gemma(c: Any) -> dict[str, Any]:
    return dict(
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=c.hidden_size**0.5,
        query_scale=c.query_pre_attn_scalar**-0.5,
        attn_logit_softcap=c.attn_logit_softcapping,
        final_logit_softcap=c.final_logit_softcapping,
    )


def _gemma3(c: Any) -> dict[str, Any]:
    local = (c.rope_parameters or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 sliding layers with RoPE scaling {local!r} are not supported")
    return {**_gemma(c), "qk_norm": True, "rope_local_theta": float(local.get("rope_theta", 10000.0))}


FAMILIES = {
    "Gemma2ForCausalLM": Family("gemma2", _gemma, GEMMA_LAYER_NAMES),
    "Gemma3ForCausalLM": Family("gemma3_text", _gemma3, GEMMA_LAYER_NAMES),
}
