"""Continuous batching: which sequences run this step and how many tentative tokens each may use."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.sequence import SeqStatus, Sequence


class Scheduler:
    """Running sequences are served first, in arrival order; waiting ones are admitted while
    ``max_num_seqs`` and the token budget allow. On admission a sequence first takes the cached
    blocks its tokens start with (prefix caching), so it computes only the rest. When KV blocks
    run out, the most recently admitted running sequence is preempted by recompute (references
    released, ``num_cached = 0``) and goes back to the front of the queue, where it usually
    re-hits its own committed blocks."""

    def __init__(
        self,
        blocks: BlockManager,
        tokens_wanted: Callable[[Sequence], int],
        on_preempt: Callable[[Sequence], None],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_finish: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.blocks = blocks
        self.tokens_wanted = tokens_wanted
        self.on_preempt = on_preempt
        self.on_finish = on_finish
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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

    def schedule(self) -> list[tuple[Sequence, int]]:
        if self.held:
            self._release_held()
        budget = self.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            want = min(self.tokens_wanted(seq), budget)
            while not self.blocks.can_grow(seq, seq.num_cached + want) and self.running[-1] is not seq:
                self._preempt(self.running.pop())
            if not self.blocks.can_grow(seq, seq.num_cached + want):
                self._preempt(self.running.pop(i))  # not even alone: wait for blocks
                continue
            self.blocks.grow(seq, seq.num_cached + want)
            out.append((seq, want))
            budget -= want
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._match_prefix(seq)
            want = min(self.tokens_wanted(seq), budget)
            if not self.blocks.can_grow(seq, seq.num_cached + want):
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
            out.append((seq, want))
            budget -= want
        return out

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
        if self.on_finish is not None and seq.status is not SeqStatus.FINISHED:
            self.on_finish(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
