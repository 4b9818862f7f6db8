"""Continuous batching: which sequences run this step and how many tentative tokens each may use."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from ratchetlm.engine.step_cost import STRETCH_FLOOR, STRETCH_MAX, STRETCH_MIN, Rows, StepCost
from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.sequence import SeqStatus, Sequence

CHUNK_GROWTH = 2  # a prompt's next budgeted chunk is at most this many times its last, plus one


class _Step:
    """The step being built: what is scheduled, its rows for the cost model, tokens left."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens  # of max_num_batched_tokens
        self.out: list[tuple[Sequence, int]] = []
        self.rows: list[Rows] = []
        self.decode_rows: list[Rows] = []
        self.ids: set[int] = set()
        self.decodes = 0
        self.prefills = 0
        self.sample = False  # decode rows alone: the cost model re-measures them (no prompt chunk)

    def add(self, seq: Sequence, n: int, prefill: bool) -> None:
        self.out.append((seq, n))
        rows = Rows.prefill(n, seq.num_cached) if prefill else Rows.decode(n, seq.num_cached)
        self.rows.append(rows)
        if not prefill:
            self.decode_rows.append(rows)
        self.ids.add(seq.seq_id)
        self.tokens -= n
        self.prefills += prefill
        self.decodes += not prefill


class Scheduler:
    """Running sequences are served first (decode rows, then prompt chunks), in arrival order;
    waiting ones are admitted while ``max_num_seqs``, the token budget and the step-time budget
    allow. On admission a sequence first takes the cached blocks its tokens start with (prefix
    caching), so it computes only the rest. When KV blocks run out, the most recently admitted
    running sequence not yet in the step is preempted by recompute (references released,
    ``num_cached = 0``) and goes back to the front of the queue, where it usually re-hits its own
    committed blocks."""

    def __init__(
        self,
        blocks: BlockManager,
        tokens_wanted: Callable[[Sequence], int],
        on_preempt: Callable[[Sequence], None],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_finish: Callable[[Sequence], None] | None = None,
        cost: StepCost | None = None,
        max_step_ms: float = math.inf,
        min_chunk: int = 1,
    ) -> None:
        self.blocks = blocks
        self.tokens_wanted = tokens_wanted
        self.on_preempt = on_preempt
        self.on_finish = on_finish
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the step-time budget (engine/step_cost.py): prompt chunks fill a step up to max_step_ms
        self.cost = cost
        self.max_step_ms = max_step_ms
        # a step's first prompt chunk is never smaller (the prompt must advance). One token: a chunk may
        # end anywhere in a KV block (the cache writes by slot; only full committed blocks are named)
        self.min_chunk = min_chunk
        # seq_id -> its last prompt chunk sized by the budget: the next is at most CHUNK_GROWTH x it
        self._last_chunk: dict[int, int] = {}
        # seq_id of a prompt being chunked -> the decode rows' time (StepCost.decode_ms) in its first step
        # beside them: the streams' inter-token latency before it arrived, which bounds its steps
        self._arrival_ms: dict[int, float] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # (sequence, leader): queued once the leader's prompt K/V is committed (see ``add``)
        self.held: list[tuple[Sequence, Sequence]] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, after_prompt_of: Sequence | None = None) -> None:
        """Queue ``seq``. With ``after_prompt_of`` (a sibling with the same prompt: the choices of
        one ``n > 1`` request), ``seq`` waits until that leader's prompt is committed, so its
        admission finds the prompt's full blocks in the prefix cache and shares them instead of
        computing the prompt again."""
        seq.status = SeqStatus.WAITING
        if after_prompt_of is not None:
            self.held.append((seq, after_prompt_of))
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    def _release_held(self) -> None:
        keep = []
        for seq, lead in self.held:
            if lead.is_finished or lead.num_cached >= lead.num_prompt_tokens:
                self.waiting.append(seq)
            else:
                keep.append((seq, lead))
        self.held = keep

    def prefilling(self, seq: Sequence) -> bool:
        """Still computing its prompt (or recomputing it after a preemption): its rows are a chunk
        the step-time budget may size. Everything else is a decode row (plus the strategy's drafts)."""
        return seq.num_cached < seq.num_prompt_tokens

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's (sequence, token budget) pairs: running sequences' decode rows first (with
        their drafts: the strategy sizes those), then prompt chunks of running and waiting
        sequences. With a step-time budget and decode rows in the step, a prompt chunk is the
        largest the cost model predicts to keep the step under ``max_step_ms``, at least
        ``STRETCH_MIN`` x the decode rows' own time and at most ``STRETCH_MAX`` x their time in the
        prompt's first chunk step, never under ``STRETCH_FLOOR`` x their time (at least ``min_chunk``
        tokens for the step's first chunk, so a prompt always advances, except in a step the cost
        model asks to hold the decode rows alone: it re-measures them every few steps, see
        ``StepCost.wants_decode_sample``); without decode rows (nobody is waiting for a token) a
        prompt gets the whole token budget."""
        if self.held:
            self._release_held()
        step = _Step(self.max_num_batched_tokens)
        decoding = [s for s in self.running if not self.prefilling(s)]
        prefilling = [s for s in self.running if self.prefilling(s)]
        for seq in decoding:
            if step.tokens <= 0:
                break
            if seq.status is SeqStatus.RUNNING:  # (not preempted for an earlier one's blocks)
                self._schedule(step, seq, min(self.tokens_wanted(seq), step.tokens), prefill=False)
        if (step.decodes and (prefilling or self.waiting) and self.cost is not None
                and math.isfinite(self.max_step_ms)):
            step.sample = self.cost.wants_decode_sample()
        for seq in prefilling:
            if step.tokens <= 0:
                break
            if seq.status is SeqStatus.RUNNING:
                want = self._chunk(step, seq, min(self.tokens_wanted(seq), step.tokens))
                if want == 0:
                    break
                self._schedule(step, seq, want, prefill=True)
        while self.waiting and step.tokens > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._match_prefix(seq)
            want = min(self.tokens_wanted(seq), step.tokens)
            if self.prefilling(seq):
                want = self._chunk(step, seq, want)
            if want == 0 or not self.blocks.can_grow(seq, seq.num_cached + want):
                self._release(seq)  # the hits go back to the cache; looked up again next step
                break
            self.waiting.popleft()
            if hit is not None:
                self.blocks.stats.observe(len(seq.token_ids), hit, recompute=seq.num_preemptions > 0)
                if seq.num_preemptions == 0:
                    seq.num_prefix_hit_tokens = hit
            self.blocks.grow(seq, seq.num_cached + want)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            step.add(seq, want, self.prefilling(seq))
        return step.out

    def _chunk(self, step: _Step, seq: Sequence, want: int) -> int:
        """Tokens of ``seq``'s prompt this step: ``want`` without a time budget or with no decode row
        in the step, else the largest chunk (any number of tokens: a chunk may end mid-block) the
        cost model fits under the step's limit (binary search: the predicted time grows with the
        chunk)."""
        if self.cost is None or not math.isfinite(self.max_step_ms) or not step.decodes or want <= 0:
            return want
        if step.sample:
            return 0
        cost = self.cost
        last = self._last_chunk.get(seq.seq_id)
        if last is not None:  # at most doubles: a fit from one or two chunk steps can miss the slope of a
            want = min(want, CHUNK_GROWTH * last + 1)  # prompt row's cost (seen: 24 then 142 tokens, 22x ITL)
        decode_ms = cost.decode_ms(step.decode_rows)
        arrival_ms = self._arrival_ms.setdefault(seq.seq_id, decode_ms)
        # max_step_ms, but at least STRETCH_MIN x the decode rows' own time now (a busy machine, many
        # streams: the prompt keeps most of each step, so its TTFT stays <= 1.5x idle) and at most
        # STRETCH_MAX x their time when this prompt's first chunk was fed (the streams' largest gap
        # stays <= 6x their inter-token latency before it arrived, though their own growing context
        # makes each decode step dearer while it is fed); and never under STRETCH_FLOOR x their time
        # now (a machine that gets busier mid-prompt, streams whose context grows a lot: the prompt
        # still gets 1 - 1 / STRETCH_FLOOR of each step). The arithmetic is at STRETCH_MIN in
        # engine/step_cost.py
        limit = max(min(max(self.max_step_ms, STRETCH_MIN * decode_ms), STRETCH_MAX * arrival_ms),
                    STRETCH_FLOOR * decode_ms)

        def fits(n: int) -> bool:
            return cost.predict_ms([*step.rows, Rows.prefill(n, seq.num_cached)]) <= limit

        floor = 0 if step.prefills else min(self.min_chunk, want)
        if fits(want):
            lo = want
        else:
            lo, hi = floor, want  # fits(lo) or lo is the floor; not fits(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if fits(mid):
                    lo = mid
                else:
                    hi = mid
        if lo:
            self._last_chunk[seq.seq_id] = lo
        return lo

    def _schedule(self, step: _Step, seq: Sequence, want: int, prefill: bool) -> None:
        """Reserve blocks for ``want`` more tokens of running ``seq``, preempting the most recently
        admitted sequence not yet in this step while they do not fit (``seq`` itself, last)."""
        while not self.blocks.can_grow(seq, seq.num_cached + want):
            victim = next((s for s in reversed(self.running) if s is not seq and s.seq_id not in step.ids), None)
            if victim is None:
                self._preempt(seq)  # not even alone: wait for blocks
                return
            self._preempt(victim)
        self.blocks.grow(seq, seq.num_cached + want)
        step.add(seq, want, prefill)

    def _match_prefix(self, seq: Sequence) -> int | None:
        """Reuse cached blocks of ``seq``'s prefix; None when it does not look up. A request that
        asked for prompt logprobs computes its whole prompt: a cached block has no logits."""
        if not self.blocks.enable_caching or seq.params.prompt_logprobs is not None:
            return None
        return self.blocks.match_prefix(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_cached = 0

    def _preempt(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.prompt_logprobs.clear()  # recomputed with the prompt's KV
        seq.num_preemptions += 1
        self._arrival_ms.pop(seq.seq_id, None)  # its recompute is a new arrival beside other streams
        seq.status = SeqStatus.WAITING
        self.on_preempt(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove ``seq`` wherever it is and free its blocks (idempotent)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.held = [(s, lead) for s, lead in self.held if s is not seq]
        self.blocks.free(seq)
        self._last_chunk.pop(seq.seq_id, None)
        self._arrival_ms.pop(seq.seq_id, None)
        if self.on_finish is not None and seq.status is not SeqStatus.FINISHED:
            self.on_finish(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
