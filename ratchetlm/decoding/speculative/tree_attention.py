"""Beam → prefix tree: dedup shared prefixes, pack, mask, unpack. Loop-free tensor code.

A beam ``(B, M, C)`` holds M candidate continuations of C tokens per batch row. Two candidates
share a token only when their *whole prefix* up to and including it is equal (sharing a token
with a different prefix would break causality). The distinct prefixes are the nodes of a
prefix tree; packing lists the nodes of each row in the order they first appear scanning the
beam candidate-major, depth-minor. That order is topological (every node's ancestors come
before it), so any prefix of the packed order is itself a valid, smaller tree.

API (shapes per the seed design)::

    packed, mask, offsets, unpack_map = pack(beam)    # (B,L) (B,L,L) (B,L) (B,M,C)
    per_candidate = unpack(per_node_out, unpack_map)  # (B,L,...) -> (B,M,C,...)

* ``packed[b][unpack_map[b]] == beam[b]``;
* ``mask[b, i, j]`` is True iff node j is an ancestor-or-self of node i;
* ``offsets[b, i]`` is node i's depth (0 for a first token) — its RoPE offset from the end of
  the committed context;
* rows with fewer than L nodes are padded: padding tokens repeat the row's first token, have
  offset 0 and a mask that only sees themselves; no real node ever sees a padding node.
  :func:`num_nodes` gives each row's real node count.
"""

from __future__ import annotations

import torch


def _owner(beam: torch.Tensor) -> torch.Tensor:  # [B, M, C] int64
    """``owner[b, i, k]``: the smallest candidate j whose prefix ``[:k+1]`` equals candidate i's."""
    c = beam.shape[2]
    eq = beam[:, :, None, :] == beam[:, None, :, :]  # [B, M, M, C]
    # whole-prefix equality: all positions 0..k equal  <=>  running count of equal positions == k+1
    prefix_eq = eq.long().cumsum(dim=3) == torch.arange(1, c + 1, device=beam.device)
    return prefix_eq.long().argmax(dim=2)  # first True along j (i itself is always True)


def pack(
    beam: torch.Tensor,  # [B, M, C] int64 candidate token ids
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dedup shared prefixes and pack. Returns ``(packed [B,L], mask [B,L,L] bool,
    position_offsets [B,L] int64, unpack_map [B,M,C] int64)`` with ``L = max_b nodes(b) <= M*C``."""
    if beam.dim() != 3 or beam.numel() == 0:
        raise ValueError(f"beam must be a non-empty [B, M, C] tensor, got shape {tuple(beam.shape)}")
    b, m, c = beam.shape
    dev = beam.device
    owner = _owner(beam)  # [B, M, C]
    owned = owner == torch.arange(m, device=dev)[None, :, None]  # node first seen in this candidate
    owned_flat = owned.reshape(b, m * c)
    counts = owned_flat.sum(dim=1)  # [B] real nodes per row
    n_max = int(counts.max())
    node_of_flat = owned_flat.long().cumsum(dim=1) - 1  # [B, M*C] packed index (valid where owned)
    # every (i, k) maps to the node created by its owner at the same depth
    owner_flat = owner * c + torch.arange(c, device=dev)[None, None, :]  # [B, M, C]
    unpack_map = node_of_flat.gather(1, owner_flat.reshape(b, m * c)).reshape(b, m, c)

    # scatter owned tokens / depths to their packed slot; non-owned entries go to a dump column
    dest = torch.where(owned_flat, node_of_flat, torch.full_like(node_of_flat, n_max))
    depth_flat = torch.arange(c, device=dev).repeat(m)[None, :].expand(b, -1)
    packed = beam[:, 0, :1].expand(b, n_max + 1).clone()  # padding filler: the row's first token
    packed.scatter_(1, dest, beam.reshape(b, m * c))
    offsets = torch.zeros(b, n_max + 1, dtype=torch.long, device=dev)
    offsets.scatter_(1, dest, depth_flat)
    packed, offsets = packed[:, :n_max], offsets[:, :n_max]
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
    return packed, mask, offsets, unpack_map


def unpack(
    out: torch.Tensor,  # [B, L, ...] per packed node
    unpack_map: torch.Tensor,  # [B, M, C] int64
) -> torch.Tensor:  # [B, M, C, ...]
    """Gather per-node values back into the beam layout."""
    b = out.shape[0]
    rows = torch.arange(b, device=out.device)[:, None, None]
    return out[rows, unpack_map]


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
