"""Known tentative tokens on top of the root: verify them against the request's target
distribution and commit the accepted path plus one token of the target's own.

Shared by speculative drafts (decoding/speculative) and grammar-forced tokens (jump-forward, used
by every strategy that samples token by token): both propose a tree (a chain is a tree) after
the root — the last committed, uncached token — and both commit exactly what plain decoding
would have produced, because every row is judged on ``target_logits`` with that row's path.
"""

from __future__ import annotations

from typing import Any

import torch

from ratchetlm.decoding.base import Commit, Proposal
from ratchetlm.decoding.speculative.draft_tree import greedy_verify, sample_verify
from ratchetlm.decoding.speculative.verify import DraftTree, greedy_accept
from ratchetlm.layers.sampler import filtered_probs, target_logits, top_logprobs
from ratchetlm.layers.seeded_draw import position_uniforms
from ratchetlm.sequence import Sequence

FORCED_PROPOSED = "forced_tokens_proposed"  # seq.stats keys (jump-forward)
FORCED_ACCEPTED = "forced_tokens_accepted"


def chain(tokens: list[int]) -> DraftTree:
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), list(range(len(tokens))))


def row_paths(tree: DraftTree) -> list[list[int]]:
    """``[1 + L]``: the tentative tokens before each verify row (row 0: the root, none)."""
    paths: list[list[int]] = [[]]
    for n, par in enumerate(tree.parent):
        paths.append(paths[par + 1] + [tree.tokens[n]])
    return paths


def chain_proposal(seq: Sequence, tokens: list[int], state: Any) -> Proposal:
    """The root followed by ``tokens``, staged (only the accepted rows reach the cache), causal."""
    base = seq.num_cached
    n = 1 + len(tokens)
    return Proposal(token_ids=[seq.token_ids[-1]] + list(tokens), positions=list(range(base, base + n)),
                    logit_rows=list(range(n)), mask=None, direct_write=False, state=state)


def forced_chain(seq: Sequence, budget: int, room: int, limit: int = 1 << 30) -> list[int]:
    """Grammar-forced tokens to propose after the root of a decoding sequence (may be empty);
    root + chain hold at most ``limit`` tokens (:func:`chain_limit`)."""
    if seq.controls is None or len(seq.token_ids) - seq.num_cached != 1:
        return []
    return seq.controls.forced_tokens()[: max(0, min(budget, room, limit) - 1)]


def chain_limit(runner: Any) -> int:
    """Most tokens one staged chain may hold in ``runner``'s cache layout: a DeepSeek-V4 verify step
    holds at most its state span (``max_chain_tokens``); the paged K/V cache has no such limit."""
    return getattr(runner, "max_chain_tokens", None) or 1 << 30


def verify_tree(seq: Sequence, tree: DraftTree, logits: torch.Tensor, room: int,
                greedy: list[int] | None = None) -> tuple[Commit, list[int]]:
    """``logits``: ``[1 + L, V]`` raw rows (root, then one per node). Returns the commit (accepted
    path + correction/bonus token, cut at a stop token and at ``room``) and the accepted node path.
    Both rules are draft_tree.py's: greedy walks the tree by the target's greedy tokens (what the
    seed's verified beam gives), sampling judges each candidate entry on its parent row's distribution.
    ``greedy``: the raw rows' argmax where already known (read only without logits controls, which
    change the rows)."""
    x = target_logits(logits, seq.controls, row_paths(tree) if seq.controls is not None else None)
    if seq.params.greedy:
        path, nxt = greedy_verify(tree, x) if greedy is None or seq.controls is not None else \
            greedy_accept(tree, greedy)
    else:
        # a seeded request: one uniform per level, keyed by the position it fills (layers/seeded_draw.py)
        seed, levels = seq.params.seed, max(tree.depth, default=-1) + 2  # node levels + the bonus token
        gen = seq.generator if seed is None else position_uniforms(seed, len(seq.token_ids), levels)
        path, nxt = sample_verify(tree, filtered_probs(x, seq.params), gen)
    tokens = [tree.tokens[n] for n in path] + [nxt]
    cut = room
    for j, t in enumerate(tokens):
        if t in seq.eos_token_ids or t in seq.params.stop_token_ids:
            cut = min(cut, j + 1)  # the engine ends the sequence there; commit no KV past it
            break
    tokens = tokens[:cut]
    rows = [0] + [1 + n for n in path]  # row predicting each emitted token
    lps = None
    if seq.params.logprobs is not None:
        lps = top_logprobs(logits[rows[: len(tokens)]], torch.tensor(tokens), seq.params.logprobs)
    return Commit(kv_rows=rows[: len(tokens)], token_ids=tokens, logprobs=lps), path


def observe_forced(seq: Sequence, proposed: int, accepted: int) -> None:
    seq.stats[FORCED_PROPOSED] = seq.stats.get(FORCED_PROPOSED, 0) + proposed
    seq.stats[FORCED_ACCEPTED] = seq.stats.get(FORCED_ACCEPTED, 0) + accepted
