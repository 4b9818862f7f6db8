"""GGUF block weights (read in place from the file) and the Linear / Embedding layers that use them.

A GGUF model's 2-D tensors stay in their stored form — quantized blocks (Q4_K, Q8_0, ...) or
F16/BF16/F32 rows — usually as read-only views into the mmapped file. There is no dense fp32 copy:
on CPU with fp32 activations every matmul, at any number of rows (decode, verify, prefill), goes
through the block kernels in ``ratchetlm/kernels`` (dequantize a panel of rows into a small
per-thread scratch buffer, multiply it with register tiles), and embedding rows are dequantized
as they are gathered. Elsewhere (autograd, other dtypes or devices) the weight is dequantized on
the fly.

Contract: the kernels dequantize with exactly gguf-py's float operations (tests: ``x = I`` gives
gguf-py's ``dequantize`` bit for bit, per format and per instruction-set build), so the model
multiplies the same weights as HF transformers' GGUF loader; each output's fp32 summation order is
fixed per build and independent of the number of rows in the call (batch-invariant).

Numerics (``numerics`` on a layer, the engine's ``--numerics``): "exact" multiplies fp32
activations by the exactly dequantized weights; "int8" / "int16" quantize each activation row in
blocks of 32 to 8 / 16 bits and take integer dot products with the weights' own integer values
(VNNI where the CPU has it, kernels/matmul_int8.c) — faster, not HF-identical, still batch-invariant. Formats without
integer values (F32/F16/BF16) stay exact in both modes.

The formats are rows of one table (``RATCHET_TYPES`` in ``kernels/dequant.c``); ``SUPPORTED_TYPES``
lists them by GGUF name in the same order.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ratchetlm import kernels
from ratchetlm.layers.ggml_types import TYPE_SIZES
from ratchetlm.layers.mapped_pages import release_pages
from ratchetlm.memory import huge_pages

NUMERICS = ("exact", "int8", "int16")
ACTIVATION_BITS = {"int8": 8, "int16": 16}  # integer modes: activation precision (weights stay int8)

# GGUF tensor types the kernels read, in the order of the C table (kernels/dequant.c).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


class UnsupportedTensorType(ValueError):
    """A GGUF tensor stored in a format the kernels do not read (e.g. the IQ formats)."""


def type_sizes(type_name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type."""
    return TYPE_SIZES[type_name]


@dataclass(frozen=True, eq=False)
class BlockPart:
    """A run of output rows stored in one GGUF format: ``data[i]`` holds stored row i's blocks."""

    type_name: str
    data: np.ndarray  # [stored_rows, row_bytes] uint8, usually a read-only view of the mmapped file
    k: int  # weights per row
    rowmap: np.ndarray | None = None  # [rows] int32: output row i reads stored row rowmap[i]

    def __post_init__(self) -> None:
        if self.type_name not in SUPPORTED_TYPES:
            raise UnsupportedTensorType(f"GGUF type {self.type_name} is not supported; supported: "
                                        f"{', '.join(SUPPORTED_TYPES)}")
        blck, nbytes = type_sizes(self.type_name)
        assert self.data.dtype == np.uint8 and self.data.ndim == 2, (self.data.dtype, self.data.shape)
        assert self.k % blck == 0 and self.data.shape[1] == self.k // blck * nbytes, (self.type_name, self.k,
                                                                                     self.data.shape)
        assert self.rowmap is None or (self.rowmap.dtype == np.int32 and self.rowmap.ndim == 1)

    @property
    def rows(self) -> int:
        return self.data.shape[0] if self.rowmap is None else len(self.rowmap)

    def dequantize(self) -> torch.Tensor:  # [rows, k] fp32
        lib = kernels.load()
        rows = np.arange(self.data.shape[0]) if self.rowmap is None else self.rowmap
        if lib is None:  # gguf-py, the reference
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            dense = dequantize(np.ascontiguousarray(self.data[rows]), GGMLQuantizationType[self.type_name])
            return torch.from_numpy(np.array(dense, dtype=np.float32).reshape(len(rows), self.k))
        out = torch.empty(len(rows), self.k, dtype=torch.float32)
        ids = torch.arange(self.rows, dtype=torch.int64)
        lib.ratchet_get_rows(ctypes.byref(self.c_part()), self.k, ids.data_ptr(), len(ids), out.data_ptr(),
                             torch.get_num_threads())
        return out

    def c_part(self) -> kernels.Part:
        data = self.data
        assert data.strides[1] == 1, "rows must be contiguous bytes"
        return kernels.Part(SUPPORTED_TYPES.index(self.type_name), self.rows, data.ctypes.data, data.strides[0],
                            None if self.rowmap is None else self.rowmap.ctypes.data)


@dataclass(frozen=True, eq=False)
class BlockWeight:
    """A ``[N, K]`` weight as GGUF blocks: one part per run of output rows (a fused QKV weight is
    the q, k and v tensors, possibly in three formats), never expanded to fp32 as a whole."""

    parts: tuple[BlockPart, ...]
    _c: list = field(default_factory=list, repr=False)  # cached ctypes array of the parts
    _q8: dict = field(default_factory=dict, repr=False)  # int8-mode packing per kernel build (pack_q8)
    _handles: dict = field(default_factory=dict, repr=False)  # q8_call's per (kernel build, bits)

    def __post_init__(self) -> None:
        assert self.parts and all(p.k == self.parts[0].k for p in self.parts), "parts must share K"

    @functools.cached_property
    def shape(self) -> tuple[int, int]:  # cached: read on every matmul
        return sum(p.rows for p in self.parts), self.parts[0].k

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(p.type_name for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.rows * p.data.shape[1] for p in self.parts)

    @staticmethod
    def from_gguf(type_name: str, raw: np.ndarray, k: int, rowmap: np.ndarray | None = None) -> BlockWeight:
        """A GGUF tensor's data ``[N, ...]`` (any dtype gguf-py gives it) as one part, without a copy."""
        data = raw.reshape(raw.shape[0], -1).view(np.uint8)
        return BlockWeight((BlockPart(type_name, data, k, rowmap),))

    @staticmethod
    def cat(weights: list[BlockWeight]) -> BlockWeight:
        """Row-concatenate (fused QKV / gate-up): the parts side by side, nothing copied."""
        return BlockWeight(tuple(p for w in weights for p in w.parts))

    def take_rows(self, order: np.ndarray) -> BlockWeight:
        """Output rows ``order`` of a single-part weight (a row map over the same data)."""
        assert len(self.parts) == 1, "take_rows needs a single-part weight"
        p = self.parts[0]
        order = np.asarray(order, dtype=np.int64)
        rowmap = (order if p.rowmap is None else p.rowmap[order]).astype(np.int32)
        return BlockWeight((BlockPart(p.type_name, p.data, p.k, rowmap),))

    @staticmethod
    def quantize_q8_0(w: torch.Tensor) -> BlockWeight:  # w [N, K] float, K % 32 == 0
        """GGUF Q8_0 of a dense weight (fp16 scale ``max|w| / 127`` per 32 weights, int8 values
        rounded to nearest), for weights that ship dense but run through the block kernels."""
        n, k = w.shape
        assert k % 32 == 0, f"Q8_0 needs K divisible by 32, got {k}"
        blocks = w.detach().float().cpu().reshape(n, k // 32, 32)
        d = (blocks.abs().amax(dim=-1) / 127.0).half()  # [N, K/32] as stored
        inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
        qs = (blocks * inv[..., None]).round().clamp_(-127, 127).to(torch.int8)
        raw = torch.cat([d[..., None].view(torch.uint8), qs.view(torch.uint8)], dim=-1)  # [N, K/32, 34]
        return BlockWeight.from_gguf("Q8_0", raw.reshape(n, -1).numpy(), k)

    @functools.cached_property
    def int8_capable(self) -> bool:
        """Whether the int8 mode can multiply this weight: every part has integer values, K % 32 == 0."""
        return self.parts[0].k % 32 == 0 and all(p.type_name not in ("F32", "F16", "BF16") for p in self.parts)

    def pack_q8(self, lib: ctypes.CDLL) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The integer modes' layout (kernels/matmul_int8.c), built on first use and kept: per panel
        of 16 output rows its weights' integer values made unsigned, in the VNNI order, in 4 bits
        (nibbles), 5 or 6 (nibbles and a plane of the high bits) or 8, and the format's own factors:
        per row an fp16 D (and D_m) per super-group of up to 256 weights and an int8 multiplier c (and
        c_m) per group of G = 32 weights (16 where the format changes scale within 32), s = D * c
        exactly as the format computes it. Returns (panels [P, 5] int64: the kernel's q8panel_t; Q
        uint8; SM uint8; the weight's zero point). Bytes per weight about the file's: Q4_K 0.58 (file
        0.56), Q6_K 0.82 (0.82), Q5_K 0.70 (0.69), Q4_0 0.59 (0.56), Q8_0 1.09 (1.06)."""
        if id(lib) not in self._q8:
            n, k = self.shape
            npan = (n + 15) // 16
            parts = (kernels.Part * len(self.parts))(*(p.c_part() for p in self.parts))
            panels = np.zeros((npan, 5), np.int64)  # q8panel_t: int32 vb, G, z, has_m, SB, unit; int64 qoff, soff
            sizes = np.zeros(3, np.int64)
            lib.ratchet_q8_plan(parts, len(self.parts), k, panels.ctypes.data, sizes.ctypes.data,
                                torch.get_num_threads())
            if sizes[0] < 0:  # a format row's to_q8w broke its contract (d, dm fp16 values)
                types = "+".join(p.type_name for p in self.parts)
                raise RuntimeError(f"integer packing of a {types} weight: a scale factor is not an fp16 value")
            q = huge_pages.empty(int(sizes[0]))  # streamed every step: huge pages (memory/huge_pages.py)
            sm = huge_pages.empty(int(sizes[1]))
            lib.ratchet_pack_q8(parts, len(self.parts), k, panels.ctypes.data, q.ctypes.data, sm.ctypes.data,
                                torch.get_num_threads())
            self._q8[id(lib)] = panels, q, sm, int(sizes[2])
            for p in self.parts:  # never read again by this weight's integer matmuls (layers/mapped_pages.py)
                release_pages(p.data)
        return self._q8[id(lib)]

    def q8_call(self, lib: ctypes.CDLL, bits: int) -> tuple:
        """(C function, weight handle, N) for ``y = x @ self.T`` in the integer mode of ``bits``, packed
        for ``lib``: one struct pointer per call instead of the packing's arguments (block_matmul, and
        Linear.forward's shortcut to it)."""
        if (id(lib), bits) not in self._handles:  # the struct lives with the weight (its arrays in self._q8)
            panels, q, sm, zw = self.pack_q8(lib)
            n, k = self.shape
            self._handles[id(lib), bits] = kernels.Q8Weight(k, bits, zw, n, panels.ctypes.data, q.ctypes.data,
                                                            sm.ctypes.data)
        return lib.ratchet_mm_q8w, ctypes.addressof(self._handles[id(lib), bits]), self.shape[0]

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32: exactly the weights the kernels multiply
        return torch.cat([p.dequantize() for p in self.parts])

    def c_parts(self) -> ctypes.Array:
        if not self._c:
            self._c.append((kernels.Part * len(self.parts))(*(p.c_part() for p in self.parts)))
        return self._c[0]


def block_matmul(
    x: torch.Tensor,  # [M, K] fp32, CPU
    w: BlockWeight,  # [N, K]
    threads: int | None = None,
    lib: ctypes.CDLL | None = None,
    path: str = "auto",  # "kernel" | "blas" | "auto" (BLAS from blas_rows() rows on)
    numerics: str = "exact",  # "exact" | "int8" | "int16" (integer activations, integer dot products)
) -> torch.Tensor:  # [M, N] fp32
    """``x @ w.T`` through the compiled kernels (``lib``: a specific build, default the best one).

    ``numerics="int8"`` / ``"int16"`` (a weight with integer values, :attr:`BlockWeight.int8_capable`):
    each row of ``x`` quantized to 8 / 16 bits in blocks of 32, integer dot products with the
    weights' int8 values (16 bits as two int8 passes); never BLAS (its summation order depends on
    the row count, and the integer modes must stay batch-invariant).

    Exact mode: many rows (a long prefill chunk) may instead go through BLAS: the weight is dequantized a tile
    at a time into a reused scratch buffer (never the whole matrix) and multiplied by sgemm, where
    this machine measured that faster (:func:`blas_rows`). Both paths multiply the same weights."""
    lib = lib or kernels.load()
    assert lib is not None, "block_matmul needs the compiled kernels (check usable() first)"
    x = x.contiguous()
    m, k = x.shape
    n, wk = w.shape
    assert k == wk and x.dtype == torch.float32 and x.device.type == "cpu", (x.shape, w.shape, x.dtype)
    nt = threads or torch.get_num_threads()
    if numerics in ACTIVATION_BITS and w.int8_capable:  # first: the per-call Python cost shows at one row
        fn, handle, _ = w.q8_call(lib, ACTIVATION_BITS[numerics])
        y = torch.empty(m, n, dtype=torch.float32)
        fn(x.data_ptr(), m, handle, y.data_ptr(), nt)
        return y
    parts = w.c_parts()
    if lib is not kernels.load():  # another build: rebuild the parts (same layout, fresh array)
        parts = (kernels.Part * len(w.parts))(*(p.c_part() for p in w.parts))
    assert numerics in NUMERICS, numerics
    if path == "blas" or (path == "auto" and m >= blas_rows()):
        return _blas_matmul(x, w, parts, lib, nt)
    y = torch.empty(m, n, dtype=torch.float32)
    lib.ratchet_mm(x.data_ptr(), m, k, parts, len(w.parts), y.data_ptr(), n, nt)
    return y


TILE_BYTES = 32 << 20  # dense fp32 weight tile of the BLAS path (one buffer, reused by every layer)
_tile: list[torch.Tensor] = []


def _blas_matmul(x: torch.Tensor, w: BlockWeight, parts: ctypes.Array, lib: ctypes.CDLL, nt: int) -> torch.Tensor:
    (m, k), n = x.shape, w.shape[0]
    rows = max(1, min(n, TILE_BYTES // (4 * k)))
    if not _tile or _tile[0].numel() < rows * k:
        _tile[:] = [torch.empty(rows * k, dtype=torch.float32)]
    tile = _tile[0][: rows * k].view(rows, k)
    if rows == n:
        lib.ratchet_dequant_rows(parts, len(w.parts), 0, n, k, tile.data_ptr(), nt)
        return F.linear(x, tile)
    y = torch.empty(m, n, dtype=torch.float32)
    for r0 in range(0, n, rows):
        r = min(rows, n - r0)
        lib.ratchet_dequant_rows(parts, len(w.parts), r0, r, k, tile.data_ptr(), nt)
        y[:, r0:r0 + r] = F.linear(x, tile[:r])
    return y


BLAS_PROBE_ROWS = (64, 128, 256, 512)
_blas_rows: int | None = None


def blas_rows() -> float:
    """Rows from which a block matmul goes through BLAS on a dequantized tile instead of the
    kernel: the smallest of ``BLAS_PROBE_ROWS`` at which that was >= 10% faster on this machine (a
    [1024, 2048] Q4_K weight, current torch threads, best of 3; ~0.2 s, once per process, on first
    use), or infinity. Only speed depends on it: both paths multiply the same weights."""
    global _blas_rows
    if _blas_rows is None:
        _blas_rows = _measure_blas_rows()
    return float("inf") if _blas_rows <= 0 else _blas_rows


def set_blas_rows(rows: int | None) -> None:
    """Fix the switch point (0 = never BLAS; benchmarks and tests pin it); None measures again."""
    global _blas_rows
    _blas_rows = rows


def _measure_blas_rows() -> int:
    import time

    lib = kernels.load()
    if lib is None:
        return 0
    n, k = 1024, 2048
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = rng.uniform(1e-4, 1e-3, (n, k // 256, 2)).astype(np.float16).view(np.uint8)
    w = BlockWeight.from_gguf("Q4_K", raw.reshape(n, -1), k)

    def best(f: object) -> float:
        assert callable(f)
        f()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    with torch.inference_mode():
        for rows in BLAS_PROBE_ROWS:
            x = torch.randn(rows, k)
            if best(lambda x=x: block_matmul(x, w, path="blas")) < 0.9 * best(
                    lambda x=x: block_matmul(x, w, path="kernel")):
                return rows
    return 0


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` can go through the block kernels: 2-D fp32 on CPU, no gradient wanted, built."""
    return (
        x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not (x.requires_grad and torch.is_grad_enabled())
        and kernels.load() is not None
    )


def _dequantized(w: BlockWeight, like: torch.Tensor) -> torch.Tensor:
    return w.dequantize().to(device=like.device, dtype=like.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may instead be a :class:`BlockWeight` (``use_blocks``): then the
    dense ``weight`` is gone and matmuls read the blocks."""

    blocks: BlockWeight | None = None
    numerics: str = "exact"  # see block_matmul; set for a whole model by set_numerics()
    _q8_call: tuple | None = None  # (C function, weight handle, N, numerics) once the integer packing exists

    def use_blocks(self, w: BlockWeight) -> None:
        assert w.shape == (self.out_features, self.in_features), (w.shape, self.out_features, self.in_features)
        self.blocks = w
        self._q8_call = None
        self.weight = None  # type: ignore[assignment]  # no dense copy

    def dense_weight(self) -> torch.Tensor:  # [out, in]: the weight, dequantized if need be
        return self.weight if self.blocks is None else self.blocks.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q8 = self._q8_call
        if (q8 is not None and q8[3] is self.numerics and x.dim() == 2 and x.dtype is torch.float32
                and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())):
            # integer modes, the packed weight known: block_matmul's integer branch with its checks done
            # once (about 2 us a call of Python and ctypes less: a batch-1 step of the bundled model
            # makes ~120 of these calls)
            fn, handle, n, _ = q8
            x = x.contiguous()
            y = torch.empty(x.shape[0], n, dtype=torch.float32)
            fn(x.data_ptr(), x.shape[0], handle, y.data_ptr(), torch.get_num_threads())
            return y if self.bias is None else y + self.bias
        if self.blocks is None:
            return F.linear(x, self.weight, self.bias)
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (no reshape/view dispatch for 2-D: batch 1 cost)
        if usable(x2):
            y = block_matmul(x2, self.blocks, numerics=self.numerics)
            lib = kernels.load()
            if lib is not None and self.numerics in ACTIVATION_BITS and self.blocks.int8_capable:
                self._q8_call = (*self.blocks.q8_call(lib, ACTIVATION_BITS[self.numerics]), self.numerics)
            y = y if x2 is x else y.view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, _dequantized(self.blocks, x), self.bias)  # slow path: autograd, other dtypes


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be a :class:`BlockWeight`: rows are dequantized as gathered.
    ``as_head`` multiplies by the table (a tied LM head)."""

    blocks: BlockWeight | None = None
    numerics: str = "exact"  # of as_head (the gathered rows are always exact)

    def reset_parameters(self) -> None:
        # A model is built on the meta device and loaded from a checkpoint: nothing to initialise there,
        # and torch's normal_ on a meta tensor goes through torch._refs, which imports torch._dynamo
        # (seconds of model load).
        if not self.weight.is_meta:
            super().reset_parameters()

    def use_blocks(self, w: BlockWeight) -> None:
        assert w.shape == (self.num_embeddings, self.embedding_dim), (w.shape, self.num_embeddings)
        self.blocks = w
        self.weight = None  # type: ignore[assignment]

    def dense_weight(self) -> torch.Tensor:
        return self.weight if self.blocks is None else self.blocks.dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return super().forward(ids)
        lib = kernels.load()
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.num_embeddings:
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
        if lib is None:
            out.copy_(self.blocks.dequantize()[flat])
        else:
            part = self.blocks.parts[0]
            assert len(self.blocks.parts) == 1
            lib.ratchet_get_rows(ctypes.byref(part.c_part()), part.k, flat.data_ptr(), flat.numel(), out.data_ptr(),
                                 torch.get_num_threads())
        return out.view(*ids.shape, -1).to(ids.device)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, dim] -> [n, num_embeddings] fp32
        if self.blocks is None:
            return F.linear(hidden, self.weight).float()
        if usable(hidden):
            return block_matmul(hidden, self.blocks, numerics=self.numerics)
        return F.linear(hidden, _dequantized(self.blocks, hidden)).float()


def set_numerics(module: nn.Module, numerics: str) -> int:
    """Set the numerics of every block layer in ``module``; returns how many weights run in integers."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    n = 0
    for sub in module.modules():
        if isinstance(sub, (Linear, Embedding)) and sub.blocks is not None:
            sub.numerics = numerics
            if isinstance(sub, Linear):
                sub._q8_call = None  # rebuilt at the next integer-mode call
            n += numerics in ACTIVATION_BITS and sub.blocks.int8_capable
    return n


def dense_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with block weights dequantized (to warm-start a dense copy)."""
    out = dict(module.state_dict())
    for name, sub in module.named_modules():
        if isinstance(sub, (Linear, Embedding)) and sub.blocks is not None:
            out[f"{name}.weight" if name else "weight"] = sub.blocks.dequantize()
    return out
