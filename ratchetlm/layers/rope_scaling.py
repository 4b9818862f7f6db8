"""RoPE frequency variants: the inverse frequencies and the cos/sin scale each scaling asks for.

A checkpoint that was trained (or extended) with a scaled RoPE runs wrong, silently, when the
scaling is dropped: positions past the original context rotate at the wrong speed. The variants
here follow the published recipes, with HF ``rope_parameters`` field names:

* ``linear``   — position interpolation: every frequency divided by ``factor``.
* ``llama3``   — Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth ramp
  between the wavelengths ``original_max / low_freq_factor`` and ``original_max / high_freq_factor``.
* ``yarn``     — YaRN: a ramp over dimensions (from ``beta_fast`` to ``beta_slow`` rotations in the
  original context) between interpolated and original frequencies, and an ``attention_factor``
  (``0.1 ln(factor) + 1`` unless given) that scales cos and sin.
* ``longrope`` — Phi-3 LongRoPE ("su"): per-frequency divisors, one set for short and one for long
  contexts, and ``attention_factor = sqrt(1 + ln(factor) / ln(original_max))``.
* ``freq_factors`` — per-frequency divisors given as data: GGUF's ``rope_freqs`` tensor, which is
  how llama.cpp stores Llama 3 scaling.

LongRoPE picks its factor set by context length. The engine decides once, by its context length
(``max_model_len``), as llama.cpp does by ``n_ctx``: a KV cache must never mix keys rotated with two
frequency sets. HF transformers decides per forward by the sequence's length, so the two agree for
any sequence when the context length is at most ``original_max_position_embeddings``, and for
sequences longer than that otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("linear", "llama3", "yarn", "longrope", "freq_factors")


@dataclass(frozen=True)
class RopeScaling:
    type: str
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    mscale: float = 0.0  # yarn: DeepSeek-style attention factor numerator (0 = unused)
    mscale_all_dim: float = 0.0  # yarn: ... and denominator
    attention_factor: float | None = None  # scale of cos/sin; None = the variant's default
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    freq_factors: tuple[float, ...] = ()  # freq_factors (GGUF rope_freqs)

    def __post_init__(self) -> None:
        if self.type not in ROPE_TYPES:
            raise ValueError(f"unsupported RoPE scaling type {self.type!r}; supported: {', '.join(ROPE_TYPES)}")
        if self.type in ("linear", "llama3", "yarn") and not self.factor > 0:
            raise ValueError(f"RoPE scaling {self.type!r} needs factor > 0, got {self.factor}")
        if self.type in ("llama3", "yarn", "longrope") and self.original_max_position_embeddings <= 0:
            raise ValueError(f"RoPE scaling {self.type!r} needs original_max_position_embeddings > 0")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("RoPE scaling 'llama3' needs high_freq_factor > low_freq_factor")
        if self.type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("RoPE scaling 'longrope' needs short_factor and long_factor of equal length")
        if self.type == "freq_factors" and not self.freq_factors:
            raise ValueError("RoPE scaling 'freq_factors' needs the per-frequency factors")

    @staticmethod
    def from_hf(p: dict, max_position_embeddings: int) -> RopeScaling | None:
        """From a HF ``rope_parameters`` dict (transformers-normalised); None for plain RoPE."""
        kind = p.get("rope_type", p.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind == "su":
            kind = "longrope"
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling {p!r}; supported types: default, {', '.join(ROPE_TYPES[:4])}")
        orig = int(p.get("original_max_position_embeddings") or 0)
        factor = p.get("factor")
        if factor is None and orig:  # Phi-3 / DeepSeek: the context extension ratio
            factor = max_position_embeddings / orig
        fields = dict(
            type=kind, factor=float(factor if factor is not None else 1.0),
            original_max_position_embeddings=orig,
            attention_factor=None if p.get("attention_factor") is None else float(p["attention_factor"]),
        )
        if kind == "llama3":
            fields.update(low_freq_factor=float(p["low_freq_factor"]), high_freq_factor=float(p["high_freq_factor"]))
        elif kind == "yarn":
            fields.update(beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                          truncate=bool(p.get("truncate", True)), mscale=float(p.get("mscale") or 0),
                          mscale_all_dim=float(p.get("mscale_all_dim") or 0))
        elif kind == "longrope":
            fields.update(short_factor=tuple(float(x) for x in p["short_factor"]),
                          long_factor=tuple(float(x) for x in p["long_factor"]))
        return RopeScaling(**fields)


def rope_frequencies(
    theta: float, dim: int, scaling: RopeScaling | None, context_len: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim // 2]`` fp32 for a rotary dimension ``dim`` and the factor that
    scales cos and sin. ``context_len``: the engine's context length (LongRoPE's short/long pick)."""
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (theta**exponent)  # [dim // 2]
    if scaling is None:
        return inv_freq, 1.0
    s = scaling
    if s.type == "linear":
        return inv_freq / s.factor, 1.0
    if s.type == "freq_factors":
        return inv_freq / _factors(s.freq_factors, dim), 1.0
    if s.type == "llama3":
        return _llama3(inv_freq, s), 1.0
    if s.type == "yarn":
        return _yarn(theta, dim, s)
    # longrope
    ext = s.long_factor if context_len > s.original_max_position_embeddings else s.short_factor
    attn = s.attention_factor
    if attn is None:
        orig = s.original_max_position_embeddings
        attn = 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(orig))
    return 1.0 / (_factors(ext, dim) * theta**exponent), attn


def _factors(values: tuple[float, ...], dim: int) -> torch.Tensor:
    if len(values) != dim // 2:
        raise ValueError(f"RoPE scaling has {len(values)} per-frequency factors, the rotary dimension needs {dim // 2}")
    return torch.tensor(values, dtype=torch.float32)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    orig = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = orig / s.low_freq_factor, orig / s.high_freq_factor
    # long wavelengths (low frequencies) interpolate fully, short ones are kept, a ramp in between
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    ramped = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, ramped, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.attention_factor
    if attn is None:
        attn = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim) if s.mscale and s.mscale_all_dim \
            else mscale(s.factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in the original context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp  # 1 = the original (extrapolated) frequency, 0 = interpolated by `factor`
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attn)
