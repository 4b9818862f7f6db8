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

The formats are rows of one table (``RATCHET_TYPES`` in ``kernels/dequant.c``); ``SUPPORTED_TYPES``
lists them by GGUF name in the same order.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ratchetlm import kernels

# GGUF tensor types the kernels read, in the order of the C table (kernels/dequant.c).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


class UnsupportedTensorType(ValueError):
    """A GGUF tensor stored in a format the kernels do not read (e.g. the IQ formats)."""


def type_sizes(type_name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type."""
    from ratchetlm.models.gguf_file import TYPE_SIZES

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

    def __post_init__(self) -> None:
        assert self.parts and all(p.k == self.parts[0].k for p in self.parts), "parts must share K"

    @property
    def shape(self) -> tuple[int, int]:
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
) -> torch.Tensor:  # [M, N] fp32
    """``x @ w.T`` through the compiled kernels (``lib``: a specific build, default the best one)."""
    lib = lib or kernels.load()
    assert lib is not None, "block_matmul needs the compiled kernels (check usable() first)"
    x = x.contiguous()
    m, k = x.shape
    n, wk = w.shape
    assert k == wk and x.dtype == torch.float32 and x.device.type == "cpu", (x.shape, w.shape, x.dtype)
    y = torch.empty(m, n, dtype=torch.float32)
    parts = w.c_parts()
    if lib is not kernels.load():  # another build: rebuild the parts (same layout, fresh array)
        parts = (kernels.Part * len(w.parts))(*(p.c_part() for p in w.parts))
    lib.ratchet_mm(x.data_ptr(), m, k, parts, len(w.parts), y.data_ptr(), n, threads or torch.get_num_threads())
    return y


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

    def use_blocks(self, w: BlockWeight) -> None:
        assert w.shape == (self.out_features, self.in_features), (w.shape, self.out_features, self.in_features)
        self.blocks = w
        self.weight = None  # type: ignore[assignment]  # no dense copy

    def dense_weight(self) -> torch.Tensor:  # [out, in]: the weight, dequantized if need be
        return self.weight if self.blocks is None else self.blocks.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return F.linear(x, self.weight, self.bias)
        if usable(x.reshape(-1, x.shape[-1])):
            y = block_matmul(x.reshape(-1, x.shape[-1]), self.blocks).view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
        return F.linear(x, _dequantized(self.blocks, x), self.bias)  # slow path: autograd, other dtypes


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be a :class:`BlockWeight`: rows are dequantized as gathered.
    ``as_head`` multiplies by the table (a tied LM head)."""

    blocks: BlockWeight | None = None

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
            return block_matmul(hidden, self.blocks)
        return F.linear(hidden, _dequantized(self.blocks, hidden)).float()


def dense_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with block weights dequantized (to warm-start a dense copy)."""
    out = dict(module.state_dict())
    for name, sub in module.named_modules():
        if isinstance(sub, (Linear, Embedding)) and sub.blocks is not None:
            out[f"{name}.weight" if name else "weight"] = sub.blocks.dequantize()
    return out
