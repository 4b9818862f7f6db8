"""The ``speculative`` strategy: draft a tree, verify it staged, commit the accepted path.

Per decoding sequence (exactly one uncached token, the *root*) a step proposes
``[root] + packed tree nodes`` with ``direct_write=False``: the tree mask extended with the
root, positions ``num_cached + depth`` (root depth 0). Its K/V are staged, never written to the
paged cache; the commit names the root plus the accepted root-to-node path (any branch, not a
contiguous range) and appends the accepted tokens + the correction/bonus token. Sequences in
prefill (more than one uncached token) and sequences without a draft use the plain
catch-up path (direct writes), so speculative and plain rows mix freely in one batch.

All drafting sequences' beams are packed by one ``pack`` call (draft_tree.py). Greedy verification
walks the tree by the target's greedy tokens (the result of the seed's verified beam,
``tree_attention.unpack_verified``, without building it); sampling judges each candidate entry on its
parent row (``tree_attention.parent_rows``, the same mapping).

Speculative chunk verify (SCV, ``chunk_size = k > 0``): a forward verifies only the next k levels
of a draft. When the verifier's next token is a draft node that forward did not carry (the chunk's
path was accepted to its end), the engine runs another forward *in the same step* for the draft
below that node, on top of what was just committed (:meth:`continue_step`) — chunk by chunk until
a rejection, the end of the draft or the step's token budget.

Grammar-constrained requests: every draft candidate is cut at the first token the grammar
rejects, and rows are verified on the grammar-masked target (decoding/tentative.py); when the
grammar forces a continuation, that chain is verified instead of a draft (jump-forward, never
chunked, whatever the depth schedule or ``disable_by_batch_size``).

Depth is capped so that no proposal emits more tokens than ``max_tokens``/``max_model_len``
allow, and ``tokens_wanted`` reports the largest step so the scheduler reserves its KV.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ratchetlm.decoding.autoregressive import catch_up_commit, catch_up_proposal
from ratchetlm.decoding.base import Commit, DecodeStrategy, Proposal, StrategyContext, register
from ratchetlm.decoding.speculative import (  # noqa: F401  (register the proposers)
    draft_model,
    eagle,
    eagle_lookup,
    mtp,
    self_draft,
    tree_proposers,
)
from ratchetlm.decoding.speculative.config import SpecConfig
from ratchetlm.decoding.speculative.draft_price import step_clock
from ratchetlm.decoding.speculative.draft_tree import candidates, continuation, cut, restrict, trees_from_beams
from ratchetlm.decoding.speculative.proposers import PAD, create_proposer
from ratchetlm.decoding.speculative.stats import ChunkCounters, SpecCounters, observe_into
from ratchetlm.decoding.speculative.tree_attention import with_root
from ratchetlm.decoding.speculative.verify import DraftTree
from ratchetlm.decoding.tentative import chain_limit, forced_chain, observe_forced, verify_tree
from ratchetlm.sequence import Sequence

_PREFIX = "spec_"
_CONTINUE = "spec_continue"  # strategy_state key: SCV work left for this step (_Continue)
_DEPTH = "spec_depth"  # strategy_state key: the adaptive schedule's current draft depth


@dataclass(frozen=True)
class TreeState:
    tree: DraftTree  # the nodes this forward verifies
    draft: DraftTree  # the (rest of the) step's draft they were cut from
    nodes: list[int]  # draft node of each tree node
    first: bool  # the step's first forward for this draft (SCV continuations are not)
    depth: int  # levels of the step's whole draft
    accepted: int  # draft tokens accepted by this step's earlier forwards
    forced: bool = False  # the chain is grammar-forced tokens (jump-forward), not a draft


@dataclass(frozen=True)
class _Continue:
    length: int  # the sequence's committed length it applies to
    draft: DraftTree  # what is left of the draft below the accepted node
    depth: int
    accepted: int


def tree_mask(tree: DraftTree) -> torch.Tensor:  # [L, L] bool ancestor-or-self
    return _ancestors(tuple(tree.parent))


def rooted_mask(parent: list[int]) -> torch.Tensor:  # [1 + L, 1 + L] bool, read only
    """``with_root(tree_mask(tree))`` of a tree with these parents, made once per shape: the step
    then hands the forward a kept tensor (building it cost four tensor operations, ~0.1 ms after a
    forward). Callers must not write into it."""
    return _rooted(tuple(parent))


@functools.lru_cache(maxsize=512)  # tree shapes kept (a proposer's trees take a few dozen)
def _rooted(parent: tuple[int, ...]) -> torch.Tensor:
    return with_root(_ancestors(parent))


def _ancestors(parent: tuple[int, ...]) -> torch.Tensor:  # [L, L] bool ancestor-or-self
    rows: list[list[bool]] = []  # (built in Python: a row op per node cost ~3 us each)
    for i, p in enumerate(parent):
        row = rows[p].copy() if p >= 0 else [False] * len(parent)
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(len(parent), len(parent))


@register("speculative")
class Speculative(DecodeStrategy):
    stages = True

    def __init__(self, ctx: StrategyContext, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, options)
        opts = dict(self.options)
        if "method" not in opts and chain_limit(ctx.runner) < 1 << 30:
            opts["method"] = "ngram"  # a runner that verifies chains only (DeepSeek-V4): the default can't be a tree
        self.cfg = SpecConfig.from_options(opts)
        self.proposer = create_proposer(self.cfg.method, self.cfg, ctx)
        self.totals = SpecCounters()
        self.chunks = ChunkCounters()
        self.disabled_steps = 0  # steps decoded plainly because of disable_by_batch_size
        # a decode-only step's time, propose to commit, for the proposer's price of drafts (draft_price.py)
        self._clock = step_clock(getattr(ctx.runner, "device", "cpu"))
        self._timed: tuple[int, float] | None = None  # (batch, start) of the step being timed

    # ------------------------------------------------------------------ lifecycle

    def on_preempt(self, seq: Sequence) -> None:
        self.proposer.release(seq)  # before the state dict (which holds the draft's block table) goes
        super().on_preempt(seq)

    def on_finish(self, seq: Sequence) -> None:
        self.proposer.finish(seq)
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

    def tokens_wanted(self, seq: Sequence) -> int:
        pending = len(seq.token_ids) - seq.num_cached
        if pending > 1:
            return pending
        forced = forced_chain(seq, 1 << 30, self._room(seq), chain_limit(self.ctx.runner))
        # all chunks of a draft run in one step
        return 1 + (len(forced) if forced else self.proposer.max_draft_tokens(self._depth(seq)))

    # ------------------------------------------------------------------ propose

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        for s in seqs:
            s.strategy_state.pop(_CONTINUE, None)  # SCV work never outlives its step
        start = self._clock()
        self._timed = None
        limit = self.cfg.disable_by_batch_size
        disabled = bool(limit and len(seqs) >= limit)  # a big batch: no drafts (they cost more than they save)
        self.disabled_steps += disabled
        props: list[Proposal | None] = [None] * len(seqs)
        todo: list[int] = []
        depths: list[int] = []
        forced: dict[int, list[int]] = {}
        for i, (s, b) in enumerate(zip(seqs, budgets, strict=True)):
            chain_ = forced_chain(s, b, self._room(s), chain_limit(self.ctx.runner))
            if chain_:  # the grammar admits one continuation: verify it instead of a draft
                forced[i] = chain_
                continue
            d = min(self._depth(s), b - 1)
            if not disabled and len(s.token_ids) - s.num_cached == 1 and d > 0:
                todo.append(i)
                depths.append(d)
        if len(todo) == len(seqs) and not disabled:  # decode rows only: the proposer may learn from its time
            self._timed = (len(seqs), start)
        beams = self.proposer.propose([seqs[i] for i in todo], depths) if todo else []
        built: dict[int, DraftTree] = {}  # trees a proposer built itself (no grammar to cut them)
        drafted: list[tuple[int, torch.Tensor]] = []
        for i, beam in zip(todo, beams, strict=True):
            if beam is not None and beam.tree is not None and (seqs[i].controls is None
                                                               or seqs[i].controls.grammar is None):
                built[i] = beam.tree
            elif beam is not None:  # (a tree proposer's tree: its candidates, to cut at the grammar)
                tokens = beam.tokens if beam.tokens is not None else candidates(beam.tree)[0]  # type: ignore[arg-type]
                drafted.append((i, self._grammar_cut(seqs[i], tokens)))
        drafted += [(i, torch.tensor([tokens])) for i, tokens in forced.items()]
        # every other tentative tree of the step (drafts and forced chains) through one pack() call
        trees = trees_from_beams([tokens for _, tokens in drafted]) if drafted else []
        built.update((i, tree) for (i, _), tree in zip(drafted, trees, strict=True))
        for i, tree in built.items():
            props[i] = self._tree_proposal(seqs[i], tree, budgets[i], True, max(tree.depth, default=-1) + 1, 0,
                                           forced=i in forced)
        return [p if p is not None else catch_up_proposal(s, b) for p, s, b in zip(props, seqs, budgets, strict=True)]

    @staticmethod
    def _grammar_cut(seq: Sequence, tokens: torch.Tensor) -> torch.Tensor:  # [M, C] with PAD
        """Each candidate's draft tokens up to the first one the request's grammar rejects."""
        if seq.controls is None or seq.controls.grammar is None:
            return tokens
        tokens = tokens.clone()
        for row in tokens:
            ok = seq.controls.valid_prefix([t for t in row.tolist() if t != PAD])
            row[ok:] = PAD
        return tokens

    def continue_step(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal | None]:
        """SCV: the next chunk of a draft whose previous chunk was accepted, in the same step."""
        out: list[Proposal | None] = []
        for s, b in zip(seqs, budgets, strict=True):
            c: _Continue | None = s.strategy_state.pop(_CONTINUE, None)
            # the commit's K/V must have landed (a staging fallback leaves several tokens uncached)
            ok = c is not None and c.length == len(s.token_ids) == s.num_cached + 1
            out.append(self._tree_proposal(s, c.draft, b, False, c.depth, c.accepted) if c is not None and ok
                       else None)
        return out

    def _tree_proposal(self, seq: Sequence, draft: DraftTree, budget: int, first: bool, depth: int,
                       accepted: int, forced: bool = False) -> Proposal | None:
        """The chunk of ``draft`` this forward verifies, under the step budget and the room left;
        None when nothing of it fits."""
        room = self._room(seq) - 1  # draft levels whose tokens may still be appended
        chunk = 0 if forced else self.cfg.chunk_size
        nodes = [k for k in cut(draft, chunk, budget - 1) if draft.depth[k] < room]
        if not nodes:
            return None
        tree = draft if len(nodes) == len(draft) else restrict(draft, nodes)
        base = seq.num_cached
        # a chain (every node the child of the one before) with its root is causal: no mask (the
        # attention batch then builds none: kernels/attention.c's causal rule, the same visible keys)
        chain = all(p == k - 1 for k, p in enumerate(tree.parent))
        return Proposal(
            token_ids=[seq.token_ids[-1]] + tree.tokens,
            positions=[base] + [base + 1 + d for d in tree.depth],
            logit_rows=list(range(1 + len(tree))),
            mask=None if chain else rooted_mask(tree.parent),
            direct_write=False,
            state=TreeState(tree, draft, nodes, first, depth, accepted, forced),
        )

    # ------------------------------------------------------------------ commit

    def commit(self, seqs: list[Sequence], proposals: list[Proposal], logits: list[torch.Tensor]) -> list[Commit]:
        greedy: list[int] | None = None  # every logit row's argmax, where the proposer's top-k gave it
        if self.proposer.wants_logits and logits:  # every computed row's top-k (recycling), one call a step
            rows = [p.token_ids[r] for p in proposals for r in p.logit_rows]
            # one proposal's rows are already one tensor: no copy of [R, vocab] (~0.1 ms at a dozen rows)
            greedy = self.proposer.observe_logits(rows, logits[0] if len(logits) == 1 else torch.cat(logits))
        out = []
        first = 0  # the proposal's first row in ``greedy``
        for i, (s, p, lg) in enumerate(zip(seqs, proposals, logits, strict=True)):
            if isinstance(p.state, TreeState):
                c = self._commit_tree(s, p, lg, None if greedy is None else greedy[first : first + len(p.logit_rows)])
            else:  # (its last row's argmax, where known)
                c = catch_up_commit(s, p, lg, greedy=None if greedy is None or not p.logit_rows
                                    else greedy[first + len(p.logit_rows) - 1])
            first += len(p.logit_rows)
            if self.proposer.wants_features and c.kv_rows:
                hidden = self.ctx.runner.last_hidden[i]  # [len(p.token_ids), hidden]
                self.proposer.observe(s, s.num_cached, hidden[torch.tensor(c.kv_rows, device=hidden.device)])
            out.append(c)
        timed, self._timed = self._timed, None
        # a step the strategy proposed for (not an SCV continuation), whole (fault isolation re-runs halves)
        if timed is not None and timed[0] == len(seqs) and all(isinstance(p.state, TreeState) and p.state.first
                                                               or p.state is None for p in proposals):
            if not any(_CONTINUE in s.strategy_state for s in seqs):  # its drafts' verify is not over yet
                self.proposer.observe_step(timed[0], sum(len(c.token_ids) for c in out), self._clock() - timed[1])
        return out

    def _commit_tree(self, seq: Sequence, prop: Proposal, logits: torch.Tensor,
                     greedy: list[int] | None = None) -> Commit:
        """``greedy``: the argmax of each of ``logits``' rows, when already known (the raw rows')."""
        st: TreeState = prop.state
        tree = st.tree
        commit, path = verify_tree(seq, tree, logits, self._room(seq), greedy)
        if st.forced:
            observe_forced(seq, len(tree), len(path))
            return commit
        tokens = commit.token_ids
        rest = None
        if self.cfg.chunk_size and len(tokens) == len(path) + 1:
            rest = continuation(st.draft, st.nodes, st.nodes[path[-1]] if path else -1, tokens[-1])
        # the next token is the draft's own next node (beyond this chunk): an accepted draft token too
        matched = int(rest is not None)
        accepted = len(path) + matched
        self._observe(seq, st, len(tree) + matched, accepted, len(tokens))
        if rest is not None and len(rest):  # verify the draft below that node now, in this step
            seq.strategy_state[_CONTINUE] = _Continue(len(seq.token_ids) + len(tokens), rest, st.depth,
                                                      st.accepted + accepted)
        else:
            self._adapt_depth(seq, st.depth, st.accepted + accepted)
        return commit

    # ------------------------------------------------------------------ metrics

    def _observe(self, seq: Sequence, st: TreeState, drafted: int, accepted: int, committed: int) -> None:
        """vLLM's counters count a step's draft once (its chunks add tokens to it); SCV's count chunks."""
        observe_into(seq.stats, _PREFIX, drafted, accepted, new_draft=st.first, offset=st.accepted)
        self.totals.observe(drafted, accepted, new_draft=st.first, offset=st.accepted)
        if self.cfg.chunk_size:
            ch = ChunkCounters.from_stats(seq.stats, _PREFIX)
            ch.observe(accepted, committed, continued=not st.first)
            seq.stats.update(ch.as_dict(_PREFIX))
            self.chunks.observe(accepted, committed, continued=not st.first)

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
        if self.cfg.chunk_size:
            out.update(self.chunks.metrics("spec_decode_"))
        out.update(self.proposer.metrics())
        return out
