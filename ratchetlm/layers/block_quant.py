"""GGUF block-quantized weights kept next to their dense copy, and the linear layer that uses them.

A GGUF model's Q4_1 / Q8_0 tensors are dequantized for the dense path (prefill, GPUs, bf16) and
*also* kept as blocks. Decode-size matmuls (few rows) on CPU in fp32 then read the blocks
(5 or 8.5 bits per weight instead of 32) through the fused kernel in ``ratchetlm/kernels``: at
batch 1 the model is weight-read bound, so reading ~6x fewer bytes is the whole speed-up.

Contract: the kernel dequantizes each weight with exactly gguf-py's float operations, so the
weights it multiplies are bit-identical to the dense copy; outputs differ from ``F.linear`` only
by fp32 summation order (~1e-6 relative).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ratchetlm import kernels

QK = 32  # weights per GGUF block for Q4_1 and Q8_0
# Fused kernel up to at least this many rows of x. Above it, whichever of the kernel and BLAS sgemm
# on the dense copy is faster depends on the machine (docs/architecture.md, "GGUF block kernels"):
# on an Intel CPU MKL's sgemm won past ~110 rows, on an AMD EPYC the kernel won up to 1,024.
MAX_FUSED_ROWS = 96
PROBE_ROWS = (128, 256, 512, 1024)  # row counts fused_rows_limit() measures above MAX_FUSED_ROWS
_fused_rows: int | None = None  # the measured limit: a property of this machine, found once per process


@dataclass(frozen=True)
class BlockWeight:
    """Rows of a ``[N, K]`` weight as GGUF blocks along K."""

    kind: str  # "q4_1" | "q8_0"
    qs: torch.Tensor  # [N, K/32, 16] uint8 (q4_1 nibbles) | [N, K/32, 32] int8 (q8_0)
    d: torch.Tensor  # [N, K/32] fp32 block scales
    m: torch.Tensor | None  # [N, K/32] fp32 block minimums (q4_1 only)

    def __post_init__(self) -> None:
        assert self.kind in ("q4_1", "q8_0"), self.kind
        assert self.d.dtype == torch.float32 and self.d.shape == self.qs.shape[:2]
        assert (self.m is not None) == (self.kind == "q4_1")

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * QK

    @staticmethod
    def from_gguf(type_name: str, raw: np.ndarray) -> BlockWeight | None:
        """From a GGUF tensor's raw bytes ``[N, K/32 * block_bytes]``; None for other quant types."""
        n = raw.shape[0]
        if type_name == "Q4_1":
            blocks = np.ascontiguousarray(raw).reshape(n, -1, 20)  # fp16 d, fp16 m, 16 bytes of nibbles
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            return BlockWeight("q4_1", torch.from_numpy(blocks[..., 4:].copy()), torch.from_numpy(d),
                               torch.from_numpy(m))
        if type_name == "Q8_0":
            blocks = np.ascontiguousarray(raw).reshape(n, -1, 34)  # fp16 d, 32 int8
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            return BlockWeight("q8_0", torch.from_numpy(blocks[..., 2:].copy().view(np.int8)), torch.from_numpy(d),
                               None)
        return None

    @staticmethod
    def quantize_q8_0(w: torch.Tensor) -> BlockWeight:  # w [N, K] float, K % 32 == 0
        """GGUF Q8_0 of a dense weight (fp16 scale ``max|w| / 127`` per 32 weights, int8 values
        rounded to nearest), for weights that ship dense but run through the block kernels."""
        n, k = w.shape
        assert k % QK == 0, f"Q8_0 needs K divisible by {QK}, got {k}"
        blocks = w.detach().float().cpu().reshape(n, k // QK, QK)
        d = (blocks.abs().amax(dim=-1) / 127.0).half().float()  # [N, K/32], as stored (fp16)
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        qs = (blocks * inv[..., None]).round().clamp_(-127, 127).to(torch.int8)
        return BlockWeight("q8_0", qs.contiguous(), d.contiguous(), None)

    def take_rows(self, order: np.ndarray) -> BlockWeight:  # order: [N] row permutation
        idx = torch.from_numpy(np.asarray(order, dtype=np.int64))
        return BlockWeight(self.kind, self.qs[idx].contiguous(), self.d[idx].contiguous(),
                           None if self.m is None else self.m[idx].contiguous())

    @staticmethod
    def cat(parts: list[BlockWeight]) -> BlockWeight | None:
        """Row-concatenate (fused QKV / gate-up); None unless all parts share one kind and K."""
        if not parts or any(p.kind != parts[0].kind or p.shape[1] != parts[0].shape[1] for p in parts):
            return None
        m = None if parts[0].m is None else torch.cat([p.m for p in parts if p.m is not None])
        return BlockWeight(parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32, the reference the kernel must reproduce
        if self.kind == "q4_1":
            assert self.m is not None
            q = torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1).float()  # [N, nb, 32]
            w = self.d[..., None] * q + self.m[..., None]
        else:
            w = self.qs.float() * self.d[..., None]
        return w.reshape(self.shape)


def fused_matmul(
    x: torch.Tensor,  # [M, K] fp32, CPU
    w: BlockWeight,  # [N, K]
    threads: int | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:  # [M, N] fp32
    """``x @ w.T`` through the compiled kernel (``lib``: a specific build, default the best one).
    Callers on the model path check :func:`usable` first."""
    lib = lib or kernels.load()
    assert lib is not None, "fused_matmul needs the compiled kernels (check usable() first)"
    x = x.contiguous()
    mrows, k = x.shape
    n, wk = w.shape
    assert k == wk and x.dtype == torch.float32 and x.device.type == "cpu", (x.shape, w.shape, x.dtype)
    y = torch.empty(mrows, n, dtype=torch.float32)
    nt = threads or torch.get_num_threads()
    p = ctypes.c_void_p
    if w.kind == "q4_1":
        assert w.m is not None
        lib.ratchet_q4_1_mm(p(x.data_ptr()), mrows, k, p(w.qs.data_ptr()), p(w.d.data_ptr()), p(w.m.data_ptr()),
                            n, p(y.data_ptr()), nt)
    else:
        lib.ratchet_q8_0_mm(p(x.data_ptr()), mrows, k, p(w.qs.data_ptr()), p(w.d.data_ptr()), n, p(y.data_ptr()), nt)
    return y


def usable(x: torch.Tensor, w: BlockWeight | None) -> bool:
    """Whether ``x @ w.T`` should take the fused kernel: CPU fp32, up to :func:`fused_rows_limit`
    rows, kernels built."""
    return (
        w is not None
        and x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and kernels.load() is not None
        and x.shape[0] <= fused_rows_limit()
    )


def fused_rows_limit() -> int:
    """Most rows of ``x`` the fused kernel takes: ``MAX_FUSED_ROWS``, raised to the largest of
    ``PROBE_ROWS`` up to which the kernel beat sgemm on the dense copy by >= 10% on this machine
    (a [1536, 576] Q4_1 weight, the current torch threads, medians of 3; ~0.1 s, once per process).
    Both paths multiply the same weights; only the speed differs."""
    global _fused_rows
    if _fused_rows is None:
        _fused_rows = MAX_FUSED_ROWS if kernels.load() is None else _measure_fused_rows()
    return _fused_rows


def set_fused_rows_limit(rows: int | None) -> None:
    """Fix the limit (benchmarks compare both paths; tests pin it); None measures again on next use."""
    global _fused_rows
    _fused_rows = rows


def _measure_fused_rows() -> int:
    import time

    gen = torch.Generator().manual_seed(0)
    n, k = 1536, 576
    w = BlockWeight("q4_1", torch.randint(0, 256, (n, k // QK, 16), dtype=torch.uint8, generator=gen),
                    torch.rand(n, k // QK, generator=gen) * 0.01, -torch.rand(n, k // QK, generator=gen) * 0.05)
    dense = w.dequantize()

    def best(f) -> float:  # median of 3 after a warm-up
        f()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return sorted(times)[1]

    limit = MAX_FUSED_ROWS
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(rows, k, generator=gen)
            if best(lambda x=x: fused_matmul(x, w)) > 0.9 * best(lambda x=x: F.linear(x, dense)):
                break
            limit = rows
    return limit


class Linear(nn.Linear):
    """``nn.Linear`` that may also hold its weight as GGUF blocks (``blocks``, set after loading).

    Both copies hold the same weights; :func:`usable` picks the path per call.
    """

    blocks: BlockWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if usable(x, self.blocks):
            assert self.blocks is not None
            y = fused_matmul(x, self.blocks)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
