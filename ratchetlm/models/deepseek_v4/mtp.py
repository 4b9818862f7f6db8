"""DeepSeek-V4's multi-token-prediction (MTP) module: one extra block that drafts the next token.

Math (DeepSeek's official ``MTPBlock``; HF transformers 5.23 reads ``num_nextn_predict_layers``
but does not build the module). For *pair* ``j`` — the main model's final residual streams
``h_j`` (``[hc, hidden]``, before its ``hc_head``) at position ``j`` and the token ``x_{j+1}``
that follows — the module computes

    x = e_proj(enorm(embed(x_{j+1})))  (broadcast over the hc streams)  +  h_proj(hnorm(h_j))
    g_j = Block(x)        # a sliding-window attention block + top-k MoE (layer id = num_layers)
    logits = lm_head(norm(hc_head_mtp(g_j)))      # embedding and lm_head shared with the model

which predicts ``x_{j+2}``. The block attends the module's own raw-KV ring of earlier pairs
(window 128, RoPE at position ``j``: the paper's position of ``h_j``; a constant shift would
change nothing, RoPE being relative). Chained drafting feeds ``g_j`` as the next pair's ``h``.

Weights layout (official on-disk names, the same ones a V4 checkpoint ships and HF ignores
with its ``mtp.*`` pattern), for module ``k``: ``mtp.{k}.e_proj.weight [H, H]``,
``mtp.{k}.h_proj.weight [H, H]``, ``mtp.{k}.enorm.weight``, ``mtp.{k}.hnorm.weight``,
``mtp.{k}.norm.weight [H]``, ``mtp.{k}.hc_head_fn [hc, hc*H]``, ``mtp.{k}.hc_head_base [hc]``,
``mtp.{k}.hc_head_scale [1]``, plus a decoder block's names under the same prefix
(``attn.{wq_a,q_norm,wq_b,wkv,norm,wo_a,wo_b,attn_sink}``, ``ffn.gate.{weight,bias}``,
``ffn.experts.{e}.w{1,2,3}``, ``ffn.shared_experts.w{1,2,3}``, ``attn_norm``, ``ffn_norm``,
``hc_{attn,ffn}_{fn,base,scale}``); ``model.mtp.{k}.`` is accepted too, and copies of the
shared ``embed`` / ``head`` under the prefix are ignored. Released V4 checkpoints have one
module; a chain of drafts reuses module 0 (further modules, if any, are not loaded).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ratchetlm.kv.pools import Pools
from ratchetlm.kv.sink import StepSink
from ratchetlm.models.deepseek_v4.blocks import HyperHead, RMSNorm
from ratchetlm.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from ratchetlm.models.deepseek_v4.model import MTP_LAYER, DecoderLayer, DeepseekV4ForCausalLM
from ratchetlm.models.deepseek_v4.paging import DecodeCapacity, WindowMeta


class MTPModule(DecoderLayer):
    """One MTP module: a sliding-window decoder block (layer id ``num_layers``, top-k MoE)
    plus its input projections and its own stream head."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        block_cfg = replace(cfg, num_layers=cfg.num_layers + 1, layer_types=cfg.layer_types + (SLIDING,),
                            mlp_layer_types=cfg.mlp_layer_types + ("moe",))
        super().__init__(block_cfg, cfg.num_layers)
        h = cfg.hidden_size
        self.e_proj = nn.Linear(h, h, bias=False)
        self.h_proj = nn.Linear(h, h, bias=False)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)

    def inputs(self, emb: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """emb: ``[*lead, H]`` token embeddings; prev: ``[*lead, hc, H]`` streams -> ``[*lead, hc, H]``."""
        return self.e_proj(self.enorm(emb)).unsqueeze(-2) + self.h_proj(self.hnorm(prev))


def mtp_forward(model: DeepseekV4ForCausalLM, mtp: MTPModule, pools: Pools, meta: WindowMeta,
                token_ids: torch.Tensor, prev: torch.Tensor, sink: StepSink, cap: DecodeCapacity) -> torch.Tensor:
    """One step of the module over pairs: token_ids ``[B, S]`` (``x_{j+1}``), prev
    ``[B, S, hc, H]`` (``h_j``), positions ``j`` in ``meta`` -> block output streams
    ``[B, S, hc, H]``. Its ring rows go through ``sink`` (pool ``ori``, layer ``mtp0``)."""
    from ratchetlm.models.deepseek_v4.decode import paged_attention

    streams = mtp.inputs(model.model.embed_tokens(token_ids), prev.to(model.model.embed_tokens.weight.dtype))
    post, comb, x = mtp.attn_in(streams)
    out = paged_attention(model, mtp.self_attn, MTP_LAYER, x, meta, pools, sink, cap, model.main_rope)
    return mtp.attn_out_and_mlp(post, comb, out, streams, token_ids)


def mtp_logits(model: DeepseekV4ForCausalLM, mtp: MTPModule, streams: torch.Tensor) -> torch.Tensor:
    """streams: ``[*lead, hc, H]`` -> logits ``[*lead, vocab]`` float32 (the shared lm_head)."""
    return model.lm_head(mtp.norm(mtp.hc_head(streams))).float()
