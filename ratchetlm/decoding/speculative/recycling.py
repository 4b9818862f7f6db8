"""Token Recycling's successor table (Luo et al., "Turning Trash into Treasure", 2024).

Every row a target forward computes logits for — a committed token, a draft node the verifier
rejected, the last prompt token — says which ``k`` tokens the target ranks highest right after
that row's token. The table keeps, per vocabulary entry, the latest such top-``k``: row ``t`` =
the successors last seen after token ``t``. Drafting expands from the last committed token
through the table (tree_proposers.py); the rejected branches of one step become the drafts of the
next.

One table per engine (strategy), shared by every request, as in the paper's per-model table: the
successors of common tokens (punctuation, function words, chat-template tokens) carry over, so a
new request drafts from its first token instead of warming up, and a [vocab, 8] int32 table is
1.5 MB for the default model's 49k vocabulary. Requests only ever see each other's drafts, never
each other's tokens (verification keeps the output the target's own).
"""

from __future__ import annotations

import torch

CHUNK = 128  # columns per block of the two-stage top-k


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
    """``table[t]``: ``[k]`` int32, the latest top-``k`` successors of token ``t`` (best first; -1 =
    none seen yet). Sized from the first logits it observes (their vocabulary, their device)."""

    def __init__(self, k: int) -> None:
        assert k >= 1
        self.k = k
        self.table: torch.Tensor | None = None  # [vocab, k] int32
        self.updates = 0  # rows observed

    def observe(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """``tokens``: ``[R]`` the token of each row, ``logits``: ``[R, vocab]`` that row's logits.
        One top-k over the rows, one ``index_copy``; a token appearing in several rows keeps its
        last row's successors (made explicit: ``index_copy`` leaves duplicates unspecified)."""
        assert tokens.dim() == 1 and logits.dim() == 2 and tokens.shape[0] == logits.shape[0], (tokens.shape,
                                                                                              logits.shape)
        if tokens.numel() == 0:
            return
        if self.table is None:
            self.table = torch.full((logits.shape[1], self.k), -1, dtype=torch.int32, device=logits.device)
        last = {t: i for i, t in enumerate(tokens.tolist())}  # token -> its last row (a few dozen ints; four
        # torch ops — unique, scatter_reduce — cost more than the top-k itself on a one-row step)
        rows = torch.tensor(list(last.values()), dtype=torch.long, device=logits.device)  # [U]
        top = top_k_indices(logits[rows], self.k) if len(rows) < len(tokens) else top_k_indices(logits, self.k)
        uniq = torch.tensor(list(last), dtype=torch.long, device=self.table.device)  # [U]
        self.table.index_copy_(0, uniq, top.to(self.table.device, torch.int32))  # [U, k]
        self.updates += len(tokens)

    def successors(self, token: int) -> list[int]:
        """The latest top-k after ``token`` (best first), without the unseen (-1) entries."""
        if self.table is None or not 0 <= token < self.table.shape[0]:
            return []
        return [t for t in self.table[token].tolist() if t >= 0]
