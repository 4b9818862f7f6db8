"""Beam → prefix tree: dedup shared prefixes, pack, mask, unpack. Loop-free tensor code.

A beam ``(B, M, C)`` holds M candidate continuations of C tokens per batch row. Two candidates
share a token only when their *whole prefix* up to and including it is equal (sharing a token
with a different prefix would break causality). The distinct prefixes are the nodes of a
prefix tree; packing lists the nodes of each row in the order they first appear scanning the
beam candidate-major, depth-minor. That order is topological (every node's ancestors come
before it), so any prefix of the packed order is itself a valid, smaller tree.

API (the seed design, tree_attention.md)::

    packed = pack(beam)             # PackedBeams: tokens (B,L), mask (B,L,L), position_offsets (B,L),
                                    #   unpack_map (B,M,C), packed_token_indices (B,L)
    logits = LLM(root + packed ...) # (B, 1+L, V): row 0 the root (last committed token), row 1+n node n
    verified_beam, verified_scores = unpack_verified(logits, packed.unpack_map, beam)   # (B,M,C) each
    per_candidate = unpack(per_node_out, unpack_map)   # any (B,L,...) -> (B,M,C,...)

* ``tokens[b][unpack_map[b]] == beam[b]``;
* ``mask[b, i, j]`` is True iff node j is an ancestor-or-self of node i;
* ``position_offsets[b, i]`` is node i's depth (0 for a first token) — its RoPE offset from the
  end of the committed context (the root sits at offset 0 before it, so the engine feeds depth + 1);
* ``packed_token_indices[b, i]``: where node i was taken from in the flattened beam, ``m * C + c``
  of the first candidate holding it (the seed's ``[0, 1, 2, 3, 6, 7, 10, 11]``);
* rows with fewer than L nodes are padded: padding tokens repeat the row's first token, have
  offset 0, index -1 and a mask that only sees themselves; no real node ever sees a padding node.
  :func:`num_nodes` gives each row's real node count.
* ``verified_beam[b, m, c]``: the target's greedy token at that beam position, read from the row
  of its parent (the root for c = 0); ``verified_scores``: the target's log-probability of the
  beam's own token there. A candidate is accepted as far as it agrees with ``verified_beam``.

What the engine uses (the API above is the seed's, implemented and tested against it in
tests/speculative/test_tree_attention.py, but only partly on the engine's path): ``pack`` builds
every step's draft trees (draft_tree.trees_from_beams reads tokens, depths and parents off
``tokens`` / ``position_offsets`` / ``unpack_map``), ``parent_rows`` gives sampled verification
the row each entry is judged on, and ``with_root`` adds the root row to a tree's mask. The verify
forward's mask is ``strategy.rooted_mask(tree.parent)`` (``with_root(strategy.tree_mask(tree))``,
made once per tree shape from lists); ``pack().mask`` is used only by the draft model's
own beam-search forwards (beam_search.py). Greedy verification walks the tree with
``verify.greedy_accept`` on the target's argmax per row (draft_tree.greedy_verify): the same result
as ``unpack_verified`` without building the verified beam. ``unpack`` and ``unpack_verified`` are
not called by the engine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ratchetlm.layers.sampler import argmax


class PackedBeams(NamedTuple):
    tokens: torch.Tensor  # [B, L] int64 packed beam
    mask: torch.Tensor  # [B, L, L] bool ancestor-or-self
    position_offsets: torch.Tensor  # [B, L] int64 depth
    unpack_map: torch.Tensor  # [B, M, C] int64 node of each beam entry
    packed_token_indices: torch.Tensor  # [B, L] int64 flat beam index m * C + c of each node, -1 padding


def _owner(beam: torch.Tensor) -> torch.Tensor:  # [B, M, C] int64
    """``owner[b, i, k]``: the smallest candidate j whose prefix ``[:k+1]`` equals candidate i's."""
    c = beam.shape[2]
    eq = beam[:, :, None, :] == beam[:, None, :, :]  # [B, M, M, C]
    # whole-prefix equality: all positions 0..k equal  <=>  running count of equal positions == k+1
    prefix_eq = eq.long().cumsum(dim=3) == torch.arange(1, c + 1, device=beam.device)
    return prefix_eq.long().argmax(dim=2)  # first True along j (i itself is always True)


def pack(beam: torch.Tensor) -> PackedBeams:  # beam [B, M, C] int64 candidate token ids
    """Dedup shared prefixes and pack; ``L = max_b nodes(b) <= M*C``."""
    if beam.dim() != 3 or beam.numel() == 0:
        raise ValueError(f"beam must be a non-empty [B, M, C] tensor, got shape {tuple(beam.shape)}")
    b, m, c = beam.shape
    dev = beam.device
    if m == 1:  # a chain per row: nothing to share, so the same structures without the pairwise work
        idx = torch.arange(c, device=dev)  # [C]
        mask = torch.ones(c, c, dtype=torch.bool, device=dev).tril()
        return PackedBeams(beam[:, 0].clone(), mask.expand(b, c, c), idx.expand(b, c), idx.expand(b, 1, c),
                           idx.expand(b, c))
    owner = _owner(beam)  # [B, M, C]
    owned = owner == torch.arange(m, device=dev)[None, :, None]  # node first seen in this candidate
    owned_flat = owned.reshape(b, m * c)
    counts = owned_flat.sum(dim=1)  # [B] real nodes per row
    n_max = int(counts.max())
    node_of_flat = owned_flat.long().cumsum(dim=1) - 1  # [B, M*C] packed index (valid where owned)
    # every (i, k) maps to the node created by its owner at the same depth
    owner_flat = owner * c + torch.arange(c, device=dev)[None, None, :]  # [B, M, C]
    unpack_map = node_of_flat.gather(1, owner_flat.reshape(b, m * c)).reshape(b, m, c)

    # scatter owned tokens / depths / flat indices to their packed slot; non-owned go to a dump column
    dest = torch.where(owned_flat, node_of_flat, torch.full_like(node_of_flat, n_max))
    depth_flat = torch.arange(c, device=dev).repeat(m)[None, :].expand(b, -1)
    packed = beam[:, 0, :1].expand(b, n_max + 1).clone()  # padding filler: the row's first token
    packed.scatter_(1, dest, beam.reshape(b, m * c))
    offsets = torch.zeros(b, n_max + 1, dtype=torch.long, device=dev)
    offsets.scatter_(1, dest, depth_flat)
    indices = torch.full((b, n_max + 1), -1, dtype=torch.long, device=dev)
    indices.scatter_(1, dest, torch.arange(m * c, device=dev)[None, :].expand(b, -1))
    packed, offsets, indices = packed[:, :n_max], offsets[:, :n_max], indices[:, :n_max]
    is_real = torch.arange(n_max, device=dev)[None, :] < counts[:, None]  # [B, L]
    offsets = offsets * is_real

    # ancestors of (i, k) are unpack_map[i, :k+1]: a running OR of one-hots along the candidate
    onehot = torch.nn.functional.one_hot(unpack_map, n_max).bool()  # [B, M, C, L]
    anc = onehot.long().cumsum(dim=2) > 0  # [B, M, C, L]
    mask = torch.zeros(b, n_max, n_max, dtype=torch.bool, device=dev)
    # several (i, k) may name the same node; they carry identical ancestor rows
    mask.scatter_(1, unpack_map.reshape(b, m * c, 1).expand(b, m * c, n_max), anc.reshape(b, m * c, n_max))
    eye = torch.eye(n_max, dtype=torch.bool, device=dev)[None]
    mask = mask | (eye & ~is_real[:, :, None])  # padding rows see only themselves
    return PackedBeams(packed, mask, offsets, unpack_map, indices)


def unpack(
    out: torch.Tensor,  # [B, L, ...] per packed node
    unpack_map: torch.Tensor,  # [B, M, C] int64
) -> torch.Tensor:  # [B, M, C, ...]
    """Gather per-node values back into the beam layout."""
    b = out.shape[0]
    rows = torch.arange(b, device=out.device)[:, None, None]
    return out[rows, unpack_map]


def unpack_verified(
    logits: torch.Tensor,  # [B, 1 + L, V] target logits: row 0 the root, row 1 + n packed node n
    unpack_map: torch.Tensor,  # [B, M, C] int64 node of each beam entry, -1 = not verified (absent)
    beam: torch.Tensor,  # [B, M, C] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # verified_beam [B, M, C] int64, verified_scores [B, M, C] fp32
    """The seed's ``unpack`` of a verify forward. Position (m, c) is predicted by the row of its
    parent — the root for c = 0, node ``unpack_map[m, c - 1]`` otherwise. Where that parent was
    not verified, the verified token is -1 and the score -inf."""
    b = unpack_map.shape[0]
    dev = unpack_map.device
    rows = parent_rows(unpack_map)  # [B, M, C]
    ok = rows >= 0
    rows = rows.clamp(min=0)
    greedy = argmax(logits)  # [B, 1 + L]
    verified_beam = torch.where(ok, unpack(greedy, rows), torch.full_like(rows, -1))
    x = logits.float()
    top = x.amax(dim=-1, keepdim=True)  # [B, 1 + L, 1]; log p = (x - top) - log sum exp(x - top), as log_softmax
    lse = torch.log(torch.exp(x - top).sum(dim=-1))  # [B, 1 + L]
    bi = torch.arange(b, device=dev)[:, None, None]
    own = (x - top)[bi, rows, beam.clamp(min=0)] - unpack(lse, rows)  # [B, M, C] log p of the beam's token
    verified_scores = torch.where(ok & (beam >= 0), own, torch.full_like(own, float("-inf")))
    return verified_beam, verified_scores


def parent_rows(unpack_map: torch.Tensor) -> torch.Tensor:  # [B, M, C] int64 -> [B, M, C] int64
    """The row of a verify forward's output (row 0 the root, ``1 + n`` node n) whose distribution
    each beam entry is drawn from: its parent's — the root for c = 0, node ``unpack_map[m, c - 1]``
    otherwise; -1 where that parent was not verified (``unpack_map`` -1)."""
    b, m, _ = unpack_map.shape
    root = torch.zeros((b, m, 1), dtype=torch.long, device=unpack_map.device)
    parent = unpack_map[:, :, :-1]
    return torch.cat([root, torch.where(parent >= 0, parent + 1, parent)], dim=2)


def num_nodes(unpack_map: torch.Tensor) -> torch.Tensor:  # [B, M, C] -> [B] int64
    """Real (non-padding) node count per row: nodes are numbered 0..n-1 in packed order."""
    return unpack_map.flatten(1).amax(dim=1) + 1


def parents(mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # [B,L,L], [B,L] -> [B,L]
    """Parent node of every node (-1 for depth-0 nodes and padding): its deepest proper ancestor."""
    n = mask.shape[-1]
    proper = mask & ~torch.eye(n, dtype=torch.bool, device=mask.device)[None]
    score = torch.where(proper, offsets[:, None, :] + 1, torch.zeros_like(proper, dtype=torch.long))
    best = score.max(dim=2)
    return torch.where(best.values > 0, best.indices, torch.full_like(best.indices, -1))


def with_root(mask: torch.Tensor) -> torch.Tensor:  # [L, L] bool -> [1 + L, 1 + L] bool
    """Prepend the root (the last committed token, fed with the tree): every node sees it,
    it sees only itself."""
    n = mask.shape[0]
    out = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=mask.device)
    out[:, 0] = True
    out[1:, 1:] = mask
    return out
