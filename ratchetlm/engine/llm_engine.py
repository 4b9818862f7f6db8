"""The step loop: schedule → propose → one forward → commit. Emits committed token ids only."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ratchetlm.decoding.base import Commit, DecodeStrategy, Proposal, StrategyContext
from ratchetlm.decoding.registry import create_strategy
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.kv_budget import sized_config
from ratchetlm.engine.model_runner import build_runner
from ratchetlm.engine.scheduler import Scheduler
from ratchetlm.engine.step_cost import MeasuredStepCost, Rows
from ratchetlm.engine.step_probe import probe_prior
from ratchetlm.errors import EngineDeadError
from ratchetlm.layers.logits_processors import ControlsFactory
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.sequence import SeqStatus, Sequence

ProposeFn = Callable[[list[Sequence], list[int]], list[Proposal]]  # (seqs, budgets) -> a proposal per seq


class PromptTooLongError(ValueError):
    """The prompt (plus one generated token) does not fit ``max_model_len`` or the KV cache."""


class QueueFullError(RuntimeError):
    """More waiting requests than ``max_waiting``; retry later."""


@dataclass
class StepOutput:
    """Tokens one request committed in one step (possibly several, possibly none)."""

    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    new_logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # set (with finish_reason "error") when this request failed the step


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _handing_out(proposals: dict[int, Proposal]) -> ProposeFn:
    """Proposes what was already decided per seq_id (a continuation; fault isolation may re-run it)."""
    return lambda seqs, _budgets: [proposals[s.seq_id] for s in seqs]


def _merge(outs: dict[int, StepOutput], o: StepOutput) -> None:
    """Fold a sequence's output of a later forward in the same step into its first one."""
    prev = outs.setdefault(o.seq_id, o)
    if prev is o:
        return
    prev.new_token_ids += o.new_token_ids
    prev.finished, prev.finish_reason, prev.error = o.finished, o.finish_reason, o.error
    if o.new_logprobs is not None:
        prev.new_logprobs = (prev.new_logprobs or []) + o.new_logprobs


class LLMEngine:
    """Owns model, KV cache, scheduler and the decoding strategy. Not thread-safe: one thread
    calls ``add_request``/``step``/``abort`` (the server funnels requests through a queue)."""

    def __init__(self, cfg: EngineConfig, model: Any, model_config: Any, tokenizer: Any = None,
                 parallel: Any = None) -> None:
        """``parallel``: rank 0's :class:`~ratchetlm.parallel.group.TPGroup` when ``model`` is rank 0's
        shard of a tensor-parallel model (``LLM(tensor_parallel_size=N)`` builds both)."""
        tp = getattr(model, "tp", None)
        if tp is not None and tp.size > 1 and parallel is None:
            raise ValueError("this model is one rank of a tensor-parallel group: only the engine that started "
                             "its workers (LLM(tensor_parallel_size=N)) can run it")
        cfg = cfg.with_model_numerics(model)
        self.cfg = cfg
        self.model_config = model_config
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype()
        cfg = self.cfg = sized_config(cfg, model_config, self.dtype)  # gpu_memory_utilization -> KV bytes
        self.max_model_len = min(cfg.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings)
        self.model = model
        # The model's cache layout decides the runner: the llama family's paged per-token K/V,
        # DeepSeek-V4's ring + compressed KV + compressor state. Everything else is shared.
        self.runner = build_runner(cfg, model, model_config, self.dtype, self.device, self.max_model_len,
                                   cache_key=self.kv_identity(), parallel=parallel)
        self.max_model_len = self.runner.max_model_len
        self.cache = self.runner.cache
        self.blocks = self.runner.blocks
        ctx = StrategyContext(runner=self.runner, model_config=model_config, max_model_len=self.max_model_len)
        self.strategy: DecodeStrategy = create_strategy(cfg.decoding, ctx, cfg.decoding_options)
        # the step-time budget: prompt chunks sized by a measured cost model (engine/step_cost.py). The
        # pooling runner schedules no steps, and its write-free forwards run on other threads
        # (engine/pooling.py): a probe's forwards on the engine thread would race them on the runner.
        target = math.inf if cfg.runner == "pooling" else cfg.step_time_target()
        self.step_cost = None if math.isinf(target) else MeasuredStepCost(
            lambda stop: probe_prior(model, model_config, self.device, self.dtype, stop=stop))
        self.scheduler = Scheduler(self.blocks, self.strategy.tokens_wanted, self.strategy.on_preempt,
                                   cfg.max_num_seqs, cfg.max_num_batched_tokens, self.strategy.on_finish,
                                   cost=self.step_cost, max_step_ms=target)
        # tokenizer: for bad_words and structured outputs (grammar compilation); None refuses those
        self.controls = ControlsFactory(tokenizer, model_config.vocab_size, model_config.eos_token_ids,
                                        jump_forward=cfg.jump_forward)
        self.seqs: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        # Unseeded requests share the engine's generator (no process-wide RNG side effects).
        self.generator = torch.Generator().manual_seed(cfg.seed)

    def kv_identity(self) -> dict[str, str]:
        """Everything engine-wide that changes the K/V of a token prefix: the root of every prefix
        cache name (kv/block_hash.py). A feature that changes K/V for all requests (an adapter,
        another numerics mode) adds its part here; one that changes it per request passes
        ``cache_salt`` to :meth:`add_request`."""
        return {"model": str(self.cfg.model or "default"), "architecture": self.model_config.architecture,
                "dtype": str(self.dtype), "gguf_kernels": str(self.cfg.gguf_kernels),
                "numerics": self.cfg.numerics}

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
                    share_prompt_with: int | None = None) -> int:
        """Validate and queue a request; returns its id. Raises ValueError subclasses for bad input.
        ``cache_salt``: the request shares prefix-cache blocks only with requests of the same salt.
        ``share_prompt_with``: the id of a queued request with the same prompt (another choice of the
        same ``n > 1`` request): this one starts once that one's prompt is cached, and takes its
        blocks from the prefix cache instead of computing the prompt again."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.num_samples != 1:
            raise ValueError(f"the engine runs one sequence per request; n={params.n}, best_of={params.best_of} "
                             "are expanded by LLM.generate / the server")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        if len(prompt_ids) == 0:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len} "
                f"(at most {self.max_model_len - 1} prompt tokens, leaving room for one generated token)"
            )
        problem = self.runner.fits(min(len(prompt_ids) + params.max_tokens, self.max_model_len))
        if problem:
            raise PromptTooLongError(f"request (prompt {len(prompt_ids)} + max_tokens {params.max_tokens}) {problem}")
        if len(self.scheduler.waiting) >= self.cfg.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.cfg.max_waiting} requests)")
        self.strategy.check_request(params)
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        controls = self.controls.build(params, prompt_ids, eos)
        sid = next(self._ids)
        gen = self.generator
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed)
        seq = Sequence(sid, list(prompt_ids), len(prompt_ids), params, eos_token_ids=eos, generator=gen,
                       controls=controls, cache_salt=cache_salt)
        self.seqs[sid] = seq
        lead = self.seqs.get(share_prompt_with) if share_prompt_with is not None else None
        share = (lead is not None and not lead.is_finished and getattr(self.blocks, "enable_caching", False)
                 and len(prompt_ids) >= self.blocks.block_size and lead.cache_salt == cache_salt
                 and lead.token_ids[: lead.num_prompt_tokens] == list(prompt_ids))
        self.scheduler.add(seq, after_prompt_of=lead if share else None)
        self.stats.prompt_tokens += len(prompt_ids)
        return sid

    def abort(self, seq_id: int, reason: str = "abort") -> None:
        """Finish a request now (client gone, stop string matched); frees its KV blocks."""
        seq = self.seqs.get(seq_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, reason)

    def release(self, seq_id: int) -> Sequence | None:
        """Forget a finished request (its outputs were consumed)."""
        return self.seqs.pop(seq_id, None)

    def is_stop_token(self, seq_id: int, token: int) -> bool:
        seq = self.seqs[seq_id]
        return token in seq.eos_token_ids or token in seq.params.stop_token_ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def metrics(self) -> dict[str, float]:
        """Aggregate counters for /metrics: the strategy's own, the staging buffer's for a
        strategy that stages (kv/staging.py: stage operations vs unique tokens, committed /
        rejected rows, acceptance, efficiency, bytes avoided, fallbacks by cause), KV bytes written."""
        out = dict(self.strategy.metrics())
        if self.strategy.stages:
            out.update(self.runner.staging.metrics.as_dict())
        out["kv_bytes_written"] = self.cache.bytes_written
        return out

    # ------------------------------------------------------------------ the step

    def step(self) -> list[StepOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        t0 = time.perf_counter()
        seqs, budgets = [s for s, _ in scheduled], [b for _, b in scheduled]
        # each sequence's context and kind as scheduled, for the cost model's observation
        shape = [(s.seq_id, s.num_cached, self.scheduler.prefilling(s)) for s in seqs]
        fed: dict[int, int] = {}  # seq_id -> rows it fed over the step's forwards
        outs: dict[int, StepOutput] = {}
        propose: ProposeFn = self.strategy.propose
        while seqs:  # one forward; the strategy may continue some sequences in the same step (SCV)
            used: dict[int, int] = {}  # seq_id -> tokens its proposal used of the step budget
            for o in self._step_isolated(seqs, budgets, propose, used):
                _merge(outs, o)
            for sid, n in used.items():
                fed[sid] = fed.get(sid, 0) + n
            left = [(s, b - used[s.seq_id]) for s, b in zip(seqs, budgets, strict=True)
                    if s.seq_id in used and not s.is_finished and b > used[s.seq_id]]
            more = self.strategy.continue_step([s for s, _ in left], [b for _, b in left]) if left else []
            cont = {s.seq_id: p for (s, _), p in zip(left, more, strict=True) if p is not None}
            seqs, budgets = [s for s, _ in left if s.seq_id in cont], [b for s, b in left if s.seq_id in cont]
            propose = _handing_out(cont)
        self.stats.steps += 1
        if self.step_cost is not None:
            rows = [(Rows.prefill if pf else Rows.decode)(fed[sid], ctx) for sid, ctx, pf in shape if fed.get(sid)]
            self.step_cost.observe(rows, (time.perf_counter() - t0) * 1000.0)
        return list(outs.values())

    def _step_isolated(self, seqs: list[Sequence], budgets: list[int], propose: ProposeFn,
                       used: dict[int, int]) -> list[StepOutput]:
        """Run one forward for ``seqs``; if it raises, find the request(s) responsible and fail only those.

        Fault isolation: propose, forward and commit change nothing the engine keeps (committed
        tokens, ``num_cached``) until :meth:`_apply`, so a step that raised is discarded (the
        strategy drops what it may have changed, sampling generators are rewound) and re-run on
        each half of the batch, recursively: the request(s) that fail alone get an error output,
        the others commit exactly what they would have (rows are batch-invariant; a seeded
        request draws from its rewound generator). A fault costs ~2·log2(batch) extra forwards.
        ``used`` receives each applied proposal's token count.
        """
        rng = {id(s.generator): (s.generator, s.generator.get_state()) for s in seqs
               if s.generator is not None and not s.params.greedy}
        try:
            commits, proposals, stage_base = self._compute(seqs, budgets, propose)
        except EngineDeadError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the step is isolated below
            if len(seqs) == 1:
                return [self._fail(seqs[0], e)]
            for gen, state in rng.values():
                gen.set_state(state)
            self.runner.discard_step()  # the cache layout's undo (V4: ring rows the step's tokens read)
            for s in seqs:
                self.strategy.on_step_discarded(s)
            mid = len(seqs) // 2
            return (self._step_isolated(seqs[:mid], budgets[:mid], propose, used)
                    + self._step_isolated(seqs[mid:], budgets[mid:], propose, used))
        outs = []
        for s, p, c, base in zip(seqs, proposals, commits, stage_base, strict=True):
            try:
                outs.append(self._apply(s, p, c, base))
                used[s.seq_id] = len(p.token_ids)
            except Exception as e:  # noqa: BLE001 - only this request's state is touched
                outs.append(self._fail(s, e))
        return outs

    def _compute(self, seqs: list[Sequence], budgets: list[int],
                 propose: ProposeFn) -> tuple[list[Commit], list[Proposal], list[int]]:
        self.runner.begin_step()  # (before propose: a fault there leaves the last step's rows as they are)
        proposals = propose(seqs, budgets)
        for s, p, b in zip(seqs, proposals, budgets, strict=True):
            assert len(p.token_ids) <= b, f"strategy proposed {len(p.token_ids)} tokens over budget {b}"
            self.runner.check_room(s, s.num_cached + len(p.token_ids))
        result = self.runner.execute(seqs, proposals)
        return self.strategy.commit(seqs, proposals, result.logits), proposals, result.stage_base

    def _fail(self, seq: Sequence, e: Exception) -> StepOutput:
        """End ``seq`` with finish reason ``error``: its blocks are freed, its output says why."""
        self.scheduler.finish(seq, "error")
        self.stats.extra["failed_requests"] = self.stats.extra.get("failed_requests", 0) + 1
        return StepOutput(seq.seq_id, [], True, "error", error=f"{type(e).__name__}: {e}")

    def _apply(self, seq: Sequence, prop: Proposal, c: Commit, stage_base: int) -> StepOutput:
        if prop.direct_write:
            assert c.kv_rows == list(range(len(prop.token_ids))), "direct-write proposals commit every row"
        else:
            # a staged row lands at its position's slot (kv/sink.py): the rows kept are the next positions
            assert all(prop.positions[r] == seq.num_cached + i for i, r in enumerate(c.kv_rows)), \
                "a commit's K/V rows must be at the sequence's next positions"
        cached_before = seq.num_cached
        if c.prompt_logprobs is not None:
            seq.prompt_logprobs += c.prompt_logprobs
        new: list[int] = []
        reason = None
        for i, tok in enumerate(c.token_ids):
            seq.token_ids.append(tok)
            new.append(tok)
            if c.logprobs is not None:
                seq.logprobs.append(c.logprobs[i])
            if tok in seq.eos_token_ids or tok in seq.params.stop_token_ids:
                reason = "stop"
            elif seq.num_output_tokens >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if seq.controls is not None:
                seq.controls.accept([tok])
                if reason is None and seq.controls.done:
                    reason = "stop"  # the grammar is complete: only EOS could follow
            if reason:
                break  # a stop inside a multi-token commit ends the sequence there
        # Row i holds the K/V of the token at num_cached + i: a commit that ended early keeps no row
        # past its last kept token (those rows are the K/V of tokens that were never committed).
        rows = c.kv_rows[: len(seq.token_ids) - seq.num_cached]
        if not prop.direct_write and not self.runner.commit_staged(seq, stage_base, rows, len(prop.token_ids)):
            # Fallback to the plain path (kv/staging.py): keep the tokens, commit no KV; the next
            # step's direct-write catch-up recomputes it (identical output).
            rows = []
        seq.num_cached += len(rows)
        assert seq.num_cached <= len(seq.token_ids), "committed KV beyond committed tokens"
        self.blocks.cache_full_blocks(seq, cached_before)  # before finish() releases them
        self.stats.generation_tokens += len(new)
        if reason:
            self.scheduler.finish(seq, reason)
        lps = seq.logprobs[-len(new):] if (new and c.logprobs is not None) else None
        return StepOutput(seq.seq_id, new, seq.status is SeqStatus.FINISHED, seq.finish_reason, lps)

