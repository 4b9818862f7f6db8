"""RMSNorm and rotary embeddings from explicit per-token positions."""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ratchetlm import kernels
from ratchetlm.layers.rope_scaling import RopeScaling, rope_frequencies


class RMSNorm(nn.Module):
    """``offset``: the weight is applied as ``offset + weight`` (Gemma stores ``w`` and scales by ``1 + w``)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, same values as the three-step form below (checked in tests/core/test_layers.py);
            # on CPU the C kernel, bit-identical to it (kernels/norm_rope.c), where it can
            w = self.weight + self.offset if self.offset else self.weight
            y = _kernel_rms_norm(x, w, self.eps)
            return F.rms_norm(x, self.weight.shape, w, self.eps) if y is None else y
        # Normalise in fp32 (as HF does) and cast back, so bf16 runs match the reference closely.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma: the scale is applied in fp32, then cast (HF's order)
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def forward_residual(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + h, self(x + h))``: a residual add and the norm after it, one kernel call on CPU fp32."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and h.shape == x.shape:
            w = self.weight + self.offset if self.offset else self.weight
            y = _kernel_rms_norm(x, w, self.eps, h)
            if y is not None:
                return y
        x = x + h
        return x, self.forward(x)


# torch sums a row of this many elements or more in parallel chunks when it is the only row (another
# order): such rows stay with torch
TORCH_GRAIN = 32768
_lanes: list[int] = []  # torch's sum lane count as kernels/norm_rope.c replays it; 0: no match (use torch)


def _norm_lanes() -> int:
    """The vector width with which kernels/norm_rope.c reproduces ``torch.rms_norm`` bit for bit on this
    torch build: tried on random rows of several widths and magnitudes once per process; 0 if none."""
    if not _lanes:
        _lanes.append(0)
        lib = kernels.load()
        if lib is not None:
            g = torch.Generator().manual_seed(0)
            for lanes in (8, 16):
                if all(_matches_torch(lib, lanes, dim, g) for dim in (7, 17, 64, 100, 576, 2048, 4099)):
                    _lanes[0] = lanes
                    break
    return _lanes[0]


def _matches_torch(lib: ctypes.CDLL, lanes: int, dim: int, g: torch.Generator) -> bool:
    x = torch.randn(16, dim, generator=g) * torch.logspace(-3, 3, 16)[:, None]
    w = torch.randn(dim, generator=g)
    out = torch.empty_like(x)
    lib.ratchet_rms_norm(x.data_ptr(), None, None, w.data_ptr(), 16, dim, 1e-6, lanes, out.data_ptr(), 1)
    return torch.equal(out, F.rms_norm(x, (dim,), w, 1e-6))


def _kernel_rms_norm(
    x: torch.Tensor,  # [..., dim] fp32
    w: torch.Tensor,  # [dim] fp32
    eps: float,
    h: torch.Tensor | None = None,  # [..., dim] fp32: normalise x + h, and return it too
) -> Any:  # rms_norm(x) | (x + h, rms_norm(x + h)) | None where the kernel cannot run
    """``torch.rms_norm`` through kernels/norm_rope.c (CPU, fp32, no autograd): bit-identical, one call."""
    if x.device.type != "cpu" or w.shape[0] >= TORCH_GRAIN or torch.is_grad_enabled() and (
            x.requires_grad or w.requires_grad or (h is not None and h.requires_grad)):
        return None
    lanes = _norm_lanes()
    if not lanes:
        return None
    lib = kernels.load()
    assert lib is not None
    x, w = x.contiguous(), w.contiguous()
    dim = w.shape[0]
    assert x.shape[-1] == dim and w.dim() == 1, (x.shape, w.shape)
    out = torch.empty_like(x)
    if h is None:
        lib.ratchet_rms_norm(x.data_ptr(), None, None, w.data_ptr(), x.numel() // dim, dim, eps, lanes,
                             out.data_ptr(), torch.get_num_threads())
        return out
    h = h.contiguous()
    s = torch.empty_like(x)
    lib.ratchet_rms_norm(x.data_ptr(), h.data_ptr(), s.data_ptr(), w.data_ptr(), x.numel() // dim, dim, eps, lanes,
                         out.data_ptr(), torch.get_num_threads())
    return s, out


class RotaryEmbedding:
    """Neox-style (rotate-half) RoPE; cos/sin tables are indexed by absolute position ids.

    ``rotary_dim`` < ``head_dim``: partial rotary (the first ``rotary_dim`` dims of each head turn,
    the rest pass through). ``scaling``: a RoPE variant (layers/rope_scaling.py); its frequencies
    and cos/sin scale are fixed for a ``context_len`` (LongRoPE picks its factor set by it). Tables
    are fp32, built on first use and grown on demand; not module state (no dtype casts, no meta init).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        scaling: RopeScaling | None = None,
        rotary_dim: int | None = None,
        context_len: int | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        assert self.rotary_dim % 2 == 0 and self.rotary_dim <= head_dim, (self.rotary_dim, head_dim)
        self.theta = theta
        self.scaling = scaling
        self.max_positions = max_positions
        self.cos_table: torch.Tensor | None = None  # [n, rotary_dim] fp32
        self.sin_table: torch.Tensor | None = None
        self.set_context_len(context_len or max_positions)

    def set_context_len(self, n: int) -> None:
        """Fix the frequencies for a context of ``n`` tokens (drops the tables if they change)."""
        self.context_len = n
        self.cos_table = self.sin_table = None  # built on first use (a model may be created on the meta device)

    def _build(self, n: int) -> None:
        device = "cpu" if self.cos_table is None else self.cos_table.device
        self.inv_freq, self.attention_factor = rope_frequencies(self.theta, self.rotary_dim, self.scaling,
                                                                self.context_len)
        t = torch.arange(n, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, self.inv_freq)
        cos, sin = freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        self.cos_table = torch.cat([cos, cos], dim=-1).to(device)  # [n, rotary_dim] fp32
        # sign of rotate-half folded in: x*cos + rotate_half(x)*sin == x*cos + roll(x, d/2)*sin_signed, exactly
        self.sin_table = torch.cat([-sin, sin], dim=-1).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_tokens]`` positions → cos, sin ``[num_tokens, 1, rotary_dim]`` fp32 (once per forward)."""
        have = 0 if self.cos_table is None else self.cos_table.shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if self.cos_table is None or need > have:
            self._build(max(need, self.context_len + 64, 2 * have))  # +64: lookahead tokens
        assert self.cos_table is not None and self.sin_table is not None
        if self.cos_table.device != positions.device:
            self.cos_table = self.cos_table.to(positions.device)
            self.sin_table = self.sin_table.to(positions.device)
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
    cos: torch.Tensor,  # [num_tokens, 1, rotary_dim] fp32
    sin: torch.Tensor,  # [num_tokens, 1, rotary_dim] fp32, first half negated (see _build)
) -> torch.Tensor:
    rd = cos.shape[-1]
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3 and x.stride(-1) == 1 \
            and x.stride(-2) == x.shape[-1] and cos.is_contiguous() and sin.is_contiguous() \
            and not (torch.is_grad_enabled() and x.requires_grad):
        lib = kernels.load()
        if lib is not None:  # kernels/norm_rope.c: the same three roundings per value, one call instead of four ops
            assert cos.shape == sin.shape == (x.shape[0], 1, rd), (cos.shape, x.shape)
            out = torch.empty(x.shape, dtype=x.dtype)
            lib.ratchet_rope(x.data_ptr(), x.shape[0], x.shape[1], x.shape[2], x.stride(0), cos.data_ptr(),
                             sin.data_ptr(), rd, out.data_ptr())
            return out
    if rd < x.shape[-1]:  # partial rotary: the tail of each head passes through unrotated
        return torch.cat([_rotate(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    if x.dtype == torch.float32:  # the same ops without two no-op conversions
        return x * cos + x.roll(rd // 2, dims=-1) * sin
    xf = x.float()
    return (xf * cos + xf.roll(rd // 2, dims=-1) * sin).to(x.dtype)
