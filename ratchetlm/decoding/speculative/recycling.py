"""Token Recycling's successor table (Luo et al., "Turning Trash into Treasure", 2024).

Every row a target forward computes logits for — a committed token, a draft node the verifier
rejected, the last prompt token — says which ``k`` tokens the target ranks highest right after
that row's token. The table keeps, per vocabulary entry, the latest such top-``k``: row ``t`` =
the successors last seen after token ``t``. Drafting expands from the last committed token
through the table (tree_proposers.py); the rejected branches of one step become the drafts of the
next.

One table per engine (strategy), shared by every request, as in the paper's per-model table: the
successors of common tokens (punctuation, function words, chat-template tokens) carry over, so a
new request drafts from its first token instead of warming up. Requests only ever see each other's
drafts, never each other's tokens (verification keeps the output the target's own).
"""

from __future__ import annotations

import torch

from ratchetlm import kernels

CHUNK = 128  # columns per block of the two-stage top-k
MAX_KERNEL_K = 64  # the C kernel's largest k (kernels/argmax.c)


def top_k_rows(x: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:  # -> [R, k] int64
    """The top-``k`` column indices of ``x[rows]`` (every row when None), best first, ties in column
    order (the lower index first). CPU fp32 rows go through kernels/argmax.c's one-pass selection
    (~0.02 ms a row of the default model's 49k vocabulary against ~0.05 ms for :func:`top_k_indices`,
    which the other cases and rows holding a NaN use: torch's order there); ``rows`` spares
    gathering the rows first."""
    return top_k_rows_exact(x, k, rows)[0]


def top_k_rows_exact(x: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
    """:func:`top_k_rows` and whether its order is the kernel's (ties to the lower index, no NaN):
    then every row's first entry is its ``argmax`` (layers/sampler.py: the first of the maximum)."""
    lib = kernels.load() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    r, v = (x.shape[0] if rows is None else rows.shape[0]), x.shape[1]
    if lib is None or not 1 <= k <= min(v, MAX_KERNEL_K) or r == 0 or x.stride(1) != 1:
        return top_k_indices(x if rows is None else x[rows], k), False
    out = torch.empty(r, k, dtype=torch.long)
    idx = None if rows is None else rows.to(torch.long).contiguous()
    nan = lib.ratchet_topk_rows(x.data_ptr(), None if idx is None else idx.data_ptr(), r, v, x.stride(0), k,
                                out.data_ptr())
    return (top_k_indices(x if rows is None else x[rows], k), False) if nan else (out, True)


def top_k_indices(x: torch.Tensor, k: int) -> torch.Tensor:  # x [R, V] -> [R, k] int64, best first
    """``torch.topk(x, k).indices`` in two stages: the max of every block of ``CHUNK`` columns,
    the ``k`` best blocks, then the top-``k`` of their ``k * CHUNK`` entries. Exact (an entry of
    the top k has at most k - 1 larger entries, so at most k - 1 blocks have a larger max; ties
    may order differently) and 2-3x faster on a CPU (one pass of a vectorised max over the
    vocabulary instead of a selection per row: ~0.05 against ~0.13 ms a row on the default
    model's 49k vocabulary, one thread), which matters with a dozen rows every step."""
    r, v = x.shape
    n = v // CHUNK
    if n <= k:
        return torch.topk(x, min(k, v), dim=-1).indices
    body = x[:, : n * CHUNK].view(r, n, CHUNK)
    blocks = body.amax(-1).topk(k, dim=-1).indices  # [R, k]
    cols = (blocks[:, :, None] * CHUNK + torch.arange(CHUNK, device=x.device)).reshape(r, k * CHUNK)
    cand = body.gather(1, blocks[:, :, None].expand(r, k, CHUNK)).reshape(r, k * CHUNK)
    if n * CHUNK < v:  # the tail that fills no whole block: always a candidate
        tail = torch.arange(n * CHUNK, v, device=x.device).expand(r, -1)
        cols, cand = torch.cat([cols, tail], 1), torch.cat([cand, x[:, n * CHUNK:]], 1)
    return cols.gather(1, cand.topk(k, dim=-1).indices)


class SuccessorTable:
    """``rows[t]``: the latest top-``k`` successors of token ``t`` (best first; absent = none seen yet).
    Kept as Python lists: the proposer reads a row per tree node it expands (a dozen or more a step),
    and a list lookup costs ~0.1 us where indexing a ``[vocab, k]`` tensor and ``tolist`` cost ~2 us;
    only the tokens seen get a row (a few thousand over a long run: well under the 1.5 MB of a full
    int32 table of the default model's 49k vocabulary)."""

    def __init__(self, k: int) -> None:
        assert k >= 1
        self.k = k
        self.rows: dict[int, list[int]] = {}
        self.vocab: int | None = None  # from the first logits observed
        self.updates = 0  # rows observed

    def observe(self, tokens: list[int] | torch.Tensor, logits: torch.Tensor) -> list[int] | None:
        """``tokens``: the token of each row (``[R]``), ``logits``: ``[R, vocab]`` that row's logits.
        One top-k over the rows (a token appearing in several rows keeps its last row's successors).
        Returns every row's argmax (its top-1; ``layers.sampler.argmax``'s index, ties to the lower
        column) where the kernel's order gave it, else None: the greedy verify of the same rows
        then reduces none of them again (~0.03-0.1 ms a row just after a forward)."""
        toks = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        assert logits.dim() == 2 and len(toks) == logits.shape[0], (len(toks), logits.shape)
        if not toks:
            return None
        self.vocab = logits.shape[1]
        top_t, exact = top_k_rows_exact(logits, self.k)
        top = top_t.tolist()  # [R][k]
        for t, succ in zip(toks, top, strict=True):  # in row order: a token's last row is the one kept
            self.rows[t] = succ
        self.updates += len(toks)
        return [row[0] for row in top] if exact else None

    def successors(self, token: int) -> list[int]:
        """The latest top-k after ``token`` (best first; [] where none was seen). The caller must not
        modify the list."""
        return self.rows.get(token, [])
