"""Turns a batch of proposals into one model forward and hands back the requested logits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ratchetlm.decoding.base import Proposal
from ratchetlm.engine.config import KV_CACHE_DTYPES, EngineConfig
from ratchetlm.engine.layer_groups import GroupedBlocks, grouped_cache
from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.prefault import Prefault
from ratchetlm.kv.sink import KVSink, NullSink, StepSink
from ratchetlm.kv.staging import StagingBuffer, commit_proposal
from ratchetlm.layers.attention import build_attention_batch
from ratchetlm.layers.mapped_pages import trim_heap
from ratchetlm.runners import StepResult, layout_of
from ratchetlm.sequence import Sequence

FEW_ROWS = 64  # a step of at most this many rows packs its inputs into one tensor (execute)
TRIM_ROWS = 256  # a forward over this many new rows hands its freed activations back to the OS after it


def _on(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t.to(dev)`` without the call where it is there already (a step's every small op costs)."""
    return t if t.device == dev else t.to(dev)


@dataclass
class ForwardPlan:
    """One forward's inputs as decided from the block tables and proposals (CPU tensors): all that
    a tensor-parallel worker needs to run the same forward on its shard (parallel/runner.py)."""

    ids: torch.Tensor  # [T] int64 token ids, packed over sequences
    positions: torch.Tensor  # [T] int64
    new_lens: list[int]  # tokens per sequence
    context_slots: list[torch.Tensor]  # per sequence [(G,) context] int64 slots of its committed context
    ctx_starts: list[int]  # per sequence position of its first context row
    masks: list[torch.Tensor | None]  # per sequence [n, n] bool, None = causal
    slot_mapping: torch.Tensor  # [(G,) T] int64 slots (a row per slot group), -1 = not written
    stage_index: torch.Tensor | None  # [T] int64 staging rows, -1 = not staged; None = nothing staged
    logit_rows: list[int]  # packed rows whose logits are wanted
    num_layers: int | None = None  # fewer than all: layer-skip self-draft
    write: bool = True  # False: write nothing (draft forwards)


def build_runner(cfg: EngineConfig, model: Any, model_config: Any, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, cache_key: Mapping[str, str] | None = None, parallel: Any = None) -> Any:
    """The runner of ``model``'s cache layout. A model family with a layout of its own registered its
    runner factory (``runners.register_layout``: DeepSeek-V4, which opts out of prefix caching); the
    default is the llama family's paged per-token K/V: ``kv_cache_bytes`` (or ``kv_cache_blocks``,
    default ~1 GiB, at least one ``max_model_len`` sequence) of ``block_size``-token blocks,
    prefix-cached under ``cache_key`` when ``enable_prefix_caching``. Under tensor parallelism
    (``parallel``: rank 0's group, parallel/group.py) the budget is per rank and holds this rank's KV
    heads, and the group builds the runner (``parallel.make_runner``), which mirrors itself on the
    workers. A model that mixes sliding-window and global layers gets a pool per kind (engine/layer_groups.py)."""
    make = layout_of(model)
    if make is not None:
        if cfg.kv_cache_dtype != "auto" and KV_CACHE_DTYPES[cfg.kv_cache_dtype] != dtype:
            raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r} is not supported by {type(model).__name__}'s "
                             "cache layout (its cache holds the run dtype: use kv_cache_dtype='auto')")
        return make(cfg, model, dtype, device, max_model_len)
    # from here on dtype is the cache's element type
    run_dtype, dtype = dtype, cfg.kv_dtype(dtype, getattr(model, "numerics", cfg.numerics))
    model.set_context_len(max_model_len)
    kv_heads = model.tp.nkv  # this rank's KV heads (all of them without tensor parallelism)
    local = [i for i in range(model_config.num_layers) if model_config.layer_window(i) is not None]
    blocks: BlockManager | GroupedBlocks
    if local and len(local) < model_config.num_layers:
        cache, blocks = grouped_cache(cfg, model_config, kv_heads, dtype, device, max_model_len, local, cache_key)
    else:
        bytes_per_token = (2 * model_config.num_layers * kv_heads * model_config.head_dim
                           * torch.tensor([], dtype=dtype).element_size())
        block_bytes = bytes_per_token * cfg.block_size
        num_blocks = cfg.kv_cache_blocks or max(-(-max_model_len // cfg.block_size) + 1,
                                                (cfg.kv_cache_bytes or 1 << 30) // block_bytes)
        if cfg.kv_cache_bytes is not None and cfg.kv_cache_bytes < block_bytes:
            raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} is less than one KV block ({block_bytes} bytes)")
        cache = KVCache(model_config.num_layers, num_blocks, cfg.block_size, kv_heads, model_config.head_dim, dtype,
                        device)
        # every layer slides (Mistral, Phi-3): blocks behind the widest window are released as a sequence
        # moves on, so it holds ~window + one step of tokens however long it grows
        blocks = BlockManager(num_blocks, cfg.block_size, enable_caching=cfg.enable_prefix_caching,
                              cache_key=cache_key, window=model_config.max_window)
    args = (model, cache, blocks, device, cfg.staging_capacity, max_model_len)
    if parallel is not None:
        return parallel.make_runner(*args, step_tokens=cfg.max_num_batched_tokens, dtype=run_dtype)
    return ModelRunner(*args, step_tokens=cfg.max_num_batched_tokens, dtype=run_dtype, prefault=cfg.kv_prefault)


class ModelRunner:
    """The llama family's runner: paged per-token K/V (:class:`KVCache` + :class:`BlockManager`)."""

    # model: models/llama.py's LlamaModel (not named here: the engine imports no model package)
    def __init__(self, model: Any, cache: KVCache, blocks: BlockManager | GroupedBlocks, device: torch.device,
                 staging_capacity: int = 1024, max_model_len: int | None = None, step_tokens: int = 2048,
                 dtype: torch.dtype | None = None, prefault: bool = False) -> None:
        self.model = model
        self.dtype = dtype or cache.dtype  # the run's activations (the cache may hold K/V narrower)
        self.step_tokens = step_tokens  # most tokens one step feeds a sequence (max_num_batched_tokens)
        self.cache = cache
        self.blocks = blocks
        self.device = device
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.staging = StagingBuffer(cache, staging_capacity)
        # one slot group (and a plain BlockManager): a step's few rows get their slots as a list (execute)
        self._one_group = len(cache.slot_groups) == 1
        # CPU pools: each slot group's pages backed ahead of its blocks in use (kv/prefault.py), with the block
        # manager that hands those blocks out
        managers = blocks.groups if isinstance(blocks, GroupedBlocks) else [blocks]
        self.prefault = [(Prefault([cache.stacked[p] for p in cache.stacked if cache.group[p] == g]), m)
                         for g, m in zip(cache.slot_groups, managers, strict=True)] \
            if prefault and cache.device.type == "cpu" else []
        self.num_forwards = 0
        # Final hidden states (after the last norm) of the last forward, per sequence
        # [len(proposal.token_ids), hidden]: the features a trained draft head (EAGLE) reads.
        self.last_hidden: list[torch.Tensor] = []

    def fits(self, num_tokens: int) -> str | None:
        """Why a sequence of ``num_tokens`` tokens can never fit this cache, or None (a sliding-window
        pool holds the window, one step's tokens and a partial block at once)."""
        return self.blocks.fits(num_tokens, self.step_tokens)

    def check_room(self, seq: Sequence, num_tokens: int) -> None:
        assert num_tokens <= len(seq.block_table) * self.blocks.block_size, "proposal beyond its blocks"

    def begin_step(self) -> None:
        """A new engine step starts (see :meth:`discard_step`)."""
        return None

    def discard_step(self) -> None:
        """The step raised and will be re-run: nothing to undo here (direct rows sit at
        slots past ``num_cached``, which the re-run rewrites with the same values; staged rows
        are dropped by the next forward)."""
        return None

    def context_slots(self, seq: Sequence) -> torch.Tensor:  # [(G,) num_cached - context_start] int64
        """Slots of the committed context ``seq`` still holds: positions ``[context_start, num_cached)``
        (per slot group; -1 where the local layers' pool released rows their window no longer reaches)."""
        return self.blocks.slots(seq, self.blocks.context_start(seq), seq.num_cached, released=True)

    def _no_slots(self, n: int) -> torch.Tensor:  # [(G,) n] int64, all -1
        """Slots of ``n`` tokens written nowhere: a row per slot group when local layers have their own."""
        g = len(self.cache.slot_groups)
        return torch.full((n,) if g == 1 else (g, n), -1, dtype=torch.long)

    def context_starts(self, seqs: list[Sequence]) -> list[int]:
        """Per sequence, the position of its first held context row (> 0 once a sliding-window
        model released blocks no query can reach)."""
        return [self.blocks.context_start(s) for s in seqs]

    def execute(self, seqs: list[Sequence], proposals: list[Proposal], num_layers: int | None = None) -> StepResult:
        """One forward over all proposals. Direct rows are written to slots ``num_cached + i``;
        staged rows go to the staging buffer at ``stage_base[i] + row``. A staged proposal that
        does not fit the buffer's capacity is computed without writing anything (``stage_base``
        -1, one ``fallback_overflow`` for the forward): its commit falls back to recompute."""
        assert len(seqs) == len(proposals) and seqs
        for pf, m in self.prefault:  # (two int comparisons a step once caught up)
            pf.ahead(m.high_water * m.block_size)
        # a step of few rows in one slot group (decode, verify): every row's slot as a list, and ids, positions,
        # slots and staging rows one tensor (four tensors cost ~0.1 ms after a forward); else slot tensors
        blocks = self.blocks
        one = blocks if isinstance(blocks, BlockManager) and self._one_group \
            and sum(len(p.token_ids) for p in proposals) <= FEW_ROWS else None
        slot_list: list[int] = []
        ids: list[int] = []
        pos: list[int] = []
        slot_parts: list[torch.Tensor] = []
        stage_index: list[int] = []  # per row its staging row, -1 = written directly
        stage_base: list[int] = []
        rows: list[int] = []
        n_staged = 0
        overflow = False
        for seq, p in zip(seqs, proposals, strict=True):
            n = len(p.token_ids)
            rows += [len(ids) + r for r in p.logit_rows]
            ids += p.token_ids
            pos += p.positions
            if p.direct_write:
                if one is not None:  # (check_room asserted the rows are inside the table)
                    slot_list += one.slot_list(seq, range(seq.num_cached, seq.num_cached + n))
                else:
                    slot_parts.append(self.blocks.slots(seq, seq.num_cached, seq.num_cached + n))
                stage_index += [-1] * n
                stage_base.append(-1)
            else:
                fits = n_staged + n <= self.staging.capacity
                overflow |= not fits
                # a staged row's slot is its position's: where it goes if a commit names it
                if one is not None:
                    slot_list += one.slot_list(seq, p.positions) if fits else [-1] * n
                else:
                    slot_parts.append(self.blocks.position_slots(seq, p.positions) if fits else self._no_slots(n))
                stage_index += range(n_staged, n_staged + n) if fits else [-1] * n
                stage_base.append(n_staged if fits else -1)
                n_staged += n if fits else 0
        if overflow:
            self.staging.metrics.fallback_overflow += 1
        staged = n_staged or overflow
        if one is not None:  # [4 or 3, T]: ids, positions, slots (and staging rows), each a row of one tensor
            packed = torch.tensor([ids, pos, slot_list, stage_index] if staged else [ids, pos, slot_list],
                                  dtype=torch.long)
            tok, where, slot_mapping = packed[0], packed[1], packed[2]
            stage = packed[3] if staged else None
        else:
            tok, where = torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long)
            slot_mapping = slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts, dim=-1)
            stage = torch.tensor(stage_index, dtype=torch.long) if staged else None
        plan = ForwardPlan(tok, where, [len(p.token_ids) for p in proposals], [self.context_slots(s) for s in seqs],
                           self.context_starts(seqs), [p.mask for p in proposals], slot_mapping, stage, rows,
                           num_layers)
        hidden, all_logits = self.forward(plan)
        self.num_forwards += 1
        if len(proposals) == 1:  # (one sequence: the tensors as they are, no split)
            self.last_hidden = [hidden]
            return StepResult(logits=[all_logits], stage_base=stage_base)
        self.last_hidden = list(hidden.split(plan.new_lens))
        return StepResult(logits=list(all_logits.split([len(p.logit_rows) for p in proposals])), stage_base=stage_base)

    def draft_forward(self, seqs: list[Sequence], tokens: list[list[int]], positions: list[list[int]],
                      masks: list[torch.Tensor | None], rows: list[list[int]], num_layers: int) -> list[torch.Tensor]:
        """A write-free forward of the first ``num_layers`` layers on top of each sequence's committed
        context (the layer-skip self-draft): per sequence the logits ``[len(rows_i), vocab]``."""
        packed, o = [], 0
        for tt, rr in zip(tokens, rows, strict=True):
            packed += [o + r for r in rr]
            o += len(tt)
        plan = ForwardPlan(torch.tensor([t for tt in tokens for t in tt], dtype=torch.long),
                           torch.tensor([p for pp in positions for p in pp], dtype=torch.long),
                           [len(t) for t in tokens], [self.context_slots(s) for s in seqs], self.context_starts(seqs),
                           masks, self._no_slots(o), None, packed, num_layers, write=False)
        _, logits = self.forward(plan)
        return list(logits.split([len(r) for r in rows]))

    @torch.inference_mode()
    def forward(self, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``plan``: final hidden states ``[T, hidden]`` and the wanted rows' logits ``[R, vocab]`` (CPU)."""
        dev = self.device
        sink: KVSink = NullSink()
        if plan.write:
            stage = None if plan.stage_index is None else _on(plan.stage_index, dev)
            sink = StepSink(self.cache, self.cache.by_group(_on(plan.slot_mapping, dev)), self.staging, stage)
        positions = _on(plan.positions, dev)
        batch = build_attention_batch(positions, plan.new_lens, plan.context_slots, plan.masks, sink, self.cache,
                                      dtype=self.dtype, ctx_starts=plan.ctx_starts)
        hidden = self.model(_on(plan.ids, dev), batch, num_layers=plan.num_layers)
        r = plan.logit_rows
        if r and r[-1] - r[0] == len(r) - 1 and r == list(range(r[0], r[-1] + 1)):  # consecutive rows: a view
            wanted = hidden[r[0] : r[-1] + 1]
        else:
            wanted = hidden[torch.tensor(r, dtype=torch.long, device=dev)]
        logits = _on(self.model.logits(wanted), torch.device("cpu"))
        if len(plan.ids) >= TRIM_ROWS and dev.type == "cpu":
            trim_heap()  # its freed activations back to the OS, not kept in the heap (layers/mapped_pages.py)
        return hidden, logits

    def commit_staged(self, seq: Sequence, stage_base: int, kv_rows: list[int], num_rows: int) -> bool:
        """Copy the accepted staged rows (of a proposal of ``num_rows`` rows) to their slots — the
        sequence's next ones, ``num_cached + i`` — all layers at once. False when the proposal was
        not staged (overflow, abandoned staging) or the all-or-nothing commit failed (the cache is
        then untouched): the caller then commits no K/V and the next step recomputes it."""
        return commit_proposal(self.staging, stage_base, kv_rows, num_rows, commit=self.commit_rows)

    def commit_rows(self, rows: torch.Tensor | list[int]) -> bool:
        """Copy staging ``rows`` ([n] int64, or a list: taken as is, a tensor and back cost ~0.05 ms after a
        forward) to the slots their forward gave them, all layers; False if it failed (the cache is then
        untouched)."""
        return self.staging.try_commit(rows if isinstance(rows, list) else rows.to(self.device))
