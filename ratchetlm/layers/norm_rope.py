"""RMSNorm and rotary embeddings from explicit per-token positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, same values as the three-step form below (checked in tests/core/test_layers.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 (as HF does) and cast back, so bf16 runs match the reference closely.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE; cos/sin tables are indexed by absolute position ids."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._build(max_positions)

    def _build(self, n: int) -> None:
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        t = torch.arange(n, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq.float())
        self.cos_table = torch.cat([freqs.cos(), freqs.cos()], dim=-1)  # [n, head_dim] fp32
        # sign of rotate-half folded in: x*cos + rotate_half(x)*sin == x*cos + roll(x, d/2)*sin_signed, exactly
        self.sin_table = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_tokens]`` positions → cos, sin ``[num_tokens, 1, head_dim]`` fp32 (once per forward)."""
        if self.cos_table.device != positions.device:
            self.cos_table = self.cos_table.to(positions.device)
            self.sin_table = self.sin_table.to(positions.device)
        assert int(positions.max()) < self.cos_table.shape[0], "position beyond the RoPE table"
        return self.cos_table[positions].unsqueeze(1), self.sin_table[positions].unsqueeze(1)

    @staticmethod
    def rotate(
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    @staticmethod
    def rotate_packed(
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim]: Q and K heads side by side
    ) -> torch.Tensor:
        """:meth:`rotate` for Q and K heads in one tensor: one set of ops instead of two."""
        return _rotate(qk, *cos_sin)


def _rotate(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim] fp32
    sin: torch.Tensor,  # [num_tokens, 1, head_dim] fp32, first half negated (see _build)
) -> torch.Tensor:
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)
