"""The ``speculative`` strategy: draft a tree, verify it in one staged forward, commit the accepted path.

Per decoding sequence (exactly one uncached token, the *root*) a step proposes
``[root] + packed tree nodes`` with ``direct_write=False``: the tree mask extended with the
root, positions ``num_cached + depth`` (root depth 0). Its K/V are staged, never written to the
paged cache; the commit names the root plus the accepted root-to-node path (any branch, not a
contiguous range) and appends the accepted tokens + the correction/bonus token. Sequences in
prefill (more than one uncached token) and sequences without a draft use the plain
catch-up path (direct writes), so speculative and plain rows mix freely in one batch.

Depth is capped so that no proposal emits more tokens than ``max_tokens``/``max_model_len``
allow, and ``tokens_wanted`` reports the largest proposal so the scheduler reserves its KV.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ratchetlm.decoding.autoregressive import catch_up_commit, catch_up_proposal
from ratchetlm.decoding.base import Commit, DecodeStrategy, Proposal, StrategyContext, register
from ratchetlm.decoding.speculative import draft_model, eagle, mtp, self_draft  # noqa: F401  (register the proposers)
from ratchetlm.decoding.speculative.config import SpecConfig
from ratchetlm.decoding.speculative.proposers import PAD, DraftBeam, create_proposer
from ratchetlm.decoding.speculative.stats import SpecCounters
from ratchetlm.decoding.speculative.tree_attention import num_nodes, pack, parents, with_root
from ratchetlm.decoding.speculative.verify import DraftTree
from ratchetlm.decoding.tentative import chain_limit, forced_chain, observe_forced, verify_tree
from ratchetlm.engine.sequence import Sequence

_PREFIX = "spec_"
_LEFTOVER = "spec_leftover"  # strategy_state key: (anchor length, remaining chain) for chunked verify
_DEPTH = "spec_depth"  # strategy_state key: the adaptive schedule's current draft depth


@dataclass(frozen=True)
class TreeState:
    tree: DraftTree
    leftover: list[int] | None  # chunked verify: draft tokens after this chunk (chains only)
    forced: bool = False  # the chain is grammar-forced tokens (jump-forward), not a draft


def tree_from_beam(beam: torch.Tensor, max_nodes: int) -> DraftTree:  # beam [M, C] with PAD
    """Pack one beam, drop padding nodes, keep at most ``max_nodes`` (a topological prefix)."""
    if beam.shape[0] == 1:  # one candidate is its own prefix tree: a chain, no dedup to do
        chain = [t for t in beam[0, :max_nodes].tolist() if t != PAD]
        return DraftTree(chain, list(range(-1, len(chain) - 1)), list(range(len(chain))))
    packed, mask, off, umap = pack(beam[None])
    n = int(num_nodes(umap)[0])
    keep = packed[0, :n] != PAD
    keep &= keep.long().cumsum(0) <= max_nodes
    idx = keep.nonzero().squeeze(1)
    sub_mask = mask[0][idx][:, idx]
    sub_off = off[0][idx]
    par = parents(sub_mask[None], sub_off[None])[0]
    return DraftTree(packed[0][idx].tolist(), par.tolist(), sub_off.tolist())


def tree_mask(tree: DraftTree) -> torch.Tensor:  # [L, L] bool ancestor-or-self
    n = len(tree)
    m = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(tree.parent):
        if p >= 0:
            m[i] |= m[p]
    return m


@register("speculative")
class Speculative(DecodeStrategy):
    stages = True
    def __init__(self, ctx: StrategyContext, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, options)
        self.cfg = SpecConfig.from_options(self.options)
        self.proposer = create_proposer(self.cfg.method, self.cfg, ctx)
        self.totals = SpecCounters()
        self.disabled_steps = 0  # steps decoded plainly because of disable_by_batch_size

    # ------------------------------------------------------------------ lifecycle

    def on_preempt(self, seq: Sequence) -> None:
        self.proposer.release(seq)  # before the state dict (which holds the draft's block table) goes
        super().on_preempt(seq)

    def on_finish(self, seq: Sequence) -> None:
        self.proposer.release(seq)

    def on_step_discarded(self, seq: Sequence) -> None:
        """Keep the draft state: it only shapes proposals (verification is lossless), draft K/V hold
        committed tokens only, and the proposers re-derive their positions from the committed length."""
        return None

    # ------------------------------------------------------------------ sizing

    def _room(self, seq: Sequence) -> int:
        """Tokens the sequence may still append (one of them is always the target's own)."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.ctx.max_model_len - len(seq.token_ids))

    def _depth(self, seq: Sequence) -> int:
        depth = seq.strategy_state.get(_DEPTH, self.cfg.depth)
        return max(0, min(depth, self._room(seq) - 1))

    def _adapt_depth(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Adaptive schedule: +2 when every drafted token was accepted, else -1, within [1, depth]."""
        if self.cfg.depth_schedule != "adaptive" or drafted == 0:
            return
        depth = seq.strategy_state.get(_DEPTH, self.cfg.depth)
        depth = depth + 2 if accepted >= drafted else depth - 1
        seq.strategy_state[_DEPTH] = max(1, min(self.cfg.depth, depth))

    def _verify_len(self, seq: Sequence) -> int:
        d = self._depth(seq)
        return min(d, self.cfg.chunk_size) if self.cfg.chunk_size else d

    def tokens_wanted(self, seq: Sequence) -> int:
        pending = len(seq.token_ids) - seq.num_cached
        if pending > 1:
            return pending
        forced = forced_chain(seq, 1 << 30, self._room(seq), chain_limit(self.ctx.runner))
        return 1 + (len(forced) if forced else self.cfg.num_candidates * self._verify_len(seq))

    # ------------------------------------------------------------------ propose

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        limit = self.cfg.disable_by_batch_size
        disabled = bool(limit and len(seqs) >= limit)  # a big batch: no drafts (they cost more than they save)
        self.disabled_steps += disabled
        props: list[Proposal | None] = [None] * len(seqs)
        todo: list[int] = []
        depths: list[int] = []
        for i, (s, b) in enumerate(zip(seqs, budgets, strict=True)):
            forced = forced_chain(s, b, self._room(s), chain_limit(self.ctx.runner))
            if forced:  # the grammar admits one continuation: verify it instead of a draft
                chain = torch.tensor(forced, dtype=torch.long)[None]
                props[i] = self._tree_proposal(s, DraftBeam(chain, torch.zeros(chain.shape)), b, forced=True)
                continue
            d = min(self._depth(s), b - 1)
            if disabled or len(s.token_ids) - s.num_cached > 1 or d <= 0:
                props[i] = catch_up_proposal(s, b)
                continue
            left = s.strategy_state.pop(_LEFTOVER, None)
            if left is not None and left[0] == len(s.token_ids) and left[1]:
                chain = torch.tensor(left[1][:d], dtype=torch.long)[None]
                props[i] = self._tree_proposal(s, DraftBeam(chain, torch.zeros(chain.shape)), b)
                continue
            todo.append(i)
            depths.append(d)
        beams = self.proposer.propose([seqs[i] for i in todo], depths) if todo else []
        for i, beam in zip(todo, beams, strict=True):
            props[i] = catch_up_proposal(seqs[i], budgets[i]) if beam is None else \
                self._tree_proposal(seqs[i], beam, budgets[i])
        return props  # type: ignore[return-value]

    def _tree_proposal(self, seq: Sequence, beam: DraftBeam, budget: int, forced: bool = False) -> Proposal:
        tokens, leftover = beam.tokens, None
        if seq.controls is not None and seq.controls.grammar is not None and not forced:
            tokens = tokens.clone()  # drop each candidate's draft tokens from the first one the grammar rejects
            for row in tokens:
                ok = seq.controls.valid_prefix([t for t in row.tolist() if t != PAD])
                row[ok:] = PAD
        if self.cfg.chunk_size and not forced and tokens.shape[1] > self.cfg.chunk_size:
            leftover = [t for t in tokens[0, self.cfg.chunk_size :].tolist() if t != PAD]
            tokens = tokens[:, : self.cfg.chunk_size]
        tree = tree_from_beam(tokens, budget - 1)
        if len(tree) == 0:
            return catch_up_proposal(seq, budget)
        base = seq.num_cached
        return Proposal(
            token_ids=[seq.token_ids[-1]] + tree.tokens,
            positions=[base] + [base + 1 + d for d in tree.depth],
            logit_rows=list(range(1 + len(tree))),
            mask=with_root(tree_mask(tree)),
            direct_write=False,
            state=TreeState(tree, leftover, forced),
        )

    # ------------------------------------------------------------------ commit

    def commit(self, seqs: list[Sequence], proposals: list[Proposal], logits: list[torch.Tensor]) -> list[Commit]:
        out = []
        for i, (s, p, lg) in enumerate(zip(seqs, proposals, logits, strict=True)):
            c = self._commit_tree(s, p, lg) if isinstance(p.state, TreeState) else catch_up_commit(s, p, lg)
            if self.proposer.wants_features and c.kv_rows:
                hidden = self.ctx.runner.last_hidden[i]  # [len(p.token_ids), hidden]
                self.proposer.observe(s, s.num_cached, hidden[torch.tensor(c.kv_rows, device=hidden.device)])
            out.append(c)
        return out

    def _commit_tree(self, seq: Sequence, prop: Proposal, logits: torch.Tensor) -> Commit:
        st: TreeState = prop.state
        tree = st.tree
        commit, path = verify_tree(seq, tree, logits, self._room(seq))
        tokens = commit.token_ids
        if st.forced:
            observe_forced(seq, len(tree), len(path))
            return commit
        self._observe(seq, len(tree), len(path))
        self._adapt_depth(seq, max(tree.depth) + 1, len(path))
        if st.leftover and len(path) == len(tree) and st.leftover[0] == tokens[-1] and len(tokens) == len(path) + 1:
            # the whole chunk and the next draft token were accepted: keep the rest of the chain
            seq.strategy_state[_LEFTOVER] = (len(seq.token_ids) + len(tokens), st.leftover[1:])
        return commit

    # ------------------------------------------------------------------ metrics

    def _observe(self, seq: Sequence, draft_tokens: int, accepted: int) -> None:
        c = SpecCounters.from_stats(seq.stats, _PREFIX)
        c.observe(draft_tokens, accepted)
        seq.stats.update(c.as_dict(_PREFIX))
        self.totals.observe(draft_tokens, accepted)

    def metrics(self) -> dict[str, float]:
        t = self.totals
        out: dict[str, float] = {
            "spec_decode_num_drafts": t.num_drafts,
            "spec_decode_num_draft_tokens": t.num_draft_tokens,
            "spec_decode_num_accepted_tokens": t.num_accepted_tokens,
            "spec_decode_mean_acceptance_length": t.mean_acceptance_length,
            "spec_decode_acceptance_rate": t.acceptance_rate,
            "spec_decode_disabled_steps": self.disabled_steps,
        }
        for i, n in enumerate(t.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_per_pos_{i}"] = n
        out.update(self.proposer.metrics())
        return out
