"""Beam search (greedy chain when M == 1) shared by the model-based proposers.

A model proposer only supplies one *draft step*: given the live sequences and their current
beams, the logits of every beam's next token. The search keeps the M best candidates by
cumulative log-probability and returns them as a :class:`DraftBeam` per sequence. Draft
forwards never write the candidates' K/V anywhere, so every step re-feeds the root and the
current beams packed as a prefix tree (:func:`tree_feed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ratchetlm.decoding.speculative.proposers import DraftBeam
from ratchetlm.decoding.speculative.tree_attention import pack, with_root


@dataclass(frozen=True)
class TreeFeed:
    """What one draft forward feeds for one sequence on top of its committed cache."""

    tokens: list[int]  # [n] the root, then the packed beam nodes
    offsets: list[int]  # [n] position offsets from the committed length (root 0, node depth + 1)
    mask: torch.Tensor  # [n, n] bool ancestor-or-self (root visible to all)
    rows: list[int]  # [M] the row of each beam's last node (its logits predict the next token)


def tree_feed(root: int, beams: torch.Tensor) -> TreeFeed:  # beams [M, k] int64, k >= 0
    if beams.shape[1] == 0:
        return TreeFeed([root], [0], torch.ones(1, 1, dtype=torch.bool), [0])
    p = pack(beams[None])
    return TreeFeed([root] + p.tokens[0].tolist(), [0] + (p.position_offsets[0] + 1).tolist(), with_root(p.mask[0]),
                    (p.unpack_map[0, :, -1] + 1).tolist())


# step(k, live, beams) -> per live sequence [M_i, V] logits of each beam's next token, where
# ``live`` indexes the sequences still drafting at depth k and ``beams[i]`` is [M_i, k].
DraftStep = Callable[[int, list[int], list[torch.Tensor]], list[torch.Tensor]]


def beam_search(step: DraftStep, depths: list[int], width: int) -> list[DraftBeam]:
    """``depths[i]``: tokens to draft for sequence i. Scores are cumulative draft log-probs."""
    beams = [torch.empty(1, 0, dtype=torch.long) for _ in depths]  # [M_i, k]
    scores = [torch.zeros(1, 0) for _ in depths]  # [M_i, k]
    for k in range(max(depths, default=0)):
        live = [i for i, d in enumerate(depths) if d > k]
        logits = step(k, live, [beams[i] for i in live])
        for i, lg in zip(live, logits, strict=True):
            lp = torch.log_softmax(lg.float(), dim=-1)  # [M_i, V]
            base = scores[i][:, -1:] if k else torch.zeros(1, 1)
            total = (base + lp).flatten()  # [M_i * V]
            top = torch.topk(total, min(width, total.numel()))
            parent = top.indices // lp.shape[1]
            tok = top.indices % lp.shape[1]
            beams[i] = torch.cat([beams[i][parent], tok[:, None]], dim=1)
            scores[i] = torch.cat([scores[i][parent], top.values[:, None]], dim=1)
    return [DraftBeam(b, s) for b, s in zip(beams, scores, strict=True)]
