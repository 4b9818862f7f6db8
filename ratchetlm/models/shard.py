"""What one tensor-parallel rank holds of the decoder (the Megatron layout), and its collectives.

Rank ``r`` of ``N``:

* **attention**: query heads ``[r H/N, (r+1) H/N)`` and the KV heads they read. When ``N`` divides
  the ``Hkv`` KV heads each rank holds ``Hkv/N`` of them; when ``N`` is a multiple of ``Hkv``, each
  rank holds the one KV head its query heads read (each KV head is replicated on ``N/Hkv`` ranks,
  as vLLM does). Anything else is refused, naming the numbers. The fused QKV projection is
  column-parallel (its q, k and v rows for those heads), O is row-parallel (the matching input
  columns) and its partial output is summed over the ranks by one all-reduce.
* **MLP**: gate/up rows ``[r I/N, (r+1) I/N)`` (column-parallel), down the matching input columns
  (row-parallel), one all-reduce.
* **embedding and LM head**: vocabulary rows ``[r ceil(V/N), ...)`` (vocab-parallel). The
  embedding gathers the ids it holds, zeroes the others and all-reduces; the head's logits, only
  for the rows a strategy asked for, are gathered at rank 0 (the only rank that samples).
* norms, Q/K norms and rotary tables: replicated. Every rank's paged KV cache holds its own KV heads.

Weights are sliced as they load: dense tensors by ``narrow``; GGUF block weights in place (a row
range is a view of the same blocks or a row map; a column range is a byte range of every row, so
it must start on a block of the tensor's format; refused otherwise, naming the format and numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ratchetlm.layers.block_quant import BlockPart, BlockWeight, type_sizes

COLUMN = ("qkv", "gate_up", "embed", "lm_head")  # output rows split (and the vocabulary)
ROW = ("o_proj", "down")  # input columns split; partial outputs all-reduced


def check_divisible(cfg: Any, n: int) -> None:
    """Raise ValueError, naming the numbers, unless the model's shapes split over ``n`` ranks."""
    h, hkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if h % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the model's {h} attention heads")
    if hkv % n and n % hkv:
        raise ValueError(f"tensor_parallel_size={n} must divide the model's {hkv} KV heads or be a multiple of "
                         f"them (each KV head is then replicated on {n}/{hkv} ranks); neither holds")
    if inter % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the model's MLP width ({inter})")


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``: the local slice sizes and where they start in the full model."""

    rank: int = 0
    size: int = 1
    q0: int = 0  # first query head
    nq: int = 0  # query heads held
    kv0: int = 0  # first KV head
    nkv: int = 0
    i0: int = 0  # first MLP row
    ni: int = 0
    v0: int = 0  # first vocabulary row
    nv: int = 0
    vocab_per: int = 0  # ceil(V / size): every rank's logits are padded to this before the gather
    head_dim: int = 0
    full: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # (H, Hkv, I, V, hidden) of the whole model
    group: Any = field(default=None, compare=False, repr=False)  # c10d ProcessGroupGloo / NCCL (size > 1)

    @staticmethod
    def of(cfg: Any, rank: int = 0, size: int = 1, group: Any = None) -> TPShard:
        check_divisible(cfg, size)
        h, hkv, inter, v, d = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
        nq = h // size
        kv0, nkv = (rank * (hkv // size), hkv // size) if hkv % size == 0 else (rank * hkv // size, 1)
        per = -(-v // size)
        v0 = min(v, rank * per)
        return TPShard(rank, size, rank * nq, nq, kv0, nkv, rank * (inter // size), inter // size, v0,
                       min(v, v0 + per) - v0, per, d, (h, hkv, inter, v, cfg.hidden_size), group)

    # ------------------------------------------------------------------ layout

    def pieces(self, kind: str) -> list[tuple[int, int, int]]:
        """Column-parallel ``kind``: ``(full_row, local_row, rows)`` per run of rows it holds, in local order."""
        h, hkv, inter, v, _ = self.full
        d = self.head_dim
        if kind == "qkv":
            q, kv = h * d, hkv * d
            return [(self.q0 * d, 0, self.nq * d), (q + self.kv0 * d, self.nq * d, self.nkv * d),
                    (q + kv + self.kv0 * d, (self.nq + self.nkv) * d, self.nkv * d)]
        if kind == "gate_up":
            return [(self.i0, 0, self.ni), (inter + self.i0, self.ni, self.ni)]
        assert kind in ("embed", "lm_head"), kind
        return [(self.v0, 0, self.nv)]

    def columns(self, kind: str) -> tuple[int, int]:
        """Row-parallel ``kind``: ``(first input column, columns)`` it holds."""
        if kind == "o_proj":
            return self.q0 * self.head_dim, self.nq * self.head_dim
        assert kind == "down", kind
        return self.i0, self.ni

    def full_rows(self, kind: str) -> int:
        h, hkv, inter, v, _ = self.full
        return {"qkv": (h + 2 * hkv) * self.head_dim, "gate_up": 2 * inter, "embed": v, "lm_head": v}[kind]

    def split(self, kind: str, w: torch.Tensor, first_row: int = 0) -> list[tuple[int | None, torch.Tensor]]:
        """This rank's parts of ``w``, a tensor of ``kind`` covering full rows ``[first_row, first_row +
        len(w))`` (a whole fused weight or one of its parts): ``(local first row, slice)``; ``None`` =
        the whole local tensor. Other kinds (norms, biases of replicated layers) are kept whole."""
        if kind in ROW and w.dim() == 2:
            c0, n = self.columns(kind)
            return [(None, w.narrow(1, c0, n))]
        if kind not in COLUMN:
            return [(None, w)]
        out: list[tuple[int | None, torch.Tensor]] = []
        for full, local, n in self.pieces(kind):
            if first_row <= full and full + n <= first_row + w.shape[0]:
                out.append((local, w.narrow(0, full - first_row, n)))
        return out

    def split_blocks(self, kind: str, w: BlockWeight, name: str) -> BlockWeight:
        """This rank's part of a whole block weight, without copying or dequantizing."""
        if kind in ROW:
            c0, n = self.columns(kind)
            return col_slice(w, c0, c0 + n, name)
        if kind not in COLUMN:
            return w
        return BlockWeight.cat([row_slice(w, f, f + n) for f, _, n in self.pieces(kind)])

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs over the ranks (in place)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self.group.allreduce([x]).wait()
        return x

    def embed(self, embedding: Any, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """Vocab-parallel lookup: rows this rank holds, zeros for the others, summed over the ranks."""
        if self.size == 1:
            return embedding(ids)
        local = ids - self.v0
        outside = (local < 0) | (local >= self.nv)
        x = embedding(local.masked_fill(outside, 0))
        return self.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:  # [n, nv] -> rank 0: [n, V]
        """The vocab shards' logits side by side at rank 0; other ranks get an empty ``[n, 0]``."""
        if self.size == 1:
            return local
        import torch.distributed as dist

        opts = dist.GatherOptions()
        opts.rootRank = 0
        n = local.shape[0]
        if n == 0:
            return local.new_empty(0, self.full[3] if self.rank == 0 else 0)
        local = F.pad(local, (0, self.vocab_per - local.shape[1])).contiguous()
        if self.rank != 0:
            self.group.gather([], [local], opts).wait()
            return local[:, :0]
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.group.gather([parts], [local], opts).wait()
        return torch.cat([p[:, : self.vocab_rows(r)] for r, p in enumerate(parts)], dim=1)

    def vocab_rows(self, r: int) -> int:
        """Vocabulary rows rank ``r`` holds."""
        v = self.full[3]
        return max(0, min(v, (r + 1) * self.vocab_per) - min(v, r * self.vocab_per))


# ---------------------------------------------------------------------- block weights, sliced in place


def row_slice(w: BlockWeight, start: int, stop: int) -> BlockWeight:
    """Output rows ``[start, stop)`` of ``w``: views of the same blocks (a row map where there is one)."""
    parts, off = [], 0
    for p in w.parts:
        a, b = max(start, off) - off, min(stop, off + p.rows) - off
        if a < b:
            if p.rowmap is None:
                parts.append(BlockPart(p.type_name, p.data[a:b], p.k))
            else:
                parts.append(BlockPart(p.type_name, p.data, p.k, np.ascontiguousarray(p.rowmap[a:b])))
        off += p.rows
    assert parts and sum(p.rows for p in parts) == stop - start, (start, stop, w.shape)
    return BlockWeight(tuple(parts))


def col_slice(w: BlockWeight, start: int, stop: int, name: str) -> BlockWeight:
    """Input columns ``[start, stop)`` of every row: a byte range of each stored row, which exists only
    when both ends fall on a block boundary of the part's format."""
    parts = []
    for p in w.parts:
        blck, nbytes = type_sizes(p.type_name)
        if start % blck or stop % blck:
            raise ValueError(f"tensor parallelism splits {name}'s {p.k} input columns at {start}..{stop}, but its "
                             f"{p.type_name} blocks hold {blck} weights each: the split must fall on a block "
                             f"boundary (use another tensor_parallel_size or a file in a format with smaller blocks)")
        data = p.data[:, start // blck * nbytes: stop // blck * nbytes]
        parts.append(BlockPart(p.type_name, data, stop - start, p.rowmap))
    return BlockWeight(tuple(parts))
