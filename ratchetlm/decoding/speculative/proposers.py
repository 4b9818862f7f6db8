"""Draft proposers: each turns a sequence's committed tokens into a beam of candidates.

A proposer returns, per sequence, a :class:`DraftBeam` ``(M, C)`` of candidate continuations
of the sequence's last committed token (or ``None``: nothing to propose, decode one token
plainly). Shorter candidates are right-padded with ``PAD`` (-1), which never equals a real
token, so padding never merges with real nodes and is stripped before verification.
Verification never looks at how a beam was produced, so a trained draft head (EAGLE/Medusa)
or an MTP module only has to implement :class:`Proposer`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ratchetlm.decoding.speculative.cost_curve import CostCurve, measured
from ratchetlm.decoding.speculative.draft_price import DraftLedger, MeasuredDrafts
from ratchetlm.decoding.speculative.gain import GainSchedule, PendingContinuation
from ratchetlm.decoding.speculative.idle_gate import IdleGate
from ratchetlm.decoding.speculative.suffix_index import TokenPositions
from ratchetlm.decoding.speculative.verify import DraftTree, prefix_tree
from ratchetlm.sequence import Sequence

PAD = -1


@dataclass(frozen=True)
class DraftBeam:
    # [M, C] int64 candidate ids, PAD after a candidate's end; None: ``tree``'s (draft_tree.candidates)
    tokens: torch.Tensor | None
    scores: torch.Tensor | None  # [M, C] float: proposer's cumulative score (log-prob for model drafts)
    # the same candidates as a deduplicated tree, when the proposer built one anyway (the tree
    # proposers): the strategy then verifies it as is instead of packing ``tokens`` back into a tree
    tree: DraftTree | None = None

    def __post_init__(self) -> None:
        assert self.tokens is not None or self.tree is not None, "a draft beam needs its tokens or its tree"


class Proposer(ABC):
    """Produces draft beams for a batch of decoding sequences (each with exactly one uncached token)."""

    # True: the strategy hands :meth:`observe` the target's final hidden states of every committed
    # position (the features a trained draft head such as EAGLE, Medusa or an MTP module reads).
    wants_features: bool = False
    # True: the strategy hands :meth:`observe_logits` the logits of every row each forward computed
    # (committed, rejected or prefill's last), once per step (Token Recycling's successor table);
    # read at every commit, so a proposer may turn it off for a step it did not propose in
    wants_logits: bool = False

    def __init__(self, cfg: Any, ctx: Any) -> None:
        self.cfg = cfg  # SpecConfig
        self.ctx = ctx  # StrategyContext

    @abstractmethod
    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        """``depths[i] >= 1``: at most that many tokens per candidate for ``seqs[i]``."""

    def release(self, seq: Sequence) -> None:
        """``seq`` finished or was preempted: free any per-sequence resources (draft KV)."""
        return None

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """Only if ``wants_features``: the target's final hidden states ``[n, hidden]`` (after its
        last norm) of positions ``start .. start + n - 1``, whose K/V this step commits."""
        return None

    def observe_logits(self, tokens: list[int], logits: torch.Tensor) -> list[int] | None:
        """Only if ``wants_logits``: ``tokens`` (``R``) the input token of every row of the step's
        forward whose logits were computed, ``logits`` ``[R, vocab]`` (CPU fp32) those rows' logits.
        May return every row's ``layers.sampler.argmax`` (computed on the way, e.g. a top-k's first
        entry), which the greedy verify then reads instead of reducing the rows again."""
        return None

    def finish(self, seq: Sequence) -> None:
        """``seq`` finished (stop, length, abort; called before :meth:`release`)."""
        return None

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        """The last step decoded ``batch`` sequences and nothing else (no prompt rows, no forced
        chain), committed ``tokens`` and took ``seconds`` from its proposals to its commits (the
        strategy's clock, draft_price.step_clock): a proposer that prices its drafts may learn their
        real cost."""
        return None

    def max_draft_tokens(self, depth: int) -> int:
        """Most draft tokens one proposal for a sequence may hold (the scheduler reserves them)."""
        return int(self.cfg.num_candidates) * depth

    def metrics(self) -> dict[str, float]:
        """Proposer counters merged into the strategy's /metrics."""
        return {}


_PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(name: str) -> Callable[[type[Proposer]], type[Proposer]]:
    def deco(cls: type[Proposer]) -> type[Proposer]:
        _PROPOSERS[name] = cls
        return cls

    return deco


def proposer_names() -> list[str]:
    return sorted(_PROPOSERS)


def create_proposer(name: str, cfg: Any, ctx: Any) -> Proposer:
    if name not in _PROPOSERS:
        raise ValueError(f"speculative method must be one of {proposer_names()}, got {name!r}")
    return _PROPOSERS[name](cfg, ctx)


def ngram_candidates(tokens: list[int], min_n: int, max_n: int, m: int, c: int,
                     earlier: list[int] | None = None) -> list[tuple[int, list[int]]]:
    """Up to ``m`` distinct continuations (each up to ``c`` tokens) following earlier occurrences
    of the sequence's longest suffix n-gram, ``min_n <= n <= max_n``, each with its match length
    ``n``. Longer matches come first; within one length, the most recent occurrence first (recent
    context is the likeliest copy source when editing code). Shorter n-grams only fill candidates
    the longer ones left open.

    Every occurrence ends on a copy of the last token: one vector comparison finds those, and each
    is extended backwards (at most ``max_n`` tokens) in Python — a few tens of microseconds per
    step, where a window comparison per n took ~130 us on a 400-token sequence with no match.
    ``earlier``: the positions of the last token's earlier copies, most recent first, when the caller
    keeps them (suffix_index.TokenPositions: a dictionary read where the comparison reads the whole text)."""
    t = len(tokens)
    top = min(max_n, t - 1)
    if top < min_n:
        return []
    if earlier is not None:
        ends = earlier
    else:
        arr = np.asarray(tokens, dtype=np.int64)
        ends = np.flatnonzero(arr[: t - 1] == arr[t - 1])[::-1].tolist()  # most recent first; each followed by one
    found = []  # (end, match length <= top)
    for e in ends:
        n = 1
        while n < top and e - n >= 0 and tokens[e - n] == tokens[t - 1 - n]:
            n += 1
        found.append((e, n))
    out: list[tuple[int, list[int]]] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(top, min_n - 1, -1):
        for e, length in found:
            if length < n:
                continue
            cont = tokens[e + 1 : e + 1 + c]
            key = tuple(cont)
            if key in seen:
                continue
            seen.add(key)
            out.append((n, cont))
            if len(out) == m:
                return out
    return out


_GAIN = "spec_gain"  # strategy_state key: the gain schedule's record of this sequence
_TOKENS = "spec_ngram_tokens"  # strategy_state key: the sequence's TokenPositions


def verify_cost(cfg: Any, ctx: Any) -> CostCurve:
    """The gain schedule's price of verified rows: ``verify_token_cost`` if set (the linear model),
    else the target model's measured cost curve (cost_curve.py)."""
    if cfg.verify_token_cost is not None:
        return CostCurve.linear(cfg.verify_token_cost)
    runner = getattr(ctx, "runner", None)
    if runner is None or getattr(runner, "model", None) is None:
        return CostCurve.linear(0.09)
    return measured(runner.model, getattr(runner, "device", "cpu"), cache=getattr(runner, "cache", None))


@register_proposer("ngram")
class NgramProposer(Proposer):
    """Prompt lookup: copy what followed earlier occurrences of the current suffix. With
    ``depth_schedule="gain"`` each draft is cut to the length expected to pay (gain.py)."""

    def __init__(self, cfg: Any, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        # a measured curve's price is corrected by the steps' own times (draft_price.py); a fixed
        # verify_token_cost is taken as is
        # and whether drafting has paid at each batch size, as measured
        self.measured = MeasuredDrafts() if cfg.verify_token_cost is None and cfg.depth_schedule == "gain" else None
        self.gain = GainSchedule(cfg.max_n, cfg.depth, verify_cost(cfg, ctx),
                                 None if self.measured is None else self.measured.price) \
            if cfg.depth_schedule == "gain" else None
        self.gain_skipped = 0  # steps whose n-gram match was not worth drafting
        # batch sizes at which the gain rule drafts nothing: plain steps, no lookups. Alone, a lookup
        # costs ~0.1 ms and always runs: gated after four steps without a match, 14 Spec-Bench cases
        # skipped 161 lookups and with them ~50 drafts that would have committed ~35 tokens more
        self.gate = IdleGate(from_batch=2)

    @property
    def ledger(self) -> DraftLedger | None:
        return None if self.measured is None else self.measured.ledger

    def metrics(self) -> dict[str, float]:
        if self.gain is None:
            return {}
        out: dict[str, float] = {"spec_decode_gain_skipped_drafts": self.gain_skipped,
                                 "spec_decode_idle_plain_steps": self.gate.skipped}
        if self.measured is not None:  # the ledger's plain steps and the measured price (draft_price.py)
            out.update(self.measured.metrics())
        return out

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        if self.measured is not None:
            self.measured.observe_step(batch, tokens, seconds)

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        m = self.measured
        if self.gain is not None and ((m is not None and not m.allows(len(seqs))) or not self.gate.open(len(seqs))):
            if m is not None:
                m.record(len(seqs), self.gain.plain_cost(len(seqs), sum(s.num_cached for s in seqs)), 0.0, 0, False)
            return [None] * len(seqs)
        out: list[DraftBeam | None] = []
        drafted = 0  # rows this step's earlier sequences drafted (their cost is already taken)
        extra, drafting = 0.0, 0  # the curve's price of this step's drafts, sequences that drafted
        for seq, d in zip(seqs, depths, strict=True):
            held = seq.strategy_state.get(_TOKENS)
            if held is None:
                held = seq.strategy_state[_TOKENS] = TokenPositions()
            held.sync(seq.token_ids)
            cands = ngram_candidates(seq.token_ids, self.cfg.min_n, self.cfg.max_n, self.cfg.num_candidates,
                                     d if self.gain is None else self.cfg.depth, earlier=held.earlier())
            if self.gain is not None:
                d = self._gain_length(seq, cands, d, len(seqs), drafted)
                self.gain_skipped += bool(cands) and d == 0
                drafted += d + 1 if d else 0
                if cands and d:
                    extra += self.gain.last_extra
                    drafting += 1
            cands = [(n, x[:d]) for n, x in cands]
            if not cands or d == 0:
                out.append(None)
                continue
            conts = [x for _, x in cands]
            # the tree (verify.prefix_tree: pack's tree, built from the lists): the strategy verifies it as is
            # instead of packing the beam back into it (~20 us a drafting sequence and step); the beam's
            # tensors only where a grammar cuts the candidates first (two tensors, ~0.05 ms after a forward)
            tree, toks = prefix_tree(conts), None
            if tree is None or seq.controls is not None and seq.controls.grammar is not None:
                width = max(len(x) for x in conts)
                toks = torch.tensor([x + [PAD] * (width - len(x)) for x in conts], dtype=torch.long)
            out.append(DraftBeam(toks, None if toks is None else torch.zeros(toks.shape), tree))
        if self.gain is not None:
            self.gate.observe(len(seqs), drafted > 0)
            if m is not None:
                m.record(len(seqs), self.gain.plain_cost(len(seqs), sum(s.num_cached for s in seqs)), extra,
                         drafting, True)
        return out

    def _gain_length(self, seq: Sequence, cands: list[tuple[int, list[int]]], max_depth: int, batch: int,
                     drafted: int) -> int:
        """Judge this sequence's earlier continuations, record the new one, pick its draft length."""
        assert self.gain is not None
        rec = seq.strategy_state.get(_GAIN)
        if rec is None:
            rec = seq.strategy_state[_GAIN] = self.gain.new_record()
        self.gain.judge(rec, seq.token_ids)
        if not cands:
            return 0
        n, cont = cands[0]
        if rec.pending and rec.pending[-1].start == len(seq.token_ids):
            rec.pending.pop()  # proposed again from the same state (a discarded step is re-run)
        rec.pending.append(PendingContinuation(len(seq.token_ids), n, cont))
        return self.gain.length(rec, n, min(max_depth, len(cont)), batch, drafted, seq.num_cached)
