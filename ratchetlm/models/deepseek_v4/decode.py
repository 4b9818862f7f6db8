"""One paged V4 step: ``forward_step(model, pools, meta, input_ids, sink) -> streams``.

A step is ``S`` consecutive tokens per sequence on top of its cached context (a prefill
chunk, a decode token plus placeholder, a draft chain to verify). Per attention layer:

1. project q / kv at each token's absolute position;
2. every compressor computes its per-token state rows; each token that completes a window
   pools rows ``[pos - window_rows + 1, pos]`` — those before the step from the state pool
   (addressed by absolute position through the logical state table), in-step ones from the
   rows just computed — into the window's entry. CSA does the same for the indexer's own
   compressor, then scores the visible indexer keys (before the step: the ``idx`` pool; this
   step's: its own entries) and takes the top-k;
3. sparse attention over ring + overlay + compressed keys (raw-index contract, paging.py;
   compressed slots completed in the step are read from the step's own entries);
4. only then hand every new row (ring KV, state rows, entries, indexer keys) to the step's
   :class:`~ratchetlm.kv.sink.StepSink`, the engine's single write point (the llama family's too):
   direct rows land in their slots, staged rows in the staging buffer, ``-1`` rows nowhere.

Because every row is read in-step from the forward itself and written after the layer's
reads, no in-step token ever overwrites a row another in-step token still reads (the seed's
write-after-attention rule, now for every pool) and a staged (not yet committed) row is
never needed in the pools.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ratchetlm.kv.pools import Pools
from ratchetlm.kv.sink import StepSink
from ratchetlm.models.deepseek_v4.attention import SCORE_BLOCK, Attention, WindowCompressor, select_topk
from ratchetlm.models.deepseek_v4.config import CSA, HCA
from ratchetlm.models.deepseek_v4.model import DeepseekV4ForCausalLM
from ratchetlm.models.deepseek_v4.paging import (
    CompressorMeta,
    DecodeCapacity,
    DecodeMetadata,
    WindowMeta,
    physical_rows,
)
from ratchetlm.models.deepseek_v4.rope import RopeTable
from ratchetlm.models.deepseek_v4.sparse_attn import gather_keys, sparse_attention

QUERY_CHUNK = 256  # queries per gather+attention chunk: bounds memory for long prefill chunks


def compress_step(comp: WindowCompressor, x: torch.Tensor, meta: CompressorMeta, state_pool: torch.Tensor,
                  rope: RopeTable, positions: torch.Tensor, step_start: torch.Tensor,
                  out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: ``[B, S, hidden]``; state_pool: ``[rows, 2*coff*dim]`` fp32.

    -> (state rows ``[B, S, 2*coff*dim]`` of every token, entries ``[B, S, dim]`` — the pooled
    entry at each token that completes a window, zeros elsewhere)."""
    B, S, _ = x.shape
    kv_rows, score_rows = comp.rows(x, positions)  # [B, S, coff*dim] each
    rows = torch.cat([kv_rows, score_rows], -1)  # [B, S, 2*coff*dim]
    width = kv_rows.shape[-1]
    entries = torch.zeros(B, S, comp.dim, dtype=out_dtype)
    done = ((positions + 1) % comp.ratio == 0).nonzero()  # [n, 2] (b, s) of completing tokens
    if done.numel() == 0:
        return rows, entries
    b, s = done[:, 0], done[:, 1]
    R = comp.window_rows
    wpos = positions[b, s][:, None] - R + 1 + torch.arange(R)  # [n, R] window positions, oldest first
    start = step_start[b][:, None]
    from_pool = wpos < start
    # rows before the step: the state pool, by absolute position through the logical table;
    # positions before 0 (the first overlapping window has no predecessor) pool as kv 0 / score -inf
    prow = physical_rows(meta.state_block_table[b], torch.where(from_pool, wpos, -1), meta.state_page)
    in_step = rows[b[:, None], (wpos - start).clamp(0, S - 1)]  # [n, R, 2*width]
    got = torch.where(from_pool[..., None], state_pool[prow.clamp(min=0)], in_step)
    ok = (wpos >= 0) & (~from_pool | (prow >= 0))
    kv = torch.where(ok[..., None], got[..., :width], 0.0)
    score = torch.where(ok[..., None], got[..., width:], float("-inf"))
    first = (positions[b, s] + 1 - comp.ratio).clamp(min=0)
    entries[b, s] = comp.pool(kv, score, first, rope, out_dtype)
    return rows, entries


def _overlay_index(slot: torch.Tensor, step_start: torch.Tensor, ratio: int) -> torch.Tensor:
    """In-step token row that completed compressed ``slot`` (``[B, ...]``)."""
    shape = (-1,) + (1,) * (slot.dim() - 1)
    return (slot + 1) * ratio - 1 - step_start.view(shape)


def indexer_topk(attn: Attention, x: torch.Tensor, q_res: torch.Tensor, meta: DecodeMetadata,
                 idx_pool: torch.Tensor, rope: RopeTable, topk: int, score_len: int, block: int,
                 idx_entries: torch.Tensor | None = None) -> torch.Tensor:
    """-> raw indices ``[B, S, topk]`` of the selected compressed slots (-1 where fewer are visible).

    Keys of slots completed before the step come from ``idx_pool``; those completed in the step
    from ``idx_entries`` ``[B, S, Di]`` (the indexer compressor's in-step entries)."""
    indexer = attn.csa_compressor().indexer
    B, S, _ = x.shape
    out = torch.full((B, S, topk), -1, dtype=torch.long)
    # Slots at or past a query's visible_len score -inf, so only the batch's widest visible prefix is
    # scored (rounded up to whole SCORE_BLOCKs): a short context no longer pays for all score_len slots.
    # Bit-identical to scoring every slot: a slot's score does not depend on how many slots are scored
    # once the width is a multiple of the vector width (checked in tests/deepseek_v4/test_sparse_attn.py),
    # and selecting among the hidden -inf slots only ever added -1 picks.
    width = min(score_len, -(-int(meta.inner.visible_len.max()) // SCORE_BLOCK) * SCORE_BLOCK)
    if width == 0:  # nothing visible anywhere in the batch
        return out
    iq, iw = indexer.queries(x, q_res, meta.position_ids, rope)  # [B, S, Hi, Di], [B, S, Hi]
    slots = torch.arange(width).expand(B, -1)  # [B, width]
    rows = physical_rows(meta.inner.cmp_block_table, slots, block)
    keys = idx_pool.view(-1, idx_pool.shape[-1])[rows.clamp(min=0)]  # [B, width, Di]
    present = rows >= 0
    completes = bool(((meta.position_ids + 1) % indexer.ratio == 0).any())
    if idx_entries is not None and completes:  # some token completed an indexer window this step
        hist = meta.inner.history_len[:, None]
        ov = _overlay_index(slots, meta.step_start, indexer.ratio)  # [B, width]
        in_step = (slots >= hist) & (ov >= 0) & (ov < S)
        ov_keys = idx_entries.gather(1, ov.clamp(0, S - 1)[..., None].expand(-1, -1, idx_entries.shape[-1]))
        keys = torch.where(in_step[..., None], ov_keys.to(keys.dtype), keys)
        present = torch.where(slots >= hist, in_step, present)
    k = min(topk, width)
    for c0 in range(0, S, QUERY_CHUNK):  # scores [B, chunk, width]: chunked for long prefill steps
        c1 = min(S, c0 + QUERY_CHUNK)
        scores = indexer.scores(iq[:, c0:c1], iw[:, c0:c1], keys)  # [B, n, width]
        hidden = (torch.arange(width) >= meta.inner.visible_len[:, c0:c1, None]) | ~present[:, None, :]
        values, picked = select_topk(scores.masked_fill(hidden, float("-inf")), k)
        raw = meta.window + meta.decode_seq + picked
        out[:, c0:c1, :k] = torch.where(values > float("-inf"), raw, torch.full_like(raw, -1))
    return out


def paged_attention(model: DeepseekV4ForCausalLM, attn: Attention, layer: Hashable, x: torch.Tensor,
                    meta: DecodeMetadata | WindowMeta, pools: Pools, sink: StepSink, cap: DecodeCapacity,
                    rope: RopeTable) -> torch.Tensor:
    """x: ``[B, S, hidden]`` normed attention input -> ``[B, S, hidden]``. ``layer`` keys this
    layer's pools (an int for decoder layers, ``"mtp0"`` for the MTP module's ring)."""
    crope = model.compress_rope
    pos = meta.position_ids
    B, S, _ = x.shape
    q, kv, q_res = attn.project(x, pos, rope)
    raw, cmp_pool, cmp_table, cmp_ov, cmp_hist, ratio = meta.swa_indices, None, None, None, None, 0
    writes: list[tuple[str, torch.Tensor]] = [("ori", kv)]
    if attn.kind == CSA:
        assert isinstance(meta, DecodeMetadata)
        csa = attn.csa_compressor()
        rows, entries = compress_step(csa, x, meta.csa, pools.get("csa_state", layer), crope, pos, meta.step_start,
                                      kv.dtype)
        irows, ientries = compress_step(csa.indexer, x, meta.inner, pools.get("inner_state", layer), crope, pos,
                                        meta.step_start, kv.dtype)
        picked = indexer_topk(attn, x, q_res, meta, pools.get("idx", layer), crope, cap.index_topk, cap.score_len,
                              cap.block_size, ientries)
        raw = torch.cat([raw, picked], -1)
        cmp_pool, cmp_table, cmp_ov, cmp_hist, ratio = pools.get("csa_cmp", layer), meta.csa.cmp_block_table, \
            entries, meta.csa.history_len, csa.ratio
        writes += [("csa_state", rows), ("csa_cmp", entries), ("inner_state", irows), ("idx", ientries)]
    elif attn.kind == HCA:
        assert isinstance(meta, DecodeMetadata)
        comp = attn.window_compressor()
        rows, entries = compress_step(comp, x, meta.hca, pools.get("hca_state", layer), crope, pos, meta.step_start,
                                      kv.dtype)
        raw = torch.cat([raw, meta.hca_indices], -1)
        cmp_pool, cmp_table, cmp_ov, cmp_hist, ratio = pools.get("hca_cmp", layer), meta.hca.cmp_block_table, \
            entries, meta.hca.history_len, comp.ratio
        writes += [("hca_state", rows), ("hca_cmp", entries)]
    ring = pools.get("ori", layer)
    outs = []
    for c0 in range(0, S, QUERY_CHUNK):
        c1 = min(S, c0 + QUERY_CHUNK)
        keys, valid = gather_keys(raw[:, c0:c1], ring, meta.ori_block_table, kv, cmp_pool, cmp_table, meta.window,
                                  cap.block_size, cmp_overlay=cmp_ov, cmp_history=cmp_hist, ratio=ratio,
                                  step_start=meta.step_start)
        outs.append(sparse_attention(q[:, c0:c1], keys, valid, attn.sinks, attn.scale))
    o = torch.cat(outs, 1)
    # after every read of this layer (write-after-attention), one row per token per pool
    sink.write(layer, **{name: values.flatten(0, 1) for name, values in writes})
    return attn.output(o, pos, rope)


@torch.no_grad()
def forward_step(model: DeepseekV4ForCausalLM, pools: Pools, meta: DecodeMetadata, input_ids: torch.Tensor,
                 sink: StepSink, cap: DecodeCapacity) -> torch.Tensor:
    """input_ids: ``[B, S]`` (placeholder ids are arbitrary) -> final residual streams
    ``[B, S, hc, hidden]`` (``model.head`` turns them into logits; the MTP module reads them).

    Writes exactly the rows whose slot mappings are >= 0, through ``sink``."""
    if input_ids.shape != meta.position_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} != positions {tuple(meta.position_ids.shape)}")
    streams = model.embed(input_ids)  # [B, S, hc, hidden]
    for layer in model.model.decoder_layers():
        post, comb, x = layer.attn_in(streams)
        out = paged_attention(model, layer.self_attn, layer.layer, x, meta, pools, sink, cap,
                              model.rope_for(layer.layer))
        streams = layer.attn_out_and_mlp(post, comb, out, streams, input_ids)
    return streams


def step_slots(meta: DecodeMetadata) -> dict[str, torch.Tensor]:
    """Slot of every token row (flattened ``[B * S]``) per pool: what the sink writes where."""
    return {
        "ori": meta.ori_slot_mapping.flatten(),
        "csa_state": meta.csa.state_slot_mapping.flatten(), "csa_cmp": meta.csa.cmp_slot_mapping.flatten(),
        "inner_state": meta.inner.state_slot_mapping.flatten(), "idx": meta.inner.cmp_slot_mapping.flatten(),
        "hca_state": meta.hca.state_slot_mapping.flatten(), "hca_cmp": meta.hca.cmp_slot_mapping.flatten(),
    }
