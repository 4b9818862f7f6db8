"""The decoder every supported family runs (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) on the paged KV cache.

Per layer: RMSNorm → fused QKV (+bias: Qwen2) → optional per-head QK-norm (Qwen3, Gemma 3) →
RoPE at explicit positions (partial, scaled; Gemma 3's sliding layers have their own base) →
:func:`paged_attention` (writes K/V through the batch's sink; sliding window, logit soft-cap)
→ O-proj (→ RMSNorm: Gemma's sandwich) → residual → RMSNorm → fused gate/up, SiLU or tanh-GELU
gate → down (→ RMSNorm: sandwich) → residual. Families are values of
:class:`~ratchetlm.models.config.ModelConfig` (models/families/), not subclasses.

Tokens are packed: every tensor is ``[num_tokens, ...]`` across all sequences of the step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ratchetlm.layers.attention import AttentionBatch, kernel_reads, paged_attention
from ratchetlm.layers.block_quant import BlockWeight, Embedding, Linear, set_numerics
from ratchetlm.layers.norm_rope import RMSNorm, RotaryEmbedding
from ratchetlm.layers.swiglu import silu_mul
from ratchetlm.models.config import ModelConfig
from ratchetlm.models.decode_chain import DecodeChain
from ratchetlm.models.families import FAMILIES, FUSED_PARTS
from ratchetlm.models.shard import COLUMN, TPShard

ACTIVATION = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
# MLP rows per call in the integer modes: bounds a long prefill's working memory (peak RSS) while the
# matmuls stay compute bound (each chunk re-reads the weights: ~4% of a 512-token prefill at 1B). 64,
# not 128: 1B Q4_K_M's peak in the bench's pattern 1105 -> 1073 MiB at the same prefill speed (32: 1069,
# a little slower)
MLP_ROWS = 64


class DecoderLayer(nn.Module):
    fixed_order_attention = False  # set by LlamaModel.set_numerics (the int8 mode)
    # rows the MLP takes at a time (set by set_numerics: MLP_ROWS in the integer modes, where a row's
    # result does not depend on the rows beside it; None: all at once, as the exact mode's BLAS needs)
    mlp_rows: int | None = None
    # SwiGLU through kernels/chain.c's silu (layers/swiglu.py): set by set_numerics in the integer modes,
    # where the decode chain computes it that way too
    kernel_silu = False

    def __init__(self, cfg: ModelConfig, index: int, tp: TPShard | None = None) -> None:
        super().__init__()
        self.index = index
        self.tp = tp = tp or TPShard.of(cfg)  # this rank's heads and MLP rows (all of them without tensor parallelism)
        self.num_heads, self.num_kv_heads, self.head_dim = tp.nq, tp.nkv, cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.query_scale or cfg.head_dim**-0.5
        self.window = cfg.layer_window(index)
        self.softcap = cfg.attn_logit_softcap
        self.act = ACTIVATION[cfg.hidden_act]

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, cfg.rms_norm_eps, cfg.norm_offset)

        self.input_norm = norm(cfg.hidden_size)
        self.qkv = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.q_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.attn_out_norm = norm(cfg.hidden_size) if cfg.sandwich_norms else None
        self.post_norm = norm(cfg.hidden_size)  # before the MLP
        self.gate_up = Linear(cfg.hidden_size, 2 * tp.ni, bias=False)
        self.down = Linear(tp.ni, cfg.hidden_size, bias=False)
        self.mlp_out_norm = norm(cfg.hidden_size) if cfg.sandwich_norms else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # ([num_tokens, 1, rotary_dim],) * 2
        batch: AttentionBatch,
    ) -> torch.Tensor:
        x, h = self.forward_split(x, None, cos_sin, batch)
        return x + h

    def forward_split(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        h: torch.Tensor | None,  # [num_tokens, hidden] or None: the input is x + h (x)
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x, h): the output is x + h
        """:meth:`forward` on a residual stream kept as a pair whose sum is not formed yet: the last add
        of a layer happens in the next layer's first norm (one kernel call, kernels/norm_rope.c)."""
        # Submodules are called through .forward: nn.Module.__call__'s hook dispatch costs about a
        # microsecond a call, seven calls a layer, and at batch 1 decode a step is mostly such costs.
        t = x.shape[0]
        if h is None:
            hn = self.input_norm.forward(x)
        else:
            x, hn = self.input_norm.forward_residual(x, h)
        h = self.tp.all_reduce(self.o_proj.forward(self.attend(hn, cos_sin, batch)))  # row-parallel: ranks summed
        x, hn = self.post_norm.forward_residual(x, h if self.attn_out_norm is None else self.attn_out_norm.forward(h))
        del h  # (not held through the MLP: a long prefill's peak)
        c = self.mlp_rows
        if c is None or t <= c:
            h = self.mlp(hn)
        else:  # a long prefill: gate/up of all rows at once would be [t, 2 * ffn] fp32 (64 MB at 512 rows, 1B)
            h = torch.cat([self.mlp(hn[i : i + c]) for i in range(0, t, c)])
        h = self.tp.all_reduce(h)
        return x, (h if self.mlp_out_norm is None else self.mlp_out_norm.forward(h))

    def attend(
        self,
        hn: torch.Tensor,  # [num_tokens, hidden] normed
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] (this rank's heads), before o_proj
        """QKV, RoPE and attention. A method of its own so that Q, K, V and the fused projection are
        freed when it returns, not held through the MLP (at a 512-token prefill of a 1B model ~15 MB)."""
        t = hn.shape[0]
        qkv = self.qkv.forward(hn)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm.forward(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm.forward(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = RotaryEmbedding.rotate(cos_sin, q, k)
        else:  # Q and K heads are adjacent in the fused output: rotate them as one tensor
            qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = RotaryEmbedding.rotate_packed(cos_sin, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        attn = paged_attention(self.index, q, k, v, batch, self.scale, self.window, self.softcap,
                               fixed_order=self.fixed_order_attention)
        return attn.reshape(t, self.q_size)

    def mlp(self, hn: torch.Tensor) -> torch.Tensor:  # [rows, hidden] normed -> [rows, hidden] (this rank's part)
        gu = self.gate_up.forward(hn)
        if self.kernel_silu:
            return self.down.forward(silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down.forward(self.act(gate) * up)


class LlamaModel(nn.Module):
    """Decoder stack + head. ``forward`` returns final hidden states; ``logits`` applies the head.
    ``tp``: the slice of a tensor-parallel rank (models/shard.py); default the whole model."""

    numerics = "exact"  # the block weights' numerics mode (set_numerics)
    step_cost_probe = True  # engine/step_probe.py may time its layers and head (a duck type: the engine names no model)
    decode_chain = True  # integer-mode forwards of up to 64 new tokens through models/decode_chain.py where it applies
    _chain: DecodeChain | None = None

    def __init__(self, cfg: ModelConfig, tp: TPShard | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TPShard.of(cfg)
        self.embed = Embedding(tp.nv, cfg.hidden_size)  # vocab-parallel: this rank's rows
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        rotary = cfg.rotary_dim or cfg.head_dim
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling,
                                    rotary)
        # Gemma 3: sliding layers rotate with their own base, unscaled
        self.local_rope = None if cfg.rope_local_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.rope_local_theta, cfg.max_position_embeddings, None, rotary)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, tp.nv, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        batch: AttentionBatch,
        num_layers: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden] after the final norm
        """Run the first ``num_layers`` layers (all by default; fewer = layer-skip self-draft)."""
        x = self.tp.embed(self.embed, input_ids)
        if self.config.embed_scale != 1.0:  # Gemma; the scale in the activations' dtype, as HF
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        cos_sin = self.rope.cos_sin(batch.positions)
        local = cos_sin if self.local_rope is None else self.local_rope.cos_sin(batch.positions)
        chain = self._chain
        if (chain is not None and x.shape[0] <= chain.MAX_ROWS
                and kernel_reads(batch.cache) and chain.ready()):
            # a few new tokens: the same kernels without the layer-by-layer Python (models/decode_chain.py)
            xs, hs = chain.run(x, cos_sin, batch, num_layers or len(self.layers))
            return self.norm.forward_residual(xs, hs)[1]
        layers = self.layers if not num_layers else self.layers[:num_layers]  # (a slice builds a ModuleList)
        h = None
        for layer in layers:
            assert isinstance(layer, DecoderLayer)
            x, h = layer.forward_split(x, h, local if layer.window is not None else cos_sin, batch)
        return self.norm.forward(x) if h is None else self.norm.forward_residual(x, h)[1]

    def set_numerics(self, numerics: str) -> int:
        """The matmul numerics of every block weight ("exact" | "int8" | "int16", layers/block_quant.py);
        the integer modes also attend in a fixed order per row (its contract is batch invariance, and an
        int8 rounding amplifies SDPA's shape-dependent last bits). Returns the int8 weight count."""
        n = set_numerics(self, numerics)
        self.numerics = numerics
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.fixed_order_attention = numerics != "exact"
            layer.mlp_rows = None if numerics == "exact" else MLP_ROWS
            layer.kernel_silu = numerics != "exact" and self.config.hidden_act == "silu"
        self._chain = DecodeChain.build(self) if self.decode_chain else None
        return n

    def set_context_len(self, n: int) -> None:
        """The engine's context length: fixes context-dependent RoPE (LongRoPE's factor set)."""
        for rope in (self.rope, self.local_rope):
            if rope is not None and rope.context_len != n:
                rope.set_context_len(n)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        """Under tensor parallelism every rank calls this with the same rows; rank 0 gets the logits."""
        if self.lm_head is not None:
            out = self.lm_head(hidden).float()
        else:
            out = self.embed.as_head(hidden)
        out = self.tp.gather_logits(out)
        cap = self.config.final_logit_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    def attach_blocks(self, blocks: dict[str, BlockWeight]) -> set[str]:
        """Give every linear layer (and the embedding) whose weights are all in ``blocks`` (by HF
        name) those blocks in place of its dense weight; a fused layer takes its parts side by side
        (the family's name table says which tensors they are). Call before the dense weights are
        allocated. Returns the names used."""
        sources: dict[str, dict[int | None, str]] = {}  # our linear -> {part: HF tensor}
        for hf, (target, part) in FAMILIES[self.config.architecture].layer_names.items():
            if target in ("qkv", "o_proj", "gate_up", "down"):
                sources.setdefault(target, {})[part] = hf
        groups: list[tuple[Linear | Embedding, str, list[str]]] = [(self.embed, "embed", ["model.embed_tokens.weight"])]
        if self.lm_head is not None:
            groups.append((self.lm_head, "lm_head", ["lm_head.weight"]))
        for i, layer in enumerate(self.layers):
            for target, parts in sources.items():
                pre = f"model.layers.{i}."
                whole = parts.get(None)
                if whole is not None and f"{pre}{whole}.weight" in blocks:
                    names = [f"{pre}{whole}.weight"]
                else:
                    names = [f"{pre}{parts[p]}.weight" for p in sorted(k for k in parts if k is not None)]
                groups.append((getattr(layer, target), target, names))
        used: set[str] = set()
        for module, kind, names in groups:
            if names and all(n in blocks for n in names):
                w = BlockWeight.cat([blocks[n] for n in names])
                if self.tp.size > 1:  # this rank's rows / columns, still views of the same blocks
                    w = self.tp.split_blocks(kind, w, names[-1])
                module.use_blocks(w)
                used.update(names)
        return used

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in the family's HF ``*ForCausalLM`` state dict.

        Separate q/k/v and gate/up tensors are copied into their slices of the fused weights
        (the family's name table says which). Raises ValueError naming any missing or unexpected tensor.
        """
        cfg = self.config
        sizes = {"q": cfg.num_heads * cfg.head_dim, "kv": cfg.num_kv_heads * cfg.head_dim,
                 "inter": cfg.intermediate_size}
        names = FAMILIES[cfg.architecture].layer_names
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, w in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            target, rows = self._map_name(name, names, sizes)
            if target == "lm_head.weight" and self.lm_head is None:
                continue  # tied head: some checkpoints also store the (identical) head
            if target is None:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            if target not in params:
                raise ValueError(f"weight {name!r} maps to {target!r}, which this config does not have")
            p = params[target]
            if self.tp.size > 1:
                self._copy_shard(name, target, rows, w, p)
            else:
                dst = p if rows is None else p[rows[0] : rows[0] + rows[1]]
                if dst.shape != w.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(w.to(dst.dtype))
            seen.add(f"{target}:{rows}")
        # every part of every parameter: q/k/v and gate/up pieces may come separately or fused
        complete = {f"{n}:{None}" for n in params}
        for n in params:
            module, _, kind = n.rpartition(".")
            parts = FUSED_PARTS.get(module.rsplit(".", 1)[-1])
            if parts is not None and kind in ("weight", "bias") and f"{n}:{None}" not in seen:
                complete.discard(f"{n}:{None}")
                complete |= {f"{n}:{r}" for r in _part_rows(parts, sizes)}
        missing = sorted(complete - seen)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(m.split(':')[0] for m in missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''} ({len(missing)} tensors)")

    def _copy_shard(self, name: str, target: str, rows: tuple[int, int] | None, w: torch.Tensor,
                    p: torch.Tensor) -> None:
        """Copy this rank's slices of the full tensor ``w`` (full rows ``rows`` of a fused ``target``, or
        all of it) into its local parameter ``p``."""
        kind = target.split(".")[-2] if target.startswith("layers.") else target.split(".")[0]
        expect = rows[1] if rows is not None else self.tp.full_rows(kind) if kind in COLUMN else None
        if expect is not None and w.shape[0] != expect:
            raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {expect} rows")
        for start, piece in self.tp.split(kind, w, rows[0] if rows is not None else 0):
            dst = p if start is None else p[start : start + piece.shape[0]]
            if dst.shape != piece.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}: its slice on tensor-parallel rank "
                                 f"{self.tp.rank} of {self.tp.size} is {tuple(piece.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(piece.to(dst.dtype))

    @staticmethod
    def _map_name(
        name: str, names: dict[str, tuple[str, int | None]], sizes: dict[str, int]
    ) -> tuple[str | None, tuple[int, int] | None]:
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            return {"embed_tokens.weight": "embed.weight"}.get(name, name), None
        if not name.startswith("layers."):
            return None, None
        _, idx, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")  # e.g. self_attn.q_proj / weight
        if module not in names:
            return None, None
        target, part = names[module]
        rows = None if part is None else _part_rows(FUSED_PARTS[target], sizes)[part]
        return f"layers.{idx}.{target}.{kind}", rows


def _part_rows(parts: tuple[str, ...], sizes: dict[str, int]) -> list[tuple[int, int]]:
    """(start, size) of each part of a fused parameter, in order."""
    out, start = [], 0
    for p in parts:
        out.append((start, sizes[p]))
        start += sizes[p]
    return out
