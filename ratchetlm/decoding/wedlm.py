"""The ``wedlm`` strategy: WeDLM sliding-window parallel decoding on the paged engine.

A step for a decoding sequence with committed length ``L`` (all of it cached):

1. refill the window (one mask per leading filled slot, capped by ``max_model_len − L − |window|``);
2. propose the window in topological order (filled slots, then masks), positions ``L + slot``,
   plain causal attention over the committed paged KV plus this order, ``direct_write=False``:
   every row's K/V goes to the staging buffer, none to the cache;
3. commit the ``p`` leading filled slots: they are proposal rows ``0..p-1`` and were computed
   exactly as in AR context, so their staged K/V is copied to slots ``L..L+p-1``; the rest of
   the window's K/V is discarded (recomputed next step);
4. fill masks by distance-adjusted entropy (:func:`~ratchetlm.decoding.wedlm_window.fill`).

Prefill is the ordinary direct-write catch-up, and produces no token (the window's first
forward does). Every step makes progress: a forward either commits or fills at least one slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ratchetlm.decoding.autoregressive import catch_up_commit, catch_up_proposal
from ratchetlm.decoding.base import Commit, DecodeStrategy, Proposal, StrategyContext, register
from ratchetlm.decoding.wedlm_window import WeDLMConfig, Window, commit_length, fill, new_window, refill
from ratchetlm.layers.sampler import target_logits
from ratchetlm.sequence import Sequence

_KEY = "wedlm_window"
_SAVED = "wedlm_window_before_step"  # (propose call number, the window as it was before that step)
_STAT_KEYS = ("wedlm_forwards", "wedlm_fills", "wedlm_commits", "wedlm_window_tokens")


@dataclass(frozen=True)
class _Step:
    """What a window proposal carried (the forward's row layout)."""

    window: Window
    order: list[int]  # window slot of each proposal row
    num_filled: int  # rows [0, num_filled) are filled slots, the rest masks
    prune: int  # leading filled slots committed by this forward


@register("wedlm")
class WeDLM(DecodeStrategy):
    stages = True
    def __init__(self, ctx: StrategyContext, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(ctx, options)
        self.cfg = WeDLMConfig.from_options(self.options)
        mask_id = self.cfg.mask_token_id
        if mask_id is None:
            mask_id = getattr(ctx.model_config, "mask_token_id", None)
        if mask_id is None:
            raise ValueError(
                "wedlm decoding needs a WeDLM-trained model: this model declares no mask_token_id "
                "(config.json or tokenizer), and an ordinary autoregressive model's predictions at "
                "[MASK] inputs are meaningless. Pass wedlm={'mask_token_id': N} only for a WeDLM checkpoint."
            )
        vocab = ctx.model_config.vocab_size
        if not 0 <= mask_id < vocab:
            raise ValueError(f"wedlm mask_token_id {mask_id} is outside the vocabulary [0, {vocab})")
        self.mask_id = int(mask_id)
        self.totals = {k: 0 for k in _STAT_KEYS}
        self._proposes = 0  # propose() calls so far: names the step a saved window belongs to

    def check_request(self, params: Any) -> None:
        if params.structured is not None:
            # A grammar's mask at a slot needs every slot before it decided: only in-order filling
            # (built for the penalties) could honour it, and that is not built or tested for grammars.
            raise ValueError("structured outputs are not supported with decoding='wedlm' (a window fills "
                             "positions out of order, so the grammar cannot be enforced exactly); use "
                             "autoregressive or speculative decoding")

    # ------------------------------------------------------------------ window bookkeeping

    def _room(self, seq: Sequence, w: Window | None) -> int:
        """Positions left before ``max_model_len`` after the committed prefix and the window."""
        return self.ctx.max_model_len - len(seq.token_ids) - (len(w) if w is not None else 0)

    def _window(self, seq: Sequence) -> Window:
        w = seq.strategy_state.get(_KEY)
        if w is None:
            w = new_window(self.mask_id, self.cfg.window_size, self._room(seq, None))
            seq.strategy_state[_KEY] = w
        return w

    def tokens_wanted(self, seq: Sequence) -> int:
        pending = len(seq.token_ids) - seq.num_cached
        if pending > 0:
            return pending
        w = seq.strategy_state.get(_KEY)
        if w is None:
            return max(1, min(self.cfg.window_size, self._room(seq, None)))
        return max(1, len(w) + max(0, min(w.leading_filled(), self._room(seq, w))))

    # ------------------------------------------------------------------ propose

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        self._proposes += 1
        out = []
        for seq, budget in zip(seqs, budgets, strict=True):
            if len(seq.token_ids) > seq.num_cached:
                seq.strategy_state.pop(_SAVED, None)
                out.append(catch_up_proposal(seq, budget))
                continue
            w = self._window(seq)
            # propose (refill) and commit (fills) change the window in place: keep it as it was,
            # so a discarded step (fault isolation) re-runs from exactly this state
            seq.strategy_state[_SAVED] = (self._proposes, Window(list(w.tokens), list(w.is_mask), list(w.logprobs)))
            refill(w, self.mask_id, self._room(seq, w))
            assert len(w) > 0, "an unfinished sequence always has window room"
            # With a short step budget only a prefix of the topological order runs: causal
            # attention makes those rows exact, only fewer masks are candidates this step.
            order = w.order()[:budget]
            num_filled = sum(1 for k in order if not w.is_mask[k])
            base = seq.num_cached
            out.append(Proposal(
                token_ids=[w.tokens[k] for k in order],
                positions=[base + k for k in order],
                logit_rows=list(range(num_filled, len(order))),
                mask=None,  # causal over the topological order
                direct_write=False,
                state=_Step(w, order, num_filled, min(w.leading_filled(), len(order))),
            ))
        return out

    def on_step_discarded(self, seq: Sequence) -> None:
        """Restore the window this step started from: dropping it instead would change what the
        sequence commits next (its filled slots are part of its decoding history)."""
        saved = seq.strategy_state.pop(_SAVED, None)
        if saved is not None and saved[0] == self._proposes:
            seq.strategy_state[_KEY] = saved[1]
        # otherwise the failed propose never reached this sequence: its window is untouched

    # ------------------------------------------------------------------ commit

    def commit(self, seqs: list[Sequence], proposals: list[Proposal], logits: list[torch.Tensor]) -> list[Commit]:
        out = []
        for seq, prop, lg in zip(seqs, proposals, logits, strict=True):
            if isinstance(prop.state, _Step):
                out.append(self._commit_window(seq, prop.state, lg))
            else:  # prefill: commit the prompt's KV; the first window forward produces the first token
                out.append(catch_up_commit(seq, prop, lg, sample_next=False))
        return out

    def _commit_window(self, seq: Sequence, st: _Step, logits: torch.Tensor) -> Commit:
        w = st.window
        assert st.order[: st.prune] == list(range(st.prune)), "leading filled slots are the first rows"
        stop_ids = set(seq.eos_token_ids) | set(seq.params.stop_token_ids)
        room = min(seq.params.max_tokens - seq.num_output_tokens, self.ctx.max_model_len - len(seq.token_ids))
        n = commit_length(w.tokens[: st.prune], stop_ids, room)
        tokens = w.tokens[:n]
        lps = None
        if seq.params.logprobs is not None:
            lps = [lp if lp is not None else {} for lp in w.logprobs[:n]]
        finishing = n < st.prune or (n > 0 and tokens[-1] in stop_ids) or n == room
        fills = 0
        if not finishing:
            mask_slots = st.order[st.num_filled :]
            w.drop_front(n)
            slots = [k - n for k in mask_slots]
            judge, in_order = None, False
            controls = seq.controls
            if controls is not None:
                # a mask at slot k is the position after the tokens committed now and window slots
                # 0..k-1 (the controls have seen the earlier output). Masks among those slots are
                # placeholders that only count (in_order is off unless every mask before k is filled)
                def judge(rows: torch.Tensor, ks: list[int]) -> torch.Tensor:
                    return target_logits(rows, controls, [tokens + w.tokens[:k] for k in ks])
                in_order = controls.reads_context
            fills = fill(w, slots, logits, self.cfg, seq.params, seq.generator, judge, in_order)
        self._observe(seq, len(st.order), fills, n)
        return Commit(kv_rows=list(range(n)), token_ids=tokens, logprobs=lps)

    # ------------------------------------------------------------------ stats

    def _observe(self, seq: Sequence, window_tokens: int, fills: int, commits: int) -> None:
        for key, v in zip(_STAT_KEYS, (1, fills, commits, window_tokens), strict=True):
            seq.stats[key] = seq.stats.get(key, 0) + v
            self.totals[key] += v
        f = seq.stats["wedlm_forwards"]
        seq.stats["wedlm_tokens_per_forward"] = seq.stats["wedlm_commits"] / f
        seq.stats["wedlm_avg_window"] = seq.stats["wedlm_window_tokens"] / f

    def metrics(self) -> dict[str, float]:
        t = self.totals
        f = max(1, t["wedlm_forwards"])
        return {
            "wedlm_forwards": t["wedlm_forwards"],
            "wedlm_fills": t["wedlm_fills"],
            "wedlm_commits": t["wedlm_commits"],
            "wedlm_tokens_per_forward": t["wedlm_commits"] / f,
            "wedlm_fills_per_forward": t["wedlm_fills"] / f,
            "wedlm_avg_window": t["wedlm_window_tokens"] / f,
            # the seed's efficiency: prefix tokens committed per mask filled
            "wedlm_efficiency": t["wedlm_commits"] / max(1, t["wedlm_fills"]),
        }
