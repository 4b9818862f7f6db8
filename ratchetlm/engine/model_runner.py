"""Turns a batch of proposals into one model forward and hands back the requested logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ratchetlm.decoding.base import Proposal
from ratchetlm.engine.block_manager import BlockManager
from ratchetlm.engine.sequence import Sequence
from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.staging import StagingBuffer, StagingCommitError, StepSink
from ratchetlm.layers.attention import build_attention_batch
from ratchetlm.models.llama import LlamaModel


@dataclass
class StepResult:
    logits: list[torch.Tensor]  # per sequence [len(logit_rows), vocab] fp32
    stage_base: list[int]  # per sequence: staging row of its proposal row 0 (-1 if direct)


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, blocks: BlockManager, device: torch.device,
                 staging_capacity: int = 1024) -> None:
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.device = device
        self.staging = StagingBuffer(cache, staging_capacity)
        self.num_forwards = 0
        # Final hidden states (after the last norm) of the last forward, per sequence
        # [len(proposal.token_ids), hidden]: the features a trained draft head (EAGLE) reads.
        self.last_hidden: list[torch.Tensor] = []

    def context_slots(self, seq: Sequence) -> torch.Tensor:  # [num_cached] int64
        return self.blocks.slots(seq, 0, seq.num_cached)

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], proposals: list[Proposal], num_layers: int | None = None) -> StepResult:
        """One forward over all proposals. Direct rows are written to slots ``num_cached + i``;
        staged rows go to the staging buffer at ``stage_base[i] + row``. A staged proposal that
        does not fit the buffer's capacity is computed without writing anything (``stage_base``
        -1, one ``fallback_overflow`` for the forward): its commit falls back to recompute."""
        assert len(seqs) == len(proposals) and seqs
        ids: list[int] = []
        pos: list[int] = []
        slot_parts: list[torch.Tensor] = []
        stage_parts: list[torch.Tensor] = []
        stage_base: list[int] = []
        n_staged = 0
        overflow = False
        for seq, p in zip(seqs, proposals, strict=True):
            n = len(p.token_ids)
            ids += p.token_ids
            pos += p.positions
            if p.direct_write:
                slot_parts.append(self.blocks.slots(seq, seq.num_cached, seq.num_cached + n))
                stage_parts.append(torch.full((n,), -1, dtype=torch.long))
                stage_base.append(-1)
            else:
                slot_parts.append(torch.full((n,), -1, dtype=torch.long))
                fits = n_staged + n <= self.staging.capacity
                overflow |= not fits
                stage_parts.append(torch.arange(n_staged, n_staged + n) if fits else torch.full((n,), -1))
                stage_base.append(n_staged if fits else -1)
                n_staged += n if fits else 0
        dev = self.device
        slot_mapping = torch.cat(slot_parts).to(dev)
        stage_index = None
        if n_staged or overflow:
            stage_index = torch.cat(stage_parts).to(dev)
        sink = StepSink(self.cache, slot_mapping, self.staging, stage_index)
        if overflow:
            self.staging.metrics.fallback_overflow += 1
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        batch = build_attention_batch(
            positions,
            [len(p.token_ids) for p in proposals],
            [self.context_slots(s) for s in seqs],
            [p.mask for p in proposals],
            sink,
            self.cache,
            dtype=self.cache.k.dtype,
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev), batch, num_layers=num_layers)
        rows: list[int] = []
        offset = 0
        for p in proposals:
            rows += [offset + r for r in p.logit_rows]
            offset += len(p.token_ids)
        all_logits = self.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)]).cpu()
        self.num_forwards += 1
        self.last_hidden = list(hidden.split([len(p.token_ids) for p in proposals]))
        out, o = [], 0
        for p in proposals:
            out.append(all_logits[o : o + len(p.logit_rows)])
            o += len(p.logit_rows)
        return StepResult(logits=out, stage_base=stage_base)

    def commit_staged(self, seq: Sequence, stage_base: int, kv_rows: list[int], num_rows: int) -> bool:
        """Copy the accepted staged rows (of a proposal of ``num_rows`` rows) to ``seq``'s next
        slots, all layers at once. Returns False when the proposal was not staged (overflow,
        abandoned staging) or the all-or-nothing commit failed (the cache is then untouched):
        the caller then commits no K/V and the next step recomputes it."""
        if stage_base < 0 or not self.staging.usable:
            return False
        rows = torch.tensor([stage_base + r for r in kv_rows], dtype=torch.long, device=self.device)
        slots = self.blocks.slots(seq, seq.num_cached, seq.num_cached + len(kv_rows), self.device)
        try:
            self.staging.commit(rows, slots)
        except StagingCommitError:
            return False
        self.staging.reject(num_rows - len(kv_rows))
        return True
