"""A forward of up to 64 new tokens (decode steps of a batch, verify chains and trees, short prefills)
through the decoder stack as a fixed chain of kernel calls on preallocated buffers.

At one new token a layer's kernels take ~80 us on the bundled 135M model and the Python around
them (module calls, views, allocations, argument checks) took longer. In the integer numerics modes
on CPU every op of :meth:`DecoderLayer.forward_split` is already one C kernel (RMSNorm with its
residual add, the packed integer matmuls, RoPE, fixed-order attention), so this chain calls the
same kernels with the same arguments in the same order, minus the Python: the results are
bit-identical to the layer-by-layer path (tests/core/test_decode_chain.py), so batch invariance
(speculative == plain decoding, alone == in a batch) holds whichever path a forward takes.

It applies only where every op has that kernel form (see :meth:`DecodeChain.build`); otherwise, or
for a forward of more rows, the model keeps its general path.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from ratchetlm import kernels
from ratchetlm.layers import norm_rope
from ratchetlm.layers.attention import AttentionBatch, kv_half

if TYPE_CHECKING:
    from ratchetlm.models.llama import DecoderLayer, LlamaModel


def _layers(model: LlamaModel) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.layers))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class DecodeChain:
    """The kernel calls of one forward of up to MAX_ROWS new tokens (packed over its sequences) through
    every layer; see the module docstring."""

    MAX_ROWS = 64

    def __init__(self, model: LlamaModel, lib: ctypes.CDLL, lanes: int) -> None:
        cfg = model.config
        self.layers = _layers(model)
        layer0 = self.layers[0]
        self.model, self.lib, self.lanes = model, lib, lanes
        self.nh, self.nkv, self.hd = layer0.num_heads, layer0.num_kv_heads, layer0.head_dim
        self.q_size, self.kv_size = layer0.q_size, layer0.kv_size
        self.dim, self.eps = cfg.hidden_size, layer0.input_norm.eps
        f32, T, ni = torch.float32, self.MAX_ROWS, layer0.tp.ni
        # [MAX_ROWS, ...] buffers reused every step (outputs of one kernel, inputs of the next); a step of
        # T rows uses their first T rows (contiguous views)
        self.xs = [torch.empty(T, self.dim, dtype=f32) for _ in range(2)]  # residual stream, ping-pong
        self.hn = torch.empty(T, self.dim, dtype=f32)  # normed input of a matmul
        self.qkv = torch.empty(T, self.q_size + 2 * self.kv_size, dtype=f32)
        self.qb = torch.empty(T, self.nh, self.hd, dtype=f32)  # rotated Q (attention's input)
        # every layer's new K (rotated) and V, [layers, T, nkv, hd]: attention reads them here, and the
        # sink takes them for all layers at once after the stack (write_layers: one copy per pool, where
        # a write per layer cost ~15-25 us of Python each)
        L = len(self.layers)
        self.k_all = torch.empty(L, T, self.nkv, self.hd, dtype=f32)
        self.v_all = torch.empty(L, T, self.nkv, self.hd, dtype=f32)
        self.attn = torch.empty(T, self.nh, self.hd, dtype=f32)
        self.o = torch.empty(T, self.dim, dtype=f32)
        self.down = torch.empty(T, self.dim, dtype=f32)
        self.qk_norm = cfg.qk_norm  # Qwen3: per-head norms of Q and K before RoPE: their inputs and outputs
        self.qsrc = torch.empty(T, self.q_size, dtype=f32)
        self.ksrc = torch.empty(T, self.kv_size, dtype=f32)
        self.qn = torch.empty(T, self.nh, self.hd, dtype=f32)
        self.kn = torch.empty(T, self.nkv, self.hd, dtype=f32)
        self.gate_up = torch.empty(T, 2 * ni, dtype=f32)
        self.act = torch.empty(T, ni, dtype=f32)
        # per layer: the norm weights' addresses (the layers give scale, soft-cap and Linear handles)
        self.norm_w = [(_ptr(ly.input_norm.weight), _ptr(ly.post_norm.weight)) for ly in self.layers]
        self._calls: list[tuple] = []  # per layer ((fn, handle) of qkv, o_proj, gate_up, down); see ready()
        self._calls_for: str | None = None

    @classmethod
    def build(cls, model: LlamaModel) -> DecodeChain | None:
        """A chain for ``model`` if every op of its layers is one C kernel (CPU fp32, integer numerics,
        Llama-shaped layers, with Qwen2's Q/K/V biases and Qwen3's QK-norms; no sandwich norms, norm
        offsets, sliding windows, tensor parallelism or GELU), else None."""
        from ratchetlm.layers.block_quant import Linear

        cfg = model.config
        lib = kernels.load()
        if lib is None or model.numerics == "exact" or model.tp.size != 1 or cfg.hidden_act != "silu":
            return None
        if cfg.sandwich_norms or cfg.norm_offset:
            return None
        if cfg.hidden_size >= norm_rope.TORCH_GRAIN:
            return None
        lanes = norm_rope._norm_lanes()
        if not lanes:
            return None
        for ly in _layers(model):
            if ly.window is not None or not ly.fixed_order_attention:
                return None
            norms = [ly.input_norm, ly.post_norm] + ([ly.q_norm, ly.k_norm] if cfg.qk_norm else [])
            for p in [n.weight for n in norms if n is not None] + ([ly.qkv.bias] if ly.qkv.bias is not None else []):
                if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                    return None
            for lin in (ly.qkv, ly.o_proj, ly.gate_up, ly.down):
                if not isinstance(lin, Linear) or (lin.bias is not None and lin is not ly.qkv):
                    return None
        return cls(model, lib, lanes)

    def ready(self) -> bool:
        """Every matmul has its packed integer handle (made by its first general-path call) for the
        model's current numerics; the (function, handle) pairs are then kept per layer."""
        n = self.model.numerics
        if self._calls_for is n:
            return True
        calls = []
        for ly in self.layers:
            q8 = [lin._q8_call for lin in (ly.qkv, ly.o_proj, ly.gate_up, ly.down)]
            if any(c is None or c[3] is not n for c in q8):
                return False
            calls.append(tuple((c[0], c[1]) for c in q8 if c is not None))
        self._calls, self._calls_for = calls, n
        return True

    def run(
        self,
        x: torch.Tensor,  # [T, hidden] the embedded new tokens, packed over the sequences; T <= MAX_ROWS
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # ([T, 1, rotary_dim],) * 2
        batch: AttentionBatch,
        num_layers: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x, h): the stream after the layers is x + h (fresh tensors)
        lib, lanes, eps, dim, nt = self.lib, self.lanes, self.eps, self.dim, torch.get_num_threads()
        t = x.shape[0]
        cos, sin = (c.contiguous() for c in cos_sin)
        rd, cos_p, sin_p = cos.shape[-1], _ptr(cos), _ptr(sin)
        nh, nkv, hd, qs, kvs = self.nh, self.nkv, self.hd, self.q_size, self.kv_size
        xs = [b[:t] for b in self.xs]
        hn, qkv, attn = self.hn[:t], self.qkv[:t], self.attn[:t]
        o, down, gu, act = self.o[:t], self.down[:t], self.gate_up[:t], self.act[:t]
        k_all, v_all = self.k_all[:num_layers, :t], self.v_all[:num_layers, :t]  # [L, t, nkv, hd]
        qkv_p, attn_p, hn_p, gu_p, act_p, q_p = _ptr(qkv), _ptr(attn), _ptr(hn), _ptr(gu), _ptr(act), _ptr(self.qb)
        xs_p = [_ptr(b) for b in xs]
        kv_stride = 4 * self.MAX_ROWS * nkv * hd  # bytes from one layer's K (V) rows to the next's
        k0, v0 = _ptr(self.k_all), _ptr(self.v_all)
        v = qkv[:, qs + kvs:].view(t, nkv, hd)
        gate, up = gu.chunk(2, dim=-1)
        cache, meta = batch.cache, batch.seq_meta
        assert meta is not None and t <= self.MAX_ROWS
        half = int(kv_half(cache))
        mask = batch.fixed_order_mask()
        mask_p = 0 if mask is None else _ptr(mask)
        x = x.contiguous()
        x_p, h_p, nxt = _ptr(x), 0, 0  # the stream is x (+ h); residual sums go to xs[nxt], never in place
        for i in range(num_layers):
            ly = self.layers[i]
            w_in, w_post = self.norm_w[i]
            k_p, v_p = k0 + i * kv_stride, v0 + i * kv_stride  # this layer's K, V: [t, nkv, hd] contiguous
            (qkv_fn, qkv_w), (o_fn, o_w), (gu_fn, gu_w), (d_fn, d_w) = self._calls[i]
            if h_p:  # the previous layer's last residual add, fused into this norm
                lib.ratchet_rms_norm(x_p, h_p, xs_p[nxt], w_in, t, dim, eps, lanes, hn_p, nt)
                x_p, nxt = xs_p[nxt], nxt ^ 1
            else:
                lib.ratchet_rms_norm(x_p, None, None, w_in, t, dim, eps, lanes, hn_p, nt)
            qkv_fn(hn_p, t, qkv_w, qkv_p, nt)
            if ly.qkv.bias is not None:  # Qwen2 (Linear.forward's y + bias, in place)
                torch.add(qkv, ly.qkv.bias, out=qkv)
            if self.qk_norm:  # Qwen3: norm each head of Q and of K, then rotate each (RotaryEmbedding.rotate)
                assert ly.q_norm is not None and ly.k_norm is not None
                qsrc, ksrc = qkv_p, qkv_p + 4 * qs
                if t > 1:  # the norms read contiguous heads
                    self.qsrc[:t].copy_(qkv[:, :qs])
                    self.ksrc[:t].copy_(qkv[:, qs:qs + kvs])
                    qsrc, ksrc = _ptr(self.qsrc), _ptr(self.ksrc)
                qn, kn = _ptr(self.qn), _ptr(self.kn)
                lib.ratchet_rms_norm(qsrc, None, None, _ptr(ly.q_norm.weight), t * nh, hd, ly.q_norm.eps, lanes, qn, nt)
                lib.ratchet_rms_norm(ksrc, None, None, _ptr(ly.k_norm.weight), t * nkv, hd, ly.k_norm.eps, lanes, kn,
                                     nt)
                lib.ratchet_rope(qn, t, nh, hd, nh * hd, cos_p, sin_p, rd, q_p)
                lib.ratchet_rope(kn, t, nkv, hd, nkv * hd, cos_p, sin_p, rd, k_p)
            else:  # Q and K heads of the fused output (RotaryEmbedding.rotate_packed rotates them as one;
                # each head on its own, so two calls give the same bits), into attention's contiguous inputs
                lib.ratchet_rope(qkv_p, t, nh, hd, qs + 2 * kvs, cos_p, sin_p, rd, q_p)
                lib.ratchet_rope(qkv_p + 4 * qs, t, nkv, hd, qs + 2 * kvs, cos_p, sin_p, rd, k_p)
            v_all[i].copy_(v)
            kc = vc = slots = 0
            if batch.ctx_slots is not None and cache is not None:
                kt, vt = cache.layer_kv(i)
                kc, vc, slots = _ptr(kt), _ptr(vt), batch.slot_rows_ptr(cache.slot_row(i))
            lib.ratchet_attention(q_p, k_p, v_p, kc, vc, slots, batch.max_ctx, _ptr(meta), batch.max_new, mask_p,
                                  batch.num_seqs, nh, nkv, hd, ly.scale, ly.softcap or 0.0, half, attn_p, nt)
            o_fn(attn_p, t, o_w, _ptr(o), nt)
            lib.ratchet_rms_norm(x_p, _ptr(o), xs_p[nxt], w_post, t, dim, eps, lanes, hn_p, nt)
            x_p, nxt = xs_p[nxt], nxt ^ 1
            gu_fn(hn_p, t, gu_w, gu_p, nt)
            torch.mul(F.silu(gate), up, out=act)
            d_fn(act_p, t, d_w, _ptr(down), nt)
            h_p = _ptr(down)
        # the new rows of every layer, once: attention above read them from k_all / v_all, never the cache
        batch.sink.write_layers(k=k_all, v=v_all)
        return xs[nxt ^ 1].clone(), down.clone()
