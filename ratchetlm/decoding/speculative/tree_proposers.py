"""Training-free tree proposers: ``recycling`` (Token Recycling's successor table), ``suffix``
(SuffixDecoding-style tries over the request and the engine's recent outputs) and ``hybrid``
(both merged into one tree; the default ``speculative`` method is ``ngram``: on Spec-Bench the
hybrid measured level with it, not ahead, docs/benchmarks.md).

Every source proposes scored children for the nodes of one tree and tree_select.py keeps the
nodes, best first, while the expected accepted tokens per unit of verify cost (the measured cost
curve at this step's batch) still grow; a sequence whose best tree is empty takes a plain step.
Where the sources agree on a token they share the node, and the hybrid's tree is the best of both
per node: a suffix match where the request repeats itself (summaries, RAG, code), the successors
the target itself ranked last time where it does not (chat, translation, math).

In a batch (``CHAINS_FROM`` decoding sequences or more, gain schedule) the hybrid drafts the ``ngram``
method's chains instead, with that method's own measured price, ledger and idle gate: there a draft
row costs about what a sequence's row does, and trees measured slower than plain decoding where chains
did not (see ``CHAINS_FROM``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from ratchetlm.decoding.speculative.draft_price import DraftPrice, MeasuredDrafts, Price
from ratchetlm.decoding.speculative.gain import MARGIN
from ratchetlm.decoding.speculative.idle_gate import IdleGate
from ratchetlm.decoding.speculative.proposers import (
    DraftBeam,
    NgramProposer,
    Proposer,
    register_proposer,
    verify_cost,
)
from ratchetlm.decoding.speculative.recycling import SuccessorTable
from ratchetlm.decoding.speculative.suffix_index import History, SequenceIndex, SpanNode, TrieNode
from ratchetlm.decoding.speculative.tree_select import (
    Calibration,
    CostTable,
    DraftSource,
    Plan,
    build,
    judge,
    to_tree,
)
from ratchetlm.sequence import Sequence

TRIE_DEPTH = 20  # substrings indexed per position: a match of up to MAX_MATCH plus its continuation
MAX_MATCH = 12  # longest suffix match looked up (longer ones are rare and no more telling)
SUFFIX_WIDTH = 4  # most frequent continuations kept per suffix node
# A tree step's extra cost against the measured cost curve's price for its rows (tree_select.py): at
# batch 1 on one core (default model, int8, contexts of 100-300 tokens, process CPU time, medians of
# ~200 steps each) steps verifying trees of at most 4 / 8 / 16 nodes cost 1.64x / 2.45x / 4.41x a plain
# step where the curve (1.21x at 4 rows, 1.50x at 8, 2.61x at 16) priced them at ~1.3x / 1.6x / 2.8x:
# the curve times bare forwards (no context, tree mask, staging, commit or top-k of every row).
# Priced at the curve, trees of 1-4 nodes looked worth it at MAL 1.4 (QA, math) and lost there. With the
# measured curve this is where each batch size's learnt price starts (draft_price.DraftPrice's prior).
TREE_PRICE = 1.6
# From this many decoding sequences a step the hybrid drafts n-gram chains (proposers.NgramProposer, with its
# own measured price, ledger and idle gate) instead of trees. On Spec-Bench (default model, int8, one core,
# 2026-11-29, docs/benchmarks.md) at batch 8 its trees measured 0.89-0.98x plain decoding in the decode phase
# (5 runs) where chains measured 0.97-1.03x, at batch 2 1.20x against 1.26x: in a batch a draft row costs
# about what a sequence's row does, so a tree's low-probability branches do not pay, and proposing trees
# (lookups in three sources, a tree per sequence, the successor table's top-k of every row) cost ~3-4 ms a
# step at batch 8 where the n-gram lookup costs ~0.4. At batch 1 trees and chains measured level.
CHAINS_FROM = 2
_PLAN = "spec_tree_plan"  # strategy_state keys: the last tree (judged once committed tokens pass it)
_INDEX = "spec_suffix_index"  # this sequence's SequenceIndex


_RANKS = [("recycling", r) for r in range(64)]  # the table's calibration keys, made once


class RecyclingSource:
    """Children of a node: its token's row of the successor table, keyed by rank."""

    def __init__(self, table: SuccessorTable) -> None:
        self.table = table

    def expand(self, state: Any, token: int) -> list[tuple[int, Hashable, Any]]:
        return [(t, _RANKS[r] if r < len(_RANKS) else ("recycling", r), True)
                for r, t in enumerate(self.table.successors(token))]


class SuffixSource:
    """Children of a node: the continuations of its suffix-trie node, keyed by the match length so
    far (the match grows by one per accepted level), their frequency and how often the node occurred."""

    def __init__(self, name: str) -> None:
        self.name = name

    def expand(self, state: tuple[TrieNode | SpanNode, int], token: int) -> list[tuple[int, Hashable, Any]]:
        node, m = state
        found: dict[int, TrieNode] | dict[int, SpanNode] = node.kids
        kids: list[tuple[int, TrieNode | SpanNode]] = sorted(found.items(), key=lambda kv: -kv[1].count)
        total = sum(k.count for _, k in kids)
        kids = kids[:SUFFIX_WIDTH]
        seen = 0 if total == 1 else 1 if total < 5 else 2
        return [(t, (self.name, min(m, 8), min(int(4 * k.count / total), 4), seen), (k, m + 1) if k.kids else None)
                for t, k in kids]


def prior(key: tuple) -> float | None:
    """A new key's acceptance guess before its own counts (worth 2 of them): a suffix match of
    ``m`` tokens ``m / (m + 2)``, less for a rarer continuation (on the default model a 1-token
    n-gram match's first token was right 4-29% of the time, a 4-token match's 96-100%,
    docs/speculative.md); the table's rank ``r`` ``0.3 / (r + 1)``. Without it a fresh engine
    started every key at its source's rate, which its 1-token matches dragged down, and drafted
    too little during a request's first hundred tokens."""
    if key[0] == "recycling":
        return 0.3 / (key[1] + 1)
    if key[0] in ("suffix", "history"):
        m, freq = key[1], key[2]
        return m / (m + 2) * (0.6 + 0.1 * freq)
    return None


class TreeProposer(Proposer):
    """Drafts a tree per sequence from its ``sources`` (set by the registered subclasses)."""

    recycling = False
    suffix = False
    chains_in_batch = False  # the hybrid: n-gram chains from CHAINS_FROM decoding sequences (gain schedule)

    def __init__(self, cfg: Any, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        self.table = SuccessorTable(cfg.recycle_k) if self.recycling else None
        self.history = History(TRIE_DEPTH, cfg.history_tokens) if self.suffix else None
        self.sources: list[DraftSource] = []
        if self.table is not None:
            self.sources.append(RecyclingSource(self.table))
        if self.suffix:
            self.sources += [SuffixSource("suffix"), SuffixSource("history")]
        self.wants_logits = self.recycling
        self.calib = Calibration(prior=prior)
        self.costs = CostTable(verify_cost(cfg, ctx))
        self.gain = cfg.depth_schedule != "constant"
        # a price fixed by verify_token_cost is taken as given (the curve's, nothing measured); the measured
        # curve's is learnt per batch size from the steps' own times, starting at TREE_PRICE, and a ledger
        # stops proposing at a batch size where it measured slower than plain steps (draft_price.py)
        self.measured = MeasuredDrafts(DraftPrice(TREE_PRICE)) \
            if self.gain and cfg.verify_token_cost is None else None
        self.gate = IdleGate()  # batch sizes at which the gain rule drafts nothing: plain steps, no proposing
        self.counts = {"trees": 0, "nodes": 0, "skipped": 0, "chain_steps": 0}
        # in a batch: chains by prompt lookup, sized, priced and gated as the ngram method's (CHAINS_FROM)
        self.chains = NgramProposer(cfg, ctx) if self.chains_in_batch and self.gain else None

    def max_draft_tokens(self, depth: int) -> int:
        return self.cfg.tree_nodes

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        b, m = len(seqs), self.measured
        if self.chains is not None and b >= CHAINS_FROM:  # a batch: n-gram chains, no tree and no top-k
            self.wants_logits = False
            self.counts["chain_steps"] += 1
            return self.chains.propose(seqs, depths)
        # a gated step is a plain one: nothing proposed, and the strategy hands over no logits (no top-k)
        gated = self.gain and ((m is not None and not m.allows(b)) or not self.gate.open(b))
        self.wants_logits = self.recycling and not gated
        plain = self.costs(b)[b] + self.costs.cost.first_token * sum(s.num_cached for s in seqs) \
            if m is not None else 0.0
        if gated:
            if m is not None:
                m.record(b, plain, 0.0, 0, False)
            return [None] * len(seqs)
        price = m.price.price(b) if m is not None else Price()
        margin = MARGIN if m is not None and b > 1 else 0.0
        out: list[DraftBeam | None] = []
        drafted = 0  # rows this step's earlier sequences drafted
        extra, drafting = 0.0, 0  # the curve's price of this step's trees, sequences that drafted
        for seq, d in zip(seqs, depths, strict=True):
            tokens = seq.token_ids
            prev: Plan | None = seq.strategy_state.get(_PLAN)
            if prev is not None and prev.start < len(tokens):
                judge(prev, tokens, self.calib)
            plan = build(self.sources, self._roots(seq), tokens[-1], self.calib, self.costs, self.cfg.tree_nodes, d,
                         b, drafted, self.gain, len(tokens), seq.num_cached, price, margin)
            seq.strategy_state[_PLAN] = plan
            if not plan.nodes:
                self.counts["skipped"] += bool(plan.root_kids)
                out.append(None)
                continue
            self.counts["trees"] += 1
            self.counts["nodes"] += len(plan.nodes)
            drafted += len(plan.nodes) + 1
            extra += plan.extra
            drafting += 1
            # the tree alone: the strategy verifies it as is (a beam, two tensors, only for a grammar's cut)
            out.append(DraftBeam(None, None, to_tree(plan.nodes)))
        if self.gain:
            self.gate.observe(b, drafted > 0)
            if m is not None:
                m.record(b, plain, extra, drafting, True)
        return out

    def _roots(self, seq: Sequence) -> dict[int, Any]:
        """Each source's state at the root (the last committed token); absent: nothing to propose."""
        roots: dict[int, Any] = {}
        i = 0
        if self.table is not None:
            roots[i] = True
            i += 1
        if self.suffix:
            assert self.history is not None
            idx: SequenceIndex | None = seq.strategy_state.get(_INDEX)
            if idx is None:
                idx = seq.strategy_state[_INDEX] = SequenceIndex(TRIE_DEPTH)
            idx.sync(seq.token_ids)
            own = idx.match(MAX_MATCH)
            if own is not None:
                roots[i] = own
            hist = self.history.trie.find(seq.token_ids[-MAX_MATCH:], MAX_MATCH)
            if hist is not None:
                roots[i + 1] = hist
        return roots

    def observe_logits(self, tokens: list[int], logits: torch.Tensor) -> list[int] | None:
        return self.table.observe(tokens, logits) if self.table is not None else None

    def finish(self, seq: Sequence) -> None:
        if self.history is not None:
            self.history.add(seq.output_ids)

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        # (each takes only a step it recorded, of that batch size: trees and chains never share a batch size)
        if self.measured is not None:
            self.measured.observe_step(batch, tokens, seconds)
        if self.chains is not None:
            self.chains.observe_step(batch, tokens, seconds)

    def metrics(self) -> dict[str, float]:
        c = self.counts
        out: dict[str, float] = {
            "spec_decode_tree_drafts": c["trees"], "spec_decode_tree_draft_nodes": c["nodes"],
            "spec_decode_gain_skipped_drafts": c["skipped"], "spec_decode_idle_plain_steps": self.gate.skipped}
        if self.measured is not None:  # the ledger's plain steps and the measured price (draft_price.py)
            out.update(self.measured.metrics())
        if self.chains is not None:  # the chains' counts added (their prices are of batch sizes trees never see)
            out["spec_decode_chain_steps"] = self.counts["chain_steps"]
            for k, v in self.chains.metrics().items():
                out[k] = out.get(k, 0.0) + v
        return out


@register_proposer("recycling")
class RecyclingProposer(TreeProposer):
    recycling = True


@register_proposer("suffix")
class SuffixProposer(TreeProposer):
    suffix = True


@register_proposer("hybrid")
class HybridProposer(TreeProposer):
    recycling = True
    suffix = True
    chains_in_batch = True
