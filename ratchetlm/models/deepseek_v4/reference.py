"""Plain, unpaged full-sequence V4 forward (one sequence, positions ``0..T-1``).

This is the prefill path and the long-context reference: it is checked against HF's
``DeepseekV4ForCausalLM`` at lengths HF can afford, and the paged decode path is checked
against it at lengths HF cannot (up to 16384). Queries are processed in chunks so memory
stays ``O(chunk * (window + topk))`` rather than ``O(T^2)``.

Besides logits it returns a per-layer :class:`LayerTrace` of everything a serving cache
would hold after the prompt (raw KV, compressor state rows, compressed entries, indexer
keys); ``cache.py`` lowers that into the paged pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ratchetlm.models.deepseek_v4.attention import (
    SCORE_BLOCK,
    Attention,
    WindowCompressor,
    select_topk,
    sink_attention,
)
from ratchetlm.models.deepseek_v4.config import CSA
from ratchetlm.models.deepseek_v4.model import DeepseekV4ForCausalLM
from ratchetlm.models.deepseek_v4.rope import RopeTable


@dataclass
class CompressorTrace:
    ratio: int
    kv_rows: torch.Tensor  # [T, coff*dim] float32
    score_rows: torch.Tensor  # [T, coff*dim] float32, position bias included
    entries: torch.Tensor  # [T // ratio, dim]


@dataclass
class LayerTrace:
    kv: torch.Tensor  # [T, head_dim] roped raw KV
    main: CompressorTrace | None = None  # CSA or HCA compressor
    indexer: CompressorTrace | None = None  # CSA only


def prefix_traces(traces: list[LayerTrace], T: int) -> list[LayerTrace]:
    """The traces of the first ``T`` tokens (the forward is causal, so they are a prefix)."""

    def cut(c: CompressorTrace | None) -> CompressorTrace | None:
        if c is None:
            return None
        return CompressorTrace(c.ratio, c.kv_rows[:T], c.score_rows[:T], c.entries[: T // c.ratio])

    return [LayerTrace(tr.kv[:T], cut(tr.main), cut(tr.indexer)) for tr in traces]


def compress_all(comp: WindowCompressor, x: torch.Tensor, positions: torch.Tensor,
                 rope: RopeTable) -> CompressorTrace:
    """Pools every complete window of a prompt. x: ``[T, hidden]``."""
    kv_rows, score_rows = comp.rows(x, positions)
    r, nb = comp.ratio, x.shape[0] // comp.ratio
    cur_kv = kv_rows[: nb * r].view(nb, r, kv_rows.shape[-1])
    cur_score = score_rows[: nb * r].view(nb, r, score_rows.shape[-1])
    if comp.overlap:  # window w also reads window w-1 (absent for w = 0)
        prev_kv = torch.cat([torch.zeros_like(cur_kv[:1]), cur_kv[:-1]])
        prev_score = torch.cat([torch.full_like(cur_score[:1], float("-inf")), cur_score[:-1]])
        cur_kv, cur_score = torch.cat([prev_kv, cur_kv], 1), torch.cat([prev_score, cur_score], 1)
    entries = comp.pool(cur_kv, cur_score, torch.arange(nb) * r, rope, x.dtype)
    return CompressorTrace(r, kv_rows, score_rows, entries)


def _attention(attn: Attention, x: torch.Tensor, positions: torch.Tensor, rope: RopeTable, comp_rope: RopeTable,
               window: int, chunk: int) -> tuple[torch.Tensor, LayerTrace]:
    T = x.shape[0]
    q, kv, q_res = attn.project(x, positions, rope)
    trace = LayerTrace(kv=kv)
    comp = attn.compressor
    if comp is not None:
        trace.main = compress_all(comp, x, positions, comp_rope)
    if attn.kind == CSA:
        indexer = attn.csa_compressor().indexer
        trace.indexer = compress_all(indexer, x, positions, comp_rope)
        iq, iw = indexer.queries(x, q_res, positions, comp_rope)
    outs = []
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        t = positions[c0:c1, None]  # [n, 1]
        lo = max(0, c0 - window + 1)
        key_pos = torch.arange(lo, c1)[None, :]
        keys = kv[lo:c1].unsqueeze(0)  # [1, Kr, D]
        visible = (key_pos <= t) & (key_pos > t - window)
        if comp is not None and trace.main.entries.shape[0] > 0:  # type: ignore[union-attr]
            entries = trace.main.entries  # type: ignore[union-attr]
            ready = (t + 1) // comp.ratio  # entries [0, ready) are complete for query t
            slots = torch.arange(entries.shape[0])[None, :]
            if attn.kind == CSA:
                # only the entries some query of the chunk can see are scored (whole SCORE_BLOCKs; the
                # rest are -inf), bit-identical to scoring them all (see decode.indexer_topk)
                n = entries.shape[0]
                width = min(n, -(-int(ready.max()) // SCORE_BLOCK) * SCORE_BLOCK)
                scores = indexer.scores(iq[c0:c1], iw[c0:c1], trace.indexer.entries[None, :width])  # type: ignore
                scores = torch.cat([scores, scores.new_full((c1 - c0, n - width), float("-inf"))], dim=1)
                scores = scores.masked_fill(slots >= ready, float("-inf"))
                values, picked = select_topk(scores, min(indexer.topk, entries.shape[0]))
                extra, extra_visible = entries[picked], values > float("-inf")
            else:
                extra, extra_visible = entries[None].expand(c1 - c0, -1, -1), slots < ready
            keys = torch.cat([keys.expand(c1 - c0, -1, -1), extra], dim=1)
            visible = torch.cat([visible, extra_visible], dim=1)
        outs.append(sink_attention(q[c0:c1], keys, visible, attn.sinks, attn.scale))
    return attn.output(torch.cat(outs), positions, rope), trace


@torch.no_grad()
def reference_streams(model: DeepseekV4ForCausalLM, token_ids: torch.Tensor,
                      chunk: int = 256) -> tuple[torch.Tensor, list[LayerTrace]]:
    """token_ids: ``[T]`` -> (final residual streams ``[T, hc, hidden]``, one :class:`LayerTrace`
    per layer). The streams are what the MTP module reads."""
    cfg = model.config
    T = token_ids.shape[0]
    if T > model.main_rope.max_positions:
        raise ValueError(f"prompt of {T} tokens exceeds position capacity {model.main_rope.max_positions}")
    positions = torch.arange(T)
    streams = model.embed(token_ids)  # [T, hc, hidden]
    traces = []
    for layer in model.model.decoder_layers():
        post, comb, x = layer.attn_in(streams)
        out, trace = _attention(layer.self_attn, x, positions, model.rope_for(layer.layer), model.compress_rope,
                                cfg.sliding_window, chunk)
        traces.append(trace)
        streams = layer.attn_out_and_mlp(post, comb, out, streams, token_ids)
    return streams, traces


@torch.no_grad()
def reference_forward(model: DeepseekV4ForCausalLM, token_ids: torch.Tensor, chunk: int = 256,
                      logits_for: slice | None = None) -> tuple[torch.Tensor, list[LayerTrace]]:
    """token_ids: ``[T]`` -> (logits ``[T', vocab]`` for ``logits_for`` rows (all by default),
    one :class:`LayerTrace` per layer)."""
    streams, traces = reference_streams(model, token_ids, chunk)
    rows = streams if logits_for is None else streams[logits_for]
    return model.head(rows), traces


@torch.no_grad()
def mtp_reference(model: DeepseekV4ForCausalLM, mtp: torch.nn.Module, prev: torch.Tensor,
                  next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP module over pairs ``j = 0..T-1`` unpaged: prev ``[T, hc, hidden]`` (``h_j``, or
    a drafting module's own outputs), next_ids ``[T]`` (``x_{j+1}``) -> (logits ``[T, vocab]``,
    row ``j`` predicting ``x_{j+2}``; the block's output streams ``[T, hc, hidden]``)."""
    from ratchetlm.models.deepseek_v4.mtp import MTPModule

    assert isinstance(mtp, MTPModule)
    positions = torch.arange(next_ids.shape[0])
    streams = mtp.inputs(model.model.embed_tokens(next_ids), prev.to(model.model.embed_tokens.weight.dtype))
    post, comb, x = mtp.attn_in(streams)
    out, _ = _attention(mtp.self_attn, x, positions, model.main_rope, model.compress_rope,
                        model.config.sliding_window, 256)
    streams = mtp.attn_out_and_mlp(post, comb, out, streams, next_ids)
    return model.lm_head(mtp.norm(mtp.hc_head(streams))).float(), streams
