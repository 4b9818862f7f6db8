"""Llama-family decoder (Llama, Qwen2, Qwen3) on the paged KV cache.

Per layer: RMSNorm → fused QKV (+bias for Qwen2) → optional per-head QK-norm (Qwen3) →
RoPE at explicit positions → :func:`paged_attention` (writes K/V through the batch's sink)
→ O-proj → residual → RMSNorm → fused gate/up SwiGLU → down → residual.

Tokens are packed: every tensor is ``[num_tokens, ...]`` across all sequences of the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ratchetlm.layers.attention import AttentionBatch, paged_attention
from ratchetlm.layers.block_quant import BlockWeight, Linear, fused_matmul, usable
from ratchetlm.layers.norm_rope import RMSNorm, RotaryEmbedding
from ratchetlm.models.config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # ([num_tokens, 1, head_dim],) * 2
        batch: AttentionBatch,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv(self.input_norm(x))
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = RotaryEmbedding.rotate(cos_sin, q, k)
        else:  # Q and K heads are adjacent in the fused output: rotate them as one tensor
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = RotaryEmbedding.rotate_packed(cos_sin, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        attn = paged_attention(self.index, q, k, v, batch, self.scale)
        x = x + self.o_proj(attn.reshape(t, self.q_size))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    """Decoder stack + head. ``forward`` returns final hidden states; ``logits`` applies the head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.head_blocks: BlockWeight | None = None  # tied head as GGUF blocks (see attach_blocks)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        batch: AttentionBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden] after the final norm
        """Run the first ``num_layers`` layers (all by default; fewer = layer-skip self-draft)."""
        x = self.embed(input_ids)
        cos_sin = self.rope.cos_sin(batch.positions)
        for layer in self.layers[: num_layers or len(self.layers)]:
            x = layer(x, cos_sin, batch)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if usable(hidden, self.head_blocks):
            assert self.head_blocks is not None
            return fused_matmul(hidden, self.head_blocks)
        return F.linear(hidden, self.embed.weight).float()

    def attach_blocks(self, blocks: dict[str, BlockWeight]) -> int:
        """Give linear layers the GGUF-block copy of their (already loaded) weights, by HF name.

        Fused layers get blocks only when every part is block-quantized with one kind. Returns the
        number of layers that got blocks. The dense weights stay: they serve prefill and non-CPU paths.
        """
        attached = 0
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            pre = f"model.layers.{i}."
            groups: list[tuple[Linear, list[str]]] = [
                (layer.qkv, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                (layer.o_proj, ["self_attn.o_proj"]),
                (layer.gate_up, ["mlp.gate_proj", "mlp.up_proj"]),
                (layer.down, ["mlp.down_proj"]),
            ]
            for module, names in groups:
                parts = [blocks.get(f"{pre}{n}.weight") for n in names]
                bw = BlockWeight.cat([p for p in parts if p is not None]) if all(parts) else None
                if bw is not None and bw.shape == tuple(module.weight.shape):
                    module.blocks = bw
                    attached += 1
        if self.lm_head is not None:
            bw = blocks.get("lm_head.weight")
            if bw is not None and bw.shape == tuple(self.lm_head.weight.shape):
                self.lm_head.blocks = bw
                attached += 1
        else:
            bw = blocks.get("model.embed_tokens.weight")
            if bw is not None and bw.shape == tuple(self.embed.weight.shape):
                self.head_blocks = bw
                attached += 1
        return attached

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in HF ``LlamaForCausalLM``/``Qwen2``/``Qwen3`` state dicts.

        Separate q/k/v and gate/up tensors are copied into their slices of the fused weights.
        Raises ValueError naming any missing or unexpected tensor.
        """
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        fused = {
            "q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, kv), "v_proj": ("qkv", q + kv, kv),
            "gate_proj": ("gate_up", 0, inter), "up_proj": ("gate_up", inter, inter),
        }
        plain = {
            "self_attn.o_proj.weight": "o_proj.weight", "mlp.down_proj.weight": "down.weight",
            "input_layernorm.weight": "input_norm.weight", "post_attention_layernorm.weight": "post_norm.weight",
            "self_attn.q_norm.weight": "q_norm.weight", "self_attn.k_norm.weight": "k_norm.weight",
        }
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, w in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            target, rows = self._map_name(name, fused, plain)
            if target == "lm_head.weight" and self.lm_head is None:
                continue  # tied head: some checkpoints also store the (identical) head
            if target is None:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            if target not in params:
                raise ValueError(f"weight {name!r} maps to {target!r}, which this config does not have")
            p = params[target]
            dst = p if rows is None else p[rows[0] : rows[0] + rows[1]]
            if dst.shape != w.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(w.to(dst.dtype))
            seen.add(f"{target}:{rows}")
        expected = 0
        for n in params:
            if n.endswith("qkv.weight") or n.endswith("qkv.bias"):
                expected += 3
            elif n.endswith("gate_up.weight"):
                expected += 2
            else:
                expected += 1
        if len(seen) != expected:
            raise ValueError(f"checkpoint is missing weights: loaded {len(seen)} of {expected} tensors")

    @staticmethod
    def _map_name(name: str, fused: dict, plain: dict) -> tuple[str | None, tuple[int, int] | None]:
        name = name.removeprefix("model.")
        if name == "embed_tokens.weight":
            return "embed.weight", None
        if name == "norm.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            return "lm_head.weight", None
        if not name.startswith("layers."):
            return None, None
        _, idx, rest = name.split(".", 2)
        if rest in plain:
            return f"layers.{idx}.{plain[rest]}", None
        module, _, kind = rest.rpartition(".")  # e.g. self_attn.q_proj / weight
        key = module.rsplit(".", 1)[-1]
        if key in fused:
            tgt, start, size = fused[key]
            return f"layers.{idx}.{tgt}.{kind}", (start, size)
        return None, None
