"""DeepSeek-V4 under the one engine: the model runner its cache layout needs.

:class:`DeepseekV4ModelRunner` has the surface of :class:`~ratchetlm.engine.model_runner.ModelRunner`
(``execute`` / ``commit_staged`` / ``blocks`` / ``staging`` / ``last_hidden``), so the engine's
step loop, scheduler, preemption, abort, strategies and server are the same code for V4 as for
the llama family; only the batch differs. Each step lowers the scheduled proposals (the
sequences' block allocations) into :class:`~ratchetlm.models.deepseek_v4.paging.DecodeMetadata`
with the one lowering function and runs :func:`~ratchetlm.models.deepseek_v4.decode.forward_step`:

* proposals of up to ``state_span`` tokens (decode tokens, draft chains) share one ``[B, S]``
  call, ``S = max(decode_seq, longest)``; shorter rows are padded with placeholders (slot -1,
  invisible), the seed's static ``S = 2`` decode shape when ``decode_seq == 2``;
* longer proposals (prefill chunks) run one ``[1, n]`` call each.

Direct-write proposals write through the step's sink; staged ones (a verify chain) stage every
row and :meth:`commit_staged` copies the accepted prefix's rows into the pools all-or-nothing —
the same :class:`~ratchetlm.kv.sink.StepSink` and :class:`~ratchetlm.kv.staging.StagingBuffer` as
the llama family's, over this layout's seven pools.

A ring slot is shared by positions ``W`` apart, so a direct step of ``n > 1`` tokens overwrites
ring rows its own first tokens read. When the engine discards a step that raised (fault
isolation re-runs it), :meth:`discard_step` puts those rows back, so the re-run reads what the
first run read; every other row a step writes is a function of committed tokens alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch

from ratchetlm.decoding.base import Proposal
from ratchetlm.kv.sink import StepSink
from ratchetlm.kv.staging import StagingBuffer, commit_proposal
from ratchetlm.models.deepseek_v4.decode import forward_step, step_slots
from ratchetlm.models.deepseek_v4.layout import DeepseekV4Layout
from ratchetlm.models.deepseek_v4.model import MTP_LAYER, DeepseekV4ForCausalLM
from ratchetlm.models.deepseek_v4.paging import DecodeCapacity, DecodeMetadata, lower_decode_step
from ratchetlm.runners import StepResult, register_layout
from ratchetlm.sequence import Sequence


def check_strategy(decoding: str, options: Mapping[str, Any], span: int) -> None:
    """V4 verifies chains of consecutive tokens (its ring and compressors are positional); a
    strategy that needs trees, non-causal windows or a llama-shaped paged K/V cache is refused
    up front with the reason, not mid-generation."""
    if decoding == "speculative":
        method = options.get("method", "ngram")
        if method not in ("ngram", "mtp"):
            raise ValueError(f"speculative method={method!r} is not supported for DeepSeek-V4 models "
                             "(it drafts from a llama-style paged K/V cache); use 'mtp' or 'ngram'")
        if int(options.get("num_candidates", 1)) != 1:
            raise ValueError("DeepSeek-V4 verifies draft chains only: speculative num_candidates must be 1")
        depth = options.get("depth") or (1 if method == "mtp" else 4)
        if isinstance(depth, int) and depth + 1 > span:
            raise ValueError(f"a DeepSeek-V4 verify step holds at most {span} tokens: speculative depth must be "
                             f"<= {span - 1}, got {depth}")
    elif decoding == "wedlm":
        raise ValueError("decoding='wedlm' is not supported for DeepSeek-V4 models (its windows are not causal "
                         "chains); supported: 'autoregressive', 'speculative' with method 'mtp' or 'ngram'")


class DeepseekV4ModelRunner:
    def __init__(self, model: DeepseekV4ForCausalLM, layout: DeepseekV4Layout, device: torch.device,
                 staging_capacity: int = 1024) -> None:
        self.model = model
        self.layout = layout
        self.cap = layout.cap
        self.blocks = layout.allocator
        self.cache = layout.pools
        self.device = device
        self.max_model_len = layout.max_model_len
        # a verify step (staged chain) holds at most this many tokens: its state rows cover any
        # accepted prefix only within the state span (strategies cap grammar-forced chains by it)
        self.max_chain_tokens = layout.cap.state_span
        self.staging = StagingBuffer(layout.pools, staging_capacity)
        self.num_forwards = 0
        self.last_meta: DecodeMetadata | None = None
        self.last_ring_writes: dict[int, int] = {}  # seq_id -> token rows with a ring slot in the last step
        # (slots, old rows of every ring layer) the last step overwrote that its tokens read
        self._undo: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Final residual streams of the last forward, per sequence ``[len(proposal), hc, hidden]``:
        # the features the MTP module reads (``Proposer.observe``).
        self.last_hidden: list[torch.Tensor] = []

    def fits(self, num_tokens: int) -> str | None:
        """Why a sequence of ``num_tokens`` tokens can never fit this cache, or None."""
        plan = self.layout.plan
        for pool, need in self.layout.growing_blocks(num_tokens).items():
            if self.layout.pool_layers[pool] and need > plan.blocks[pool]:
                return f"needs {need} {pool} blocks but the cache has only {plan.blocks[pool]}"
        return None

    def check_room(self, seq: Sequence, num_tokens: int) -> None:
        assert num_tokens <= self.cap.max_seq_len and self.blocks.mapped(seq.seq_id), "proposal beyond its blocks"

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], proposals: list[Proposal], num_layers: int | None = None) -> StepResult:
        assert num_layers is None, "DeepSeek-V4 has no layer-skip draft forward"
        assert len(seqs) == len(proposals) and seqs
        for s, p in zip(seqs, proposals, strict=True):
            n = len(p.token_ids)
            if p.positions != list(range(s.num_cached, s.num_cached + n)) or not _causal(p.mask):
                raise ValueError("DeepSeek-V4 steps are chains of consecutive tokens after the cached context")
            if not p.direct_write and n > self.cap.state_span:
                raise ValueError(f"a DeepSeek-V4 verify step holds at most {self.cap.state_span} tokens, got {n}")
        self.last_ring_writes = {}
        span = self.cap.state_span
        short = [i for i, p in enumerate(proposals) if len(p.token_ids) <= span]
        groups = ([short] if short else []) + [[i] for i, p in enumerate(proposals) if len(p.token_ids) > span]
        streams: list[torch.Tensor | None] = [None] * len(seqs)
        stage_base = [-1] * len(seqs)
        for group in groups:
            out, bases = self._forward([seqs[i] for i in group], [proposals[i] for i in group])
            for i, st, base in zip(group, out, bases, strict=True):
                streams[i], stage_base[i] = st, base
        hidden = [s for s in streams if s is not None]
        assert len(hidden) == len(seqs)
        rows = torch.cat([h[p.logit_rows] for h, p in zip(hidden, proposals, strict=True)])
        all_logits = self.model.head(rows).cpu()
        self.last_hidden = hidden
        self.num_forwards += 1
        logits, o = [], 0
        for p in proposals:
            logits.append(all_logits[o : o + len(p.logit_rows)])
            o += len(p.logit_rows)
        return StepResult(logits=logits, stage_base=stage_base)

    def _forward(self, seqs: list[Sequence], props: list[Proposal]) -> tuple[list[torch.Tensor], list[int]]:
        """One ``[B, S]`` call -> per sequence its streams ``[n, hc, hidden]`` and staging row base."""
        lens = torch.tensor([len(p.token_ids) for p in props])
        tables = self.layout.tables([s.seq_id for s in seqs])
        meta = lower_decode_step(torch.tensor([s.num_cached for s in seqs]), tables, self.cap, num_tokens=lens)
        B, S = meta.position_ids.shape
        ids = torch.zeros(B, S, dtype=torch.long)
        stage_index = torch.full((B, S), -1, dtype=torch.long)
        bases: list[int] = []
        staged, overflow = 0, False
        slots = step_slots(meta)
        for b, p in enumerate(props):
            n = len(p.token_ids)
            ids[b, :n] = torch.tensor(p.token_ids)
            ids[b, n:] = p.token_ids[-1]  # placeholder rows: any id; nothing of theirs is kept
            if p.direct_write:
                bases.append(-1)
            elif staged + n <= self.staging.capacity:
                stage_index[b, :n] = torch.arange(staged, staged + n)
                bases.append(staged)
                staged += n
            else:  # overflow fallback: computed without writes, recomputed by the next catch-up
                overflow = True
                bases.append(-1)
                for mapping in slots.values():
                    mapping.view(B, S)[b] = -1
        if overflow:
            self.staging.metrics.fallback_overflow += 1
        self._snapshot_ring(slots["ori"].view(B, S), props)
        sink = StepSink(self.layout.pools, slots, self.staging if staged else None,
                        stage_index.flatten() if staged else None)
        out = forward_step(self.model, self.layout.pools, meta, ids.to(self.device), sink, self.cap)
        self.last_meta = meta
        for seq, k in zip(seqs, (meta.ori_slot_mapping >= 0).sum(1).tolist(), strict=True):
            self.last_ring_writes[seq.seq_id] = int(k)
        return [out[b, : len(p.token_ids)] for b, p in enumerate(props)], bases

    def _snapshot_ring(self, ori: torch.Tensor, props: list[Proposal]) -> None:
        """ori: ``[B, S]`` ring slots of the step. Row ``q > start`` of a direct step overwrites
        position ``q - W``, which the step's tokens before ``q`` read: keep the old rows."""
        parts = [ori[b, 1 : len(p.token_ids)] for b, p in enumerate(props) if p.direct_write and len(p.token_ids) > 1]
        if not parts:
            return
        slots = torch.cat(parts)
        slots = slots[slots >= 0].to(self.device)
        if slots.numel():
            self._undo.append((slots, self.layout.pools.stacked["ori"].index_select(1, slots)))

    def begin_step(self) -> None:
        """A new engine step starts: the rows the previous one overwrote are final."""
        self._undo = []

    def discard_step(self) -> None:
        """The engine discarded the step (it raised and will be re-run from the same committed
        state): restore the ring rows its forwards overwrote that its tokens read."""
        for slots, old in reversed(self._undo):
            self.layout.pools.stacked["ori"].index_copy_(1, slots, old)
        self._undo = []

    def commit_staged(self, seq: Sequence, stage_base: int, kv_rows: list[int], num_rows: int) -> bool:
        """Copy the accepted rows (a prefix of the chain of ``num_rows``) into the pools, every
        pool and layer at once (kv/staging.py's one contract). False when the proposal was not
        staged (overflow, abandoned staging) or the all-or-nothing commit failed (the pools are then
        untouched): the caller commits no KV and the next step recomputes it."""
        assert kv_rows == list(range(len(kv_rows))), "a chain commits a prefix of its rows"
        return commit_proposal(self.staging, stage_base, kv_rows, num_rows)
def make_runner(cfg: Any, model: DeepseekV4ForCausalLM, dtype: torch.dtype, device: torch.device,
                max_model_len: int) -> DeepseekV4ModelRunner:
    """The one engine's runner for V4's cache layout (registered below for the model class, and built
    by ``ratchetlm.engine.model_runner.build_runner``): pools sized from ``cfg.kv_cache_bytes`` (default
    ~1 GiB), admission by the blocks a sequence needs. The MTP module gets its own ring when the
    strategy drafts with it."""
    if torch.device(device).type != "cpu":
        raise ValueError("DeepSeek-V4 runs on device='cpu' only (its paged step builds its metadata on the "
                         "CPU and is untested on CUDA)")
    if cfg.kv_cache_blocks is not None:
        raise ValueError("a DeepSeek-V4 cache is not made of per-token KV blocks: size it with kv_cache_bytes")
    ring: tuple[Hashable, ...] = tuple(range(model.config.num_layers))
    if cfg.decoding == "speculative" and cfg.decoding_options.get("method") == "mtp":
        if model.mtp is None:
            raise ValueError("speculative method='mtp' needs the checkpoint's MTP module (mtp.* weights), "
                             "and this checkpoint has none")
        ring += (MTP_LAYER,)
    opts = dict(model.layout_options)
    cap = DecodeCapacity.for_model(model.config, decode_seq=opts.pop("decode_seq", 2))
    check_strategy(cfg.decoding, cfg.decoding_options, cap.state_span)
    layout = DeepseekV4Layout(model.config, cap, dtype, device, budget_bytes=cfg.kv_cache_bytes,
                              max_num_seqs=cfg.max_num_seqs, max_model_len=max_model_len, ring_layers=ring,
                              shuffle_seed=opts.pop("shuffle_seed", None))
    return DeepseekV4ModelRunner(model, layout, device, cfg.staging_capacity)


register_layout(DeepseekV4ForCausalLM, make_runner)


def _causal(mask: torch.Tensor | None) -> bool:
    if mask is None:
        return True
    n = mask.shape[0]
    return bool(torch.equal(mask.bool(), torch.ones(n, n, dtype=torch.bool).tril()))

