"""The fused fast forms of RMSNorm and RoPE equal their textbook definitions bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ratchetlm import kernels
from ratchetlm.layers.norm_rope import RMSNorm, RotaryEmbedding, _norm_lanes


def test_rmsnorm_fused_equals_three_step_definition():
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(7, 576) * 3
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(norm(x), ref)
    # bf16 path: fp32 statistics, weight applied in bf16 (as HF)
    xb = x.bfloat16()
    normb = RMSNorm(576, 1e-5).bfloat16()
    xf = xb.float()
    refb = normb.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(normb(xb), refb)


def test_rmsnorm_kernel_equals_torch_bit_for_bit():
    """kernels/norm_rope.c replays torch.rms_norm's summation order: the same bits at every width (shorter
    than a vector, scalar tails, every level of the cascade sum), magnitude and row count (one
    thread and the parallel loop), with a Gemma weight offset, and with the residual add fused in."""
    assert kernels.load() is None or _norm_lanes() > 0, "the kernel must reproduce this torch build"
    g = torch.Generator().manual_seed(1)
    for dim, rows in [(1, 3), (5, 2), (8, 1), (9, 4), (31, 2), (64, 1), (576, 1), (576, 130), (960, 3),
                      (2050, 2), (16384 + 24, 2), (32000, 1)]:
        for offset in (0.0, 1.0):
            norm = RMSNorm(dim, 1e-6, offset)
            x = torch.randn(rows, dim, generator=g) * 10 ** (8 * torch.rand(rows, 1, generator=g) - 4)
            h = torch.randn(rows, dim, generator=g)
            with torch.inference_mode():
                norm.weight.copy_(torch.randn(dim, generator=g))
                w = norm.weight + offset
                assert torch.equal(norm(x), F.rms_norm(x, (dim,), w, 1e-6)), (dim, rows, offset)
                s, y = norm.forward_residual(x, h)
                assert torch.equal(s, x + h) and torch.equal(y, F.rms_norm(x + h, (dim,), w, 1e-6)), (dim, rows)
                x3 = x.view(rows, 1, dim).expand(rows, 2, dim)  # non-contiguous, 3-D
                assert torch.equal(norm(x3), F.rms_norm(x3, (dim,), w, 1e-6))


def _rotate_half_reference(x, positions, theta, d):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = torch.outer(positions.float(), inv)
    cos = torch.cat([f.cos(), f.cos()], -1)[:, None]
    sin = torch.cat([f.sin(), f.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def test_rope_packed_and_separate_equal_rotate_half_definition():
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 10000.0, 256)
    positions = torch.tensor([0, 5, 17, 255, 3])
    q, k = torch.randn(5, 9, 64), torch.randn(5, 3, 64)
    cs = rope.cos_sin(positions)
    rq, rk = RotaryEmbedding.rotate(cs, q, k)
    assert torch.equal(rq, _rotate_half_reference(q, positions, 10000.0, 64))
    assert torch.equal(rk, _rotate_half_reference(k, positions, 10000.0, 64))
    packed = RotaryEmbedding.rotate_packed(cs, torch.cat([q, k], dim=1))
    assert torch.equal(packed, torch.cat([rq, rk], dim=1))


def test_rope_kernel_equals_torch_ops_bit_for_bit():
    """kernels/norm_rope.c rotates as torch's ``x * cos + roll(x) * sin`` (the tail of a partial rotary
    copied), on a strided view of a fused QKV row as the model passes it."""
    torch.manual_seed(0)
    for head_dim, rotary in ((64, 64), (128, 64), (80, 32)):
        rope = RotaryEmbedding(head_dim, 10000.0, 512, rotary_dim=rotary)
        positions = torch.tensor([0, 5, 17, 300, 3, 511])
        cos, sin = rope.cos_sin(positions)
        qkv = torch.randn(6, 13 * head_dim) * 100
        x = qkv[:, : 12 * head_dim].view(6, 12, head_dim)  # rows 13 heads apart
        xr = x[..., :rotary]
        ref = torch.cat([xr * cos + xr.roll(rotary // 2, dims=-1) * sin, x[..., rotary:]], dim=-1)
        assert torch.equal(RotaryEmbedding.rotate_packed((cos, sin), x), ref), (head_dim, rotary)
