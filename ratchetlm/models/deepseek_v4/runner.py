"""Per-sequence V4 serving loop: prefill, commit-exact decode calls, the 512-step driver
and closed-loop generation.

:class:`DeepseekV4Runner` is the adapter an engine drives: ``prefill(seq, ids) -> logits``,
``decode({seq: token}) -> {seq: logits}`` (one committed token per sequence per call,
sequences at any mix of positions), ``release(seq)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ratchetlm.models.deepseek_v4.cache import DeepseekV4PagedCache
from ratchetlm.models.deepseek_v4.decode import decode_step
from ratchetlm.models.deepseek_v4.model import DeepseekV4ForCausalLM
from ratchetlm.models.deepseek_v4.paging import DecodeCapacity, DecodeMetadata, lower_decode_step
from ratchetlm.models.deepseek_v4.reference import LayerTrace, reference_forward

Sampler = Callable[[torch.Tensor], int]  # logits [vocab] -> token id


def greedy(logits: torch.Tensor) -> int:
    return int(logits.argmax())


class DeepseekV4Runner:
    """Owns the paged cache of up to ``max_seqs`` sequences of one model."""

    def __init__(self, model: DeepseekV4ForCausalLM, max_seqs: int = 4, cap: DecodeCapacity | None = None,
                 shuffle_seed: int | None = None) -> None:
        self.model = model
        self.cap = cap or DecodeCapacity.for_model(model.config)
        if self.cap.max_seq_len + self.cap.decode_seq - 1 > model.main_rope.max_positions:
            raise ValueError("decode capacity (plus the placeholder row) exceeds the model's RoPE table")
        dtype = model.model.embed_tokens.weight.dtype
        self.cache = DeepseekV4PagedCache(model.config, self.cap, max_seqs, dtype, shuffle_seed=shuffle_seed)
        self.lengths: dict[int, int] = {}  # committed tokens per sequence
        self.last_meta: DecodeMetadata | None = None

    def prefill(self, seq: int, prompt_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Caches the prompt and returns the logits ``[vocab]`` of its last token."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)
        if ids.numel() == 0 or ids.numel() >= self.cap.max_seq_len:
            raise ValueError(f"prompt length {ids.numel()} outside [1, {self.cap.max_seq_len})")
        logits, traces = reference_forward(self.model, ids, logits_for=slice(-1, None))
        self.restore(seq, traces)
        return logits[0]

    def restore(self, seq: int, traces: list[LayerTrace]) -> None:
        """Admits ``seq`` with the cache state a prompt with these traces leaves behind
        (``traces`` may be :func:`prefix_traces` of a longer prompt's)."""
        self.cache.admit(seq)
        self.cache.write_prefill(seq, traces)
        self.lengths[seq] = traces[0].kv.shape[0]

    def decode(self, tokens: dict[int, int]) -> dict[int, torch.Tensor]:
        """Runs one decode call committing ``tokens[seq]`` at each sequence's next position.

        Returns next-token logits ``[vocab]`` per sequence."""
        seqs = list(tokens)
        for s in seqs:
            self.cache.ensure(s, self.lengths[s])
        committed = torch.tensor([self.lengths[s] for s in seqs], dtype=torch.long)
        meta = lower_decode_step(committed, self.cache.tables(seqs), self.cap)
        ids = torch.tensor([[tokens[s]] * self.cap.decode_seq for s in seqs], dtype=torch.long)
        logits = decode_step(self.model, self.cache, meta, ids)
        for s in seqs:
            self.lengths[s] += 1
        self.last_meta = meta
        return {s: logits[i, 0] for i, s in enumerate(seqs)}

    def release(self, seq: int) -> None:
        self.cache.release(seq)
        del self.lengths[seq]


@dataclass
class DriverLog:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # seq -> number of its tokens whose ring slot mapping was >= 0 (i.e. committed) per call
    commits_per_call: list[dict[int, int]] = field(default_factory=list)


def run_decode_steps(runner: DeepseekV4Runner, first_tokens: dict[int, int], steps: int = 512,
                     sampler: Sampler = greedy, forced: dict[int, list[int]] | None = None,
                     keep_logits_at: set[int] | None = None) -> DriverLog:
    """The host loop of the seed: ``steps`` separate decode calls carrying the cache across
    calls. Each call feeds one token per sequence; the next input is sampled from the
    logits, or taken from ``forced[seq][step]`` (teacher forcing, used by oracle tests)."""
    log = DriverLog(tokens={s: [] for s in first_tokens}, logits={s: [] for s in first_tokens})
    current = dict(first_tokens)
    for step in range(steps):
        out = runner.decode(current)
        meta = runner.last_meta
        assert meta is not None
        log.commits_per_call.append({s: int((meta.ori_slot_mapping[i] >= 0).sum()) for i, s in enumerate(current)})
        for s, lg in out.items():
            if keep_logits_at is None or step in keep_logits_at:
                log.logits[s].append(lg)
            nxt = forced[s][step] if forced is not None else sampler(lg)
            log.tokens[s].append(nxt)
            current[s] = nxt
    return log


def generate(runner: DeepseekV4Runner, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler = greedy,
             eos_ids: tuple[int, ...] = (), seq: int = 0) -> Iterator[int]:
    """Closed-loop generation: prefill, then final norm -> lm_head -> sample -> next input,
    one committed token per decode call. Yields tokens as they are produced."""
    logits = runner.prefill(seq, prompt_ids)
    try:
        for i in range(max_new_tokens):
            token = sampler(logits)
            yield token
            if token in eos_ids or i == max_new_tokens - 1:
                return
            if runner.lengths[seq] >= runner.cap.max_seq_len:
                return  # out of position capacity
            logits = runner.decode({seq: token})[seq]
    finally:
        runner.release(seq)
