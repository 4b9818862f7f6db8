"""Batch-1 decode of the decoder stack as a fixed chain of kernel calls on preallocated buffers.

At one new token a layer's kernels take ~80 us on the bundled 135M model and the Python around
them (module calls, views, allocations, argument checks) took longer. In the integer numerics modes
on CPU every op of :meth:`DecoderLayer.forward_split` is already one C kernel (RMSNorm with its
residual add, the packed integer matmuls, RoPE, fixed-order attention), so this chain calls the
same kernels with the same arguments in the same order, minus the Python: the results are
bit-identical to the layer-by-layer path (tests/core/test_decode_chain.py), so batch invariance
(speculative == plain decoding) still holds with verify forwards taking the general path.

It applies only where every op has that kernel form (see :meth:`DecodeChain.build`); otherwise, or
for any step that is not one sequence with one new token, the model keeps its general path.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from ratchetlm import kernels
from ratchetlm.layers import norm_rope
from ratchetlm.layers.attention import AttentionBatch

if TYPE_CHECKING:
    from ratchetlm.models.llama import DecoderLayer, LlamaModel


def _layers(model: LlamaModel) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.layers))


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class DecodeChain:
    """The kernel calls of one batch-1 decode step through every layer; see the module docstring."""

    def __init__(self, model: LlamaModel, lib: ctypes.CDLL, lanes: int) -> None:
        cfg = model.config
        self.layers = _layers(model)
        layer0 = self.layers[0]
        self.model, self.lib, self.lanes = model, lib, lanes
        self.nh, self.nkv, self.hd = layer0.num_heads, layer0.num_kv_heads, layer0.head_dim
        self.q_size, self.kv_size = layer0.q_size, layer0.kv_size
        self.dim, self.eps = cfg.hidden_size, layer0.input_norm.eps
        f32 = torch.float32
        # [1, ...] buffers reused every step (outputs of one kernel, inputs of the next)
        self.xs = [torch.empty(1, self.dim, dtype=f32) for _ in range(2)]  # residual stream, ping-pong
        self.hn = torch.empty(1, self.dim, dtype=f32)  # normed input of a matmul
        self.qkv = torch.empty(1, self.q_size + 2 * self.kv_size, dtype=f32)
        self.rot = torch.empty(1, self.nh + self.nkv, self.hd, dtype=f32)  # rotated Q and K heads
        self.attn = torch.empty(1, self.nh, self.hd, dtype=f32)
        self.o = torch.empty(1, self.dim, dtype=f32)
        self.down = torch.empty(1, self.dim, dtype=f32)
        self.gate_up = torch.empty(1, 2 * layer0.tp.ni, dtype=f32)
        self.act = torch.empty(1, layer0.tp.ni, dtype=f32)
        # per layer: the norm weights' addresses (the layers give scale, soft-cap and Linear handles)
        self.norm_w = [(_ptr(ly.input_norm.weight), _ptr(ly.post_norm.weight)) for ly in self.layers]
        self._calls: list[tuple] = []  # per layer ((fn, handle) of qkv, o_proj, gate_up, down); see ready()
        self._calls_for: str | None = None

    @classmethod
    def build(cls, model: LlamaModel) -> DecodeChain | None:
        """A chain for ``model`` if every op of its layers has the single-kernel form at batch 1 (CPU fp32,
        integer numerics, plain Llama layers: no biases, QK-norms, sandwich norms, norm offsets, sliding
        windows, tensor parallelism or GELU), else None."""
        from ratchetlm.layers.block_quant import Linear

        cfg = model.config
        lib = kernels.load()
        if lib is None or model.numerics == "exact" or model.tp.size != 1 or cfg.hidden_act != "silu":
            return None
        if cfg.qk_norm or cfg.sandwich_norms or cfg.norm_offset or cfg.attention_bias:
            return None
        if cfg.hidden_size >= norm_rope.TORCH_GRAIN:
            return None
        lanes = norm_rope._norm_lanes()
        if not lanes:
            return None
        for ly in _layers(model):
            if ly.window is not None or not ly.fixed_order_attention:
                return None
            for p in (ly.input_norm.weight, ly.post_norm.weight):
                if p.dtype != torch.float32 or p.device.type != "cpu":
                    return None
            for lin in (ly.qkv, ly.o_proj, ly.gate_up, ly.down):
                if not isinstance(lin, Linear) or lin.bias is not None:
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
        x: torch.Tensor,  # [1, hidden] the embedded token
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # ([1, 1, rotary_dim],) * 2
        batch: AttentionBatch,
        num_layers: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x, h): the stream after the layers is x + h (fresh tensors)
        lib, lanes, eps, dim, nt = self.lib, self.lanes, self.eps, self.dim, torch.get_num_threads()
        cos, sin = (c.contiguous() for c in cos_sin)
        rd = cos.shape[-1]
        nh, nkv, hd = self.nh, self.nkv, self.hd
        xs, hn, qkv, rot, attn, o, down, gu, act = (self.xs, self.hn, self.qkv, self.rot, self.attn, self.o,
                                                   self.down, self.gate_up, self.act)
        q_ptr, rot_ptr, attn_ptr = _ptr(qkv), _ptr(rot), _ptr(attn)
        k_ptr, v_ptr = rot_ptr + 4 * nh * hd, q_ptr + 4 * (self.q_size + self.kv_size)
        k = rot[:, nh:]  # [1, nkv, hd] views the sink writes
        v = qkv[:, self.q_size + self.kv_size:].view(1, nkv, hd)
        gate, up = gu.chunk(2, dim=-1)
        cache, meta = batch.cache, batch.seq_meta
        assert meta is not None and batch.num_seqs == 1 and batch.max_new == 1 and batch.mask is None
        x = x.contiguous()
        x_ptr, h_ptr, nxt = _ptr(x), 0, 0  # the stream is x (+ h); residual sums go to xs[nxt], never in place
        for i in range(num_layers):
            ly = self.layers[i]
            w_in, w_post = self.norm_w[i]
            (qkv_fn, qkv_w), (o_fn, o_w), (gu_fn, gu_w), (d_fn, d_w) = self._calls[i]
            if h_ptr:  # the previous layer's last residual add, fused into this norm
                lib.ratchet_rms_norm(x_ptr, h_ptr, _ptr(xs[nxt]), w_in, 1, dim, eps, lanes, _ptr(hn), nt)
                x_ptr, nxt = _ptr(xs[nxt]), nxt ^ 1
            else:
                lib.ratchet_rms_norm(x_ptr, None, None, w_in, 1, dim, eps, lanes, _ptr(hn), nt)
            qkv_fn(_ptr(hn), 1, qkv_w, q_ptr, nt)
            lib.ratchet_rope(q_ptr, 1, nh + nkv, hd, self.q_size + 2 * self.kv_size, _ptr(cos), _ptr(sin), rd, rot_ptr)
            batch.sink.write(i, **({"k": k, "v": v} if cache is None else cache.rows(i, k, v)))
            kc = vc = slots = 0
            if batch.ctx_slots is not None and cache is not None:
                kt, vt = cache.layer_kv(i)
                kc, vc, slots = _ptr(kt), _ptr(vt), batch.slot_rows_ptr(cache.slot_row(i))
            lib.ratchet_attention(rot_ptr, k_ptr, v_ptr, kc, vc, slots, batch.max_ctx, _ptr(meta), 1, 0, 1, nh, nkv,
                                  hd, ly.scale, ly.softcap or 0.0, attn_ptr, nt)
            o_fn(attn_ptr, 1, o_w, _ptr(o), nt)
            lib.ratchet_rms_norm(x_ptr, _ptr(o), _ptr(xs[nxt]), w_post, 1, dim, eps, lanes, _ptr(hn), nt)
            x_ptr, nxt = _ptr(xs[nxt]), nxt ^ 1
            gu_fn(_ptr(hn), 1, gu_w, _ptr(gu), nt)
            torch.mul(F.silu(gate), up, out=act)
            d_fn(_ptr(act), 1, d_w, _ptr(down), nt)
            h_ptr = _ptr(down)
        return xs[nxt ^ 1].clone(), down.clone()
