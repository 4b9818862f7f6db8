"""DeepSeek-V4 parameter tree (HF names) and the layer-agnostic pieces of a forward pass.

``DeepseekV4ForCausalLM`` only owns weights and RoPE tables; the unpaged reference
(``reference.py``) and the paged decode step (``decode.py``) drive the attention part
their own way and share everything else through :meth:`DecoderLayer.attn_in`,
:meth:`DecoderLayer.attn_out_and_mlp` and :meth:`DeepseekV4ForCausalLM.head`.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ratchetlm.models.deepseek_v4.attention import Attention
from ratchetlm.models.deepseek_v4.blocks import HyperConnection, HyperHead, MoE, RMSNorm
from ratchetlm.models.deepseek_v4.config import SLIDING, DeepseekV4Config
from ratchetlm.models.deepseek_v4.rope import RopeTable


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.self_attn = Attention(cfg, layer)
        self.mlp = MoE(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def attn_in(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: ``[*lead, hc, hidden]`` -> (post, comb, normed attention input ``[*lead, hidden]``)."""
        post, comb, x = self.attn_hc(streams)
        return post, comb, self.input_layernorm(x)

    def attn_out_and_mlp(self, post: torch.Tensor, comb: torch.Tensor, attn_out: torch.Tensor,
                         streams: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Folds the attention output into the streams, then runs the MoE half of the block."""
        streams = HyperConnection.expand(post, comb, attn_out, streams)
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.expand(post, comb, self.mlp(self.post_attention_layernorm(x), token_ids), streams)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg)

    def decoder_layer(self, i: int) -> DecoderLayer:
        """Layer ``i``, typed (``nn.ModuleList`` indexing is typed as a bare ``Module``)."""
        return cast(DecoderLayer, self.layers[i])

    def decoder_layers(self) -> list[DecoderLayer]:
        return [self.decoder_layer(i) for i in range(len(self.layers))]


MTP_LAYER = "mtp0"  # pool key of the MTP module's raw-KV ring


class DeepseekV4ForCausalLM(nn.Module):
    """Weights of a V4 checkpoint; ``state_dict`` keys match HF's ``DeepseekV4ForCausalLM``."""

    def __init__(self, cfg: DeepseekV4Config, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekV4Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # One spare row: an S=2 decode call at the last position still ropes its placeholder.
        n = (max_positions or cfg.max_position_embeddings) + 1
        self.main_rope = RopeTable(cfg.main_rope, n)
        self.compress_rope = RopeTable(cfg.compress_rope, n)
        self.mtp: nn.ModuleList | None = None  # [MTPModule] (mtp.py), when the checkpoint ships one
        # Static-shape and allocation knobs of the engine's V4 layout: ``decode_seq`` (1 or 2, the
        # seed's smallest call shape) and ``shuffle_seed`` (hand out blocks in a shuffled order, so
        # tests see non-identity tables). Read when an engine is built on this model.
        self.layout_options: dict[str, int] = {"decode_seq": 2}

    def rope_for(self, layer: int) -> RopeTable:
        """Sliding-only layers use the plain table; CSA/HCA layers and all compressors use YaRN's."""
        return self.main_rope if self.config.layer_types[layer] == SLIDING else self.compress_rope

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: ``lead`` -> residual streams ``[*lead, hc, hidden]``."""
        h = self.model.embed_tokens(token_ids)
        return h.unsqueeze(-2).expand(*h.shape[:-1], self.config.hc_mult, h.shape[-1]).contiguous()

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """streams: ``[*lead, hc, hidden]`` -> logits ``[*lead, vocab]`` (float32)."""
        return self.lm_head(self.model.norm(self.model.hc_head(streams))).float()
