"""DeepSeek-V4 architecture description, parsed from an HF-format ``config.json``.

The HF ``DeepseekV4Config`` is the reference for field names and defaults; this frozen
dataclass holds only what inference needs, normalised (per-layer attention kind and
ratio, per-layer MoE kind, the two RoPE tables) and validated once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_KINDS = (SLIDING, CSA, HCA)
_RATIO_TO_KIND = {0: SLIDING, 4: CSA, 128: HCA}
MLP_KINDS = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass(frozen=True)
class RopeSpec:
    """One RoPE table: plain (``yarn_factor is None``) or YaRN-scaled inverse frequencies.

    DeepSeek-V4 never multiplies cos/sin by YaRN's attention factor (HF forces it to 1.0).
    """

    theta: float
    rope_dim: int
    yarn_factor: float | None = None
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.theta <= 0 or self.rope_dim <= 0 or self.rope_dim % 2:
            raise ValueError(f"bad rope spec {self}")
        if self.yarn_factor is not None and not self.original_max_position:
            raise ValueError("YaRN rope needs original_max_position")


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int  # trailing dims of each head that carry RoPE
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_ratio: int
    hca_ratio: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    main_rope: RopeSpec
    compress_rope: RopeSpec
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 16384
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    # MTP modules in the checkpoint (HF's ``num_nextn_predict_layers``; HF does not build them)
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank",
                     "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
                     "index_topk", "num_experts", "experts_per_token", "moe_intermediate_size", "hc_mult"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if len(self.layer_types) != self.num_layers or len(self.mlp_layer_types) != self.num_layers:
            raise ValueError("layer_types and mlp_layer_types need one entry per layer")
        if bad := [t for t in self.layer_types if t not in ATTENTION_KINDS]:
            raise ValueError(f"unknown attention layer types {bad}")
        if bad := [t for t in self.mlp_layer_types if t not in MLP_KINDS]:
            raise ValueError(f"unknown mlp layer types {bad}")
        if self.num_heads % self.o_groups:
            raise ValueError("num_heads must be divisible by o_groups")
        if not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim) or self.rope_head_dim % 2:
            raise ValueError("rope_head_dim must be even and fit in head_dim and index_head_dim")
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token exceeds num_experts")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}")
        if self.csa_ratio <= 1 or self.hca_ratio <= 1:
            raise ValueError("compression ratios must be > 1")

    @property
    def architecture(self) -> str:
        return "DeepseekV4ForCausalLM"

    def ratio(self, layer: int) -> int:
        """Compression ratio of ``layer`` (0 for sliding-window-only layers)."""
        kind = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[kind]

    @cached_property
    def layers_of_kind(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(i for i, t in enumerate(self.layer_types) if t == k) for k in ATTENTION_KINDS}

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DeepseekV4Config:
        """Builds the config from an HF ``config.json`` dict (current or legacy key layout).

        A missing required key raises ``ValueError`` naming it."""
        try:
            return cls._from_hf_dict(d)
        except KeyError as e:
            raise ValueError(f"DeepSeek-V4 config.json lacks required key {e.args[0]!r}") from None

    @classmethod
    def _from_hf_dict(cls, d: dict[str, Any]) -> DeepseekV4Config:
        n = d["num_hidden_layers"]
        rates = {CSA: 4, HCA: 128, **(d.get("compress_rates") or {})}
        rates[CSA] = d.get("compress_rate_csa", rates[CSA])
        rates[HCA] = d.get("compress_rate_hca", rates[HCA])
        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            layer_types = [_RATIO_TO_KIND[r] for r in d["compress_ratios"]]
        if layer_types is None:  # HF default: 2 HCA bootstrap layers, then CSA/HCA interleave
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = d.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = d.get("head_dim", 512)
        if d.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * d["partial_rotary_factor"])
        else:
            rope_dim = d.get("qk_rope_head_dim", head_dim // 8)
        rp: dict[str, Any] = d.get("rope_parameters") or d.get("rope_scaling") or {}
        main_rp: dict[str, Any] = rp["main"] if isinstance(rp.get("main"), dict) else {}
        comp_rp: dict[str, Any] = rp["compress"] if isinstance(rp.get("compress"), dict) else rp
        main_rope = RopeSpec(float(main_rp.get("rope_theta", d.get("rope_theta", 10000.0))), rope_dim)
        comp_theta = float(comp_rp.get("rope_theta", d.get("compress_rope_theta", 160000.0)))
        if comp_rp.get("rope_type", comp_rp.get("type", "default")) == "yarn":
            compress_rope = RopeSpec(
                comp_theta, rope_dim, yarn_factor=float(comp_rp["factor"]),
                original_max_position=int(comp_rp["original_max_position_embeddings"]),
                beta_fast=float(comp_rp.get("beta_fast") or 32), beta_slow=float(comp_rp.get("beta_slow") or 1),
            )
        else:
            compress_rope = RopeSpec(comp_theta, rope_dim)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_layers=n,
            num_heads=d["num_attention_heads"], head_dim=head_dim, rope_head_dim=rope_dim,
            q_lora_rank=d["q_lora_rank"], o_groups=d["o_groups"], o_lora_rank=d["o_lora_rank"],
            layer_types=tuple(layer_types[:n]), mlp_layer_types=tuple(mlp_types[:n]),
            csa_ratio=rates[CSA], hca_ratio=rates[HCA], sliding_window=d.get("sliding_window", 128),
            index_n_heads=d["index_n_heads"], index_head_dim=d["index_head_dim"], index_topk=d["index_topk"],
            num_experts=int(d["n_routed_experts"] if "n_routed_experts" in d else d["num_local_experts"]),
            experts_per_token=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
            main_rope=main_rope, compress_rope=compress_rope,
            scoring_func=d.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(d.get("swiglu_limit", 10.0)), hc_mult=d.get("hc_mult", 4),
            hc_sinkhorn_iters=d.get("hc_sinkhorn_iters", 20), hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 16384),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), eos_token_ids=eos_ids,
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0),
        )
