"""Architecture description shared by the decoder model, loaders and the KV cache.

One frozen config describes every supported family; a family is a set of values for these
fields (models/families/). Defaults are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ratchetlm.layers.rope_scaling import RopeScaling
from ratchetlm.models.families import FAMILIES

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mask_token_id: int | None = None  # WeDLM checkpoints declare one; AR models do not
    # --- RoPE
    rope_scaling: RopeScaling | None = None  # of the full-attention layers (all layers unless rope_local_theta)
    rope_local_theta: float | None = None  # sliding layers' own plain RoPE base (Gemma 3)
    rotary_dim: int = 0  # dims of each head that rotate; 0 = all (partial rotary: Phi-3 variants)
    # --- attention
    sliding_window: int | None = None  # keys a sliding layer sees: positions (q - window, q]
    layer_types: tuple[str, ...] = ()  # per layer, from LAYER_TYPES; () = all full attention
    query_scale: float | None = None  # attention logit scale; None = head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    # --- MLP, norms, embeddings, head
    hidden_act: str = "silu"  # gated MLP activation, from ACTIVATIONS
    norm_offset: float = 0.0  # RMSNorm scale is offset + weight (Gemma: 1)
    sandwich_norms: bool = False  # also normalise the attention and MLP outputs (Gemma 2/3)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden))
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim < 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be even and in [0, head_dim={self.head_dim}], got {self.rotary_dim}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
            bad = set(self.layer_types) - set(LAYER_TYPES)
            if bad:
                raise ValueError(f"unknown layer type(s) {sorted(bad)}; supported: {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
                raise ValueError("sliding_attention layers need sliding_window > 0")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_scale"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 when set, got {v}")

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i``; None = full attention."""
        return self.sliding_window if self.layer_types and self.layer_types[i] == "sliding_attention" else None

    @property
    def max_window(self) -> int | None:
        """The largest distance back any layer reads; None when some layer reads the whole context."""
        windows = [self.layer_window(i) for i in range(self.num_layers)]
        return None if any(w is None for w in windows) else max(w for w in windows if w is not None)

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        """Build from a HF ``config.json`` dict. transformers' own config class normalises it
        first (legacy ``rope_scaling`` keys, default layer patterns), so we read what HF runs."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else str(d.get("model_type", "?"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        c = _hf_config(d, FAMILIES[arch].model_type)
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        rope = c.rope_parameters or {}
        if "full_attention" in rope:  # per-layer-type RoPE (Gemma 3): the family reads the local one
            rope = rope["full_attention"]
        partial = float(rope.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None) or 1.0)
        window = getattr(c, "sliding_window", None)
        types = tuple(getattr(c, "layer_types", None) or ())
        if window and not types:  # Mistral, Phi-3: one window on every layer
            types = ("sliding_attention",) * c.num_hidden_layers
        if "sliding_attention" not in types:
            window, types = None, ()
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        act = str(getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None) or "silu")
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling.from_hf(rope, c.max_position_embeddings),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", getattr(c, "tie_word_embeddings", False))),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            sliding_window=window,
            layer_types=types,
            hidden_act={"gelu_pytorch_tanh": "gelu_tanh"}.get(act, act),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            mask_token_id=d.get("mask_token_id"),
        )
        if getattr(c, "mlp_bias", False):
            raise ValueError(f"{arch} with mlp_bias=true is not supported")
        fields.update(FAMILIES[arch].hf_config(c))
        return cls(**fields)


def _hf_config(d: dict, default_type: str) -> Any:
    import transformers

    model_type = d.get("model_type") or default_type
    try:
        return transformers.AutoConfig.for_model(model_type, **{k: v for k, v in d.items() if k != "model_type"})
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"config.json is not a valid {model_type!r} config: {e}") from None
