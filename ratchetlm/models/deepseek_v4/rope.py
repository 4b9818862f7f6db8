"""Interleaved (GPT-J style) partial RoPE on the trailing ``rope_dim`` channels of a head.

V4 lays each head out as ``[nope | rope]`` and rotates adjacent channel pairs
``(2i, 2i+1)`` by ``pos * inv_freq[i]``. The compressed branches use a YaRN-scaled table
(``compress_rope_theta``); sliding-only layers use the plain ``rope_theta`` table.
"""

from __future__ import annotations

import math

import torch

from ratchetlm.models.deepseek_v4.config import RopeSpec


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """``[rope_dim // 2]`` float32 inverse frequencies, YaRN-blended when the spec asks for it."""
    dim = spec.rope_dim
    base = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if spec.yarn_factor is None:
        return base

    # YaRN: keep high-frequency pairs (many rotations over the original context) as they are,
    # divide low-frequency pairs by the factor, and ramp linearly in between.
    original = spec.original_max_position
    assert original is not None, "RopeSpec validates: YaRN has original_max_position"

    def pair_index_for_rotations(rotations: float) -> float:
        wavelength_budget = original / (rotations * 2 * math.pi)
        return dim * math.log(wavelength_budget) / (2 * math.log(spec.theta))

    low = float(max(math.floor(pair_index_for_rotations(spec.beta_fast)), 0))
    high = float(min(math.ceil(pair_index_for_rotations(spec.beta_slow)), dim - 1))
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = extrapolate (unscaled), 0 = interpolate (scaled by 1/factor)
    return base / spec.yarn_factor * (1 - keep) + base * keep


class RopeTable:
    """cos/sin lookup for absolute positions ``[0, max_positions)``, computed in float32."""

    def __init__(self, spec: RopeSpec, max_positions: int) -> None:
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq(spec)[None, :]
        self.cos = angles.cos()  # [max_positions, rope_dim // 2]
        self.sin = angles.sin()
        self.rope_dim = spec.rope_dim
        self.max_positions = max_positions

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotates the trailing rope channels of ``x``.

        x: ``[*lead, *heads, dim]`` where ``positions`` has shape ``lead`` (heads broadcast).
        ``inverse`` rotates by ``-pos`` (used to de-rotate the attention output).
        """
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise IndexError(f"position {int(positions.max())} beyond rope capacity {self.max_positions}")
        cos, sin = self.cos[positions], self.sin[positions]  # [*lead, rope_dim // 2]
        extra = x.dim() - positions.dim() - 1
        cos = cos.view(*cos.shape[:-1], *([1] * extra), cos.shape[-1])
        sin = sin.view(*sin.shape[:-1], *([1] * extra), sin.shape[-1])
        if inverse:
            sin = -sin
        nope, rope = x[..., : -self.rope_dim], x[..., -self.rope_dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
