"""``DeepseekV4Engine``: the surface of ``ratchetlm.engine.llm_engine.LLMEngine`` that
``LLM`` drives (``add_request`` / ``step`` / ``abort`` / ``release`` / ``is_stop_token`` /
``has_unfinished`` / ``seqs``), backed by :class:`DeepseekV4Runner`.

V4's cache (sliding ring + compressed KV + compressor state) does not fit the engine's
per-token paged K/V cache, so V4 gets its own step loop: each step prefills at most one
waiting request (emitting its first token) and runs one batched decode call that commits
exactly one token for every running request. Speculative strategies are not supported.

No prefix caching (an explicit opt-out, docs/deepseek_v4.md): the sliding ring and the compressor
state are per-request running state, not per-token blocks a name could identify, so every
request prefills its whole prompt and reports ``num_prefix_hit_tokens = 0``; ``cache_salt`` is
accepted for the common surface and has nothing to isolate.
"""

from __future__ import annotations

import itertools
from collections import deque
from pathlib import Path
from typing import Any

import torch

from ratchetlm.engine.llm_engine import StepOutput
from ratchetlm.engine.sequence import SeqStatus, Sequence
from ratchetlm.layers.logits_processors import ControlsFactory
from ratchetlm.layers.sampler import sample, target_logits
from ratchetlm.models.deepseek_v4.loader import load_deepseek_v4
from ratchetlm.models.deepseek_v4.runner import DeepseekV4Runner
from ratchetlm.sampling_params import SamplingParams


class DeepseekV4Engine:
    def __init__(self, model_path: str | Path, max_num_seqs: int = 4, dtype: torch.dtype | None = None,
                 seed: int = 0, max_model_len: int | None = None, tokenizer: Any = None) -> None:
        self.model = load_deepseek_v4(model_path, dtype=dtype)
        self.config = self.model.config
        self.controls = ControlsFactory(tokenizer, self.config.vocab_size, tuple(self.config.eos_token_ids))
        self.runner = DeepseekV4Runner(self.model, max_seqs=max_num_seqs)
        self.max_model_len = min(max_model_len or self.runner.cap.max_seq_len, self.runner.cap.max_seq_len)
        self.max_num_seqs = max_num_seqs
        self.seqs: dict[int, Sequence] = {}
        self.waiting: deque[int] = deque()
        self.running: list[int] = []
        self._next_token: dict[int, int] = {}  # sampled, not yet fed to a decode call
        self._ids = itertools.count()
        self.generator = torch.Generator().manual_seed(seed)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None) -> int:
        vocab = self.config.vocab_size
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is required")
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len}")
        eos = () if params.ignore_eos else self.config.eos_token_ids
        controls = self.controls.build(params, prompt_ids, eos)
        sid = next(self._ids)
        gen = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        self.seqs[sid] = Sequence(sid, list(prompt_ids), len(prompt_ids), params, eos_token_ids=eos, generator=gen,
                                  controls=controls)
        self.waiting.append(sid)
        return sid

    def abort(self, seq_id: int, reason: str = "abort") -> None:
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, reason)

    def release(self, seq_id: int) -> Sequence | None:
        return self.seqs.pop(seq_id, None)

    def is_stop_token(self, seq_id: int, token: int) -> bool:
        seq = self.seqs[seq_id]
        return token in seq.eos_token_ids or token in seq.params.stop_token_ids

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if seq.seq_id in self.waiting:
            self.waiting.remove(seq.seq_id)
        if seq.seq_id in self.running:
            self.running.remove(seq.seq_id)
            self.runner.release(seq.seq_id)
        self._next_token.pop(seq.seq_id, None)

    def _emit(self, seq: Sequence, logits: torch.Tensor) -> StepOutput:
        tok = int(sample(target_logits(logits[None].float(), seq.controls), seq.params, seq.generator)[0])
        seq.token_ids.append(tok)
        seq.num_cached = len(seq.token_ids) - 1  # every token but the newest is in the cache
        reason = None
        if seq.controls is not None:
            seq.controls.accept([tok])
        if tok in seq.eos_token_ids or tok in seq.params.stop_token_ids or (seq.controls is not None
                                                                             and seq.controls.done):
            reason = "stop"
        elif seq.num_output_tokens >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = "length"
        if reason:
            self._finish(seq, reason)
        else:
            self._next_token[seq.seq_id] = tok
        return StepOutput(seq.seq_id, [tok], seq.is_finished, seq.finish_reason)

    def step(self) -> list[StepOutput]:
        """Decode one token for every running request, then admit one waiting request."""
        outs: list[StepOutput] = []
        if self.running:
            batch = {sid: self._next_token[sid] for sid in self.running}
            for sid, logits in self.runner.decode(batch).items():
                outs.append(self._emit(self.seqs[sid], logits))
        if self.waiting and len(self.running) < self.max_num_seqs:
            sid = self.waiting.popleft()
            seq = self.seqs[sid]
            logits = self.runner.prefill(sid, seq.token_ids)
            seq.status = SeqStatus.RUNNING
            self.running.append(sid)
            outs.append(self._emit(seq, logits))
        return outs
