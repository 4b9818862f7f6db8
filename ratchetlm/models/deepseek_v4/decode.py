"""One paged V4 decode call: ``decode_step(model, cache, meta, input_ids) -> logits``.

Per attention layer, in this order:
1. project q / kv at each token's absolute position;
2. write each committed token's compressor state row (``state_slot_mapping``), then pool
   every window a committed token completes, reading the window's rows by absolute
   position through the logical state table, and write the entry (``cmp_slot_mapping``);
   CSA does the same for the indexer's own compressor (``idx_*``), then scores and takes
   the top-k over the visible indexer keys;
3. sparse attention over ring + overlay + compressed keys (raw-index contract);
4. only then commit raw KV into the ring (``ori_slot_mapping``) -- delayed so an in-step
   token never overwrites a ring row another in-step token still reads.
A slot mapping of -1 writes nothing, so the placeholder token mutates no cache.
"""

from __future__ import annotations

import torch

from ratchetlm.models.deepseek_v4.attention import Attention, WindowCompressor, select_topk
from ratchetlm.models.deepseek_v4.cache import DeepseekV4PagedCache
from ratchetlm.models.deepseek_v4.config import CSA, HCA
from ratchetlm.models.deepseek_v4.model import DeepseekV4ForCausalLM
from ratchetlm.models.deepseek_v4.paging import CompressorMeta, DecodeMetadata, physical_rows
from ratchetlm.models.deepseek_v4.rope import RopeTable
from ratchetlm.models.deepseek_v4.sparse_attn import gather_keys, sparse_attention


def _scatter_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """pool: ``[num_rows, width]``; rows: ``[N]`` (-1 = skip); values: ``[N, width]``."""
    keep = rows >= 0
    pool[rows[keep]] = values[keep].to(pool.dtype)


def compress_step(comp: WindowCompressor, x: torch.Tensor, meta: CompressorMeta, state_pool: torch.Tensor,
                  out_pool: torch.Tensor, rope: RopeTable, positions: torch.Tensor, block: int) -> None:
    """x: ``[B, S, hidden]``; state_pool: ``[rows, 2*coff*dim]`` fp32; out_pool: ``[blocks, block, dim]``."""
    B, S, _ = x.shape
    kv_rows, score_rows = comp.rows(x, positions)  # [B, S, coff*dim]
    width = kv_rows.shape[-1]
    _scatter_rows(state_pool, meta.state_slot_mapping.flatten(), torch.cat([kv_rows, score_rows], -1).flatten(0, 1))
    if not bool((meta.cmp_slot_mapping >= 0).any()):
        return
    # Rows [pos - window_rows + 1, pos], addressed by absolute position; positions before 0
    # (the first overlapping window has no predecessor) pool as kv 0 / score -inf.
    R = comp.window_rows
    wpos = positions[..., None] - R + 1 + torch.arange(R)  # [B, S, R]
    rows = physical_rows(meta.state_block_table, wpos, meta.state_page)
    got = state_pool[rows.clamp(min=0)]  # [B, S, R, 2*width]
    ok = (rows >= 0)[..., None]
    kv = torch.where(ok, got[..., :width], 0.0).flatten(0, 1)
    score = torch.where(ok, got[..., width:], float("-inf")).flatten(0, 1)
    done = meta.cmp_slot_mapping.flatten() >= 0
    first = (positions.flatten() + 1 - comp.ratio).clamp(min=0)
    entries = comp.pool(kv[done], score[done], first[done], rope, out_pool.dtype)
    _scatter_rows(out_pool.view(-1, out_pool.shape[-1]), meta.cmp_slot_mapping.flatten()[done], entries)


def indexer_topk(attn: Attention, x: torch.Tensor, q_res: torch.Tensor, meta: DecodeMetadata,
                  idx_pool: torch.Tensor, rope: RopeTable, topk: int, score_len: int, block: int) -> torch.Tensor:
    """-> raw indices ``[B, S, topk]`` of the selected compressed slots (-1 where fewer are visible)."""
    indexer = attn.csa_compressor().indexer
    B, S, _ = x.shape
    iq, iw = indexer.queries(x, q_res, meta.position_ids, rope)
    slots = torch.arange(score_len)
    rows = physical_rows(meta.inner.cmp_block_table, slots.expand(B, -1), block)  # [B, score_len]
    keys = idx_pool.view(-1, idx_pool.shape[-1])[rows.clamp(min=0)]  # [B, score_len, Di]
    scores = indexer.scores(iq.flatten(0, 1), iw.flatten(0, 1), keys.repeat_interleave(S, 0)).view(B, S, -1)
    hidden = (slots >= meta.inner.visible_len[..., None]) | (rows < 0)[:, None, :]
    values, picked = select_topk(scores.masked_fill(hidden, float("-inf")), topk)
    raw = meta.window + meta.decode_seq + picked
    return torch.where(values > float("-inf"), raw, torch.full_like(raw, -1))


def paged_attention(model: DeepseekV4ForCausalLM, layer: int, x: torch.Tensor, meta: DecodeMetadata,
                    cache: DeepseekV4PagedCache) -> torch.Tensor:
    """x: ``[B, S, hidden]`` normed attention input -> ``[B, S, hidden]``."""
    attn = model.model.decoder_layer(layer).self_attn
    cap, rope, crope = cache.cap, model.rope_for(layer), model.compress_rope
    pos = meta.position_ids
    q, kv, q_res = attn.project(x, pos, rope)
    raw, cmp_pool, cmp_table = meta.swa_indices, None, None
    if attn.kind == CSA:
        csa = attn.csa_compressor()
        compress_step(csa, x, meta.csa, cache.csa_state[layer], cache.csa_cmp[layer], crope, pos, cap.block_size)
        compress_step(csa.indexer, x, meta.inner, cache.inner_state[layer], cache.idx[layer], crope, pos,
                      cap.block_size)
        picked = indexer_topk(attn, x, q_res, meta, cache.idx[layer], crope, cap.index_topk, cap.score_len,
                               cap.block_size)
        raw, cmp_pool, cmp_table = torch.cat([raw, picked], -1), cache.csa_cmp[layer], meta.csa.cmp_block_table
    elif attn.kind == HCA:
        compress_step(attn.window_compressor(), x, meta.hca, cache.hca_state[layer], cache.hca_cmp[layer], crope,
                      pos, cap.block_size)
        raw, cmp_pool, cmp_table = torch.cat([raw, meta.hca_indices], -1), cache.hca_cmp[layer], \
            meta.hca.cmp_block_table
    keys, valid = gather_keys(raw, cache.ori[layer], meta.ori_block_table, kv, cmp_pool, cmp_table,
                              meta.window, cap.block_size)
    o = sparse_attention(q, keys, valid, attn.sinks, attn.scale)
    ring = cache.ori[layer]
    _scatter_rows(ring.view(-1, ring.shape[-1]), meta.ori_slot_mapping.flatten(), kv.flatten(0, 1))
    return attn.output(o, pos, rope)


@torch.no_grad()
def decode_step(model: DeepseekV4ForCausalLM, cache: DeepseekV4PagedCache, meta: DecodeMetadata,
                input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids: ``[B, S]`` (the placeholder's id is arbitrary) -> logits ``[B, S, vocab]``.

    Commits exactly the tokens whose slot mappings are >= 0 (one per sequence when the
    metadata comes from :func:`lower_decode_step`)."""
    if input_ids.shape != meta.position_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} != positions {tuple(meta.position_ids.shape)}")
    streams = model.embed(input_ids)  # [B, S, hc, hidden]
    for layer in model.model.decoder_layers():
        post, comb, x = layer.attn_in(streams)
        out = paged_attention(model, layer.layer, x, meta, cache)
        streams = layer.attn_out_and_mlp(post, comb, out, streams, input_ids)
    return model.head(streams)
