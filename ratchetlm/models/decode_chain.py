"""A forward of up to 64 new tokens (decode steps of a batch, verify chains and trees, short prefills)
through the decoder stack as one C call (kernels/chain.c) on preallocated buffers.

At one new token a layer's kernels take ~80 us on the bundled 135M model and the Python around
them (module calls, views, allocations, argument checks) took longer. In the integer numerics modes
on CPU every op of :meth:`DecoderLayer.forward_split` is already one C kernel (RMSNorm with its
residual add, the packed integer matmuls, RoPE, fixed-order attention, SwiGLU's silu * up), so the
chain's C loop calls the same kernels with the same arguments in the same order, minus the Python
(it was a loop of ctypes calls here until 2026-11-26: ~1 ms a batch-1 step more): the results are
bit-identical to the layer-by-layer path (tests/core/test_decode_chain.py), so batch invariance
(speculative == plain decoding, alone == in a batch) holds whichever path a forward takes.

It applies only where every op has that kernel form (see :meth:`DecodeChain.build`); otherwise, or
for a forward of more rows, the model keeps its general path.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ratchetlm import kernels
from ratchetlm.layers import norm_rope
from ratchetlm.layers.attention import AttentionBatch, kv_half

if TYPE_CHECKING:
    from ratchetlm.kv.cache import KVCache


# The model is models/llama.py's LlamaModel and its layers DecoderLayer: named in comments, not imported
# (llama.py builds its chain here; an import back would be a circle).
def _layers(model: Any) -> list[Any]:
    return list(model.layers)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class DecodeChain:
    """The kernel calls of one forward of up to MAX_ROWS new tokens (packed over its sequences) through
    every layer; see the module docstring."""

    MAX_ROWS = 64

    def __init__(self, model: Any, lib: ctypes.CDLL, lanes: int) -> None:
        cfg = model.config
        self.layers = _layers(model)
        layer0 = self.layers[0]
        self.model, self.lib = model, lib
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
        b = self._bufs = kernels.ChainBuffers(self.nh, self.nkv, self.hd, self.dim, ni, lanes, T, int(self.qk_norm),
                                              self.eps)
        b.xs[0], b.xs[1] = (_ptr(t) for t in self.xs)
        for name in ("hn", "qkv", "qb", "k_all", "v_all", "attn", "o", "down", "qsrc", "ksrc", "qn", "kn"):
            setattr(b, name, _ptr(getattr(self, name)))
        b.gu = _ptr(self.gate_up)
        self._step = kernels.ChainStep()
        self._layers: ctypes.Array = (kernels.ChainLayer * 0)()  # per layer its constants; see ready()
        self._layers_for: str | None = None
        self._cache: weakref.ref[KVCache] | None = None  # the cache whose pools _layers holds

    @classmethod
    def build(cls, model: Any) -> DecodeChain | None:
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
        model's current numerics; the layers' constants then go into one ``ChainLayer`` array."""
        n = self.model.numerics
        if self._layers_for is n:
            return True
        q8s: list[list[tuple]] = []
        for ly in self.layers:
            q8 = [lin._q8_call for lin in (ly.qkv, ly.o_proj, ly.gate_up, ly.down)]
            if any(c is None or c[3] is not n for c in q8):
                return False
            q8s.append([c for c in q8 if c is not None])
        arr = (kernels.ChainLayer * len(self.layers))()
        for c, ly, handles in zip(arr, self.layers, q8s, strict=True):
            assert all(q[0] is self.lib.ratchet_mm_q8w for q in handles)  # the chain calls that kernel itself
            c.w_in, c.w_post = _ptr(ly.input_norm.weight), _ptr(ly.post_norm.weight)
            c.qkv, c.o, c.gu, c.down = (q[1] for q in handles)
            c.qkv_bias = _ptr(ly.qkv.bias) if ly.qkv.bias is not None else None
            if ly.q_norm is not None and ly.k_norm is not None:
                c.q_norm, c.k_norm, c.q_eps, c.k_eps = (_ptr(ly.q_norm.weight), _ptr(ly.k_norm.weight),
                                                        ly.q_norm.eps, ly.k_norm.eps)
            c.scale, c.softcap = ly.scale, ly.softcap or 0.0
        self._layers, self._layers_for, self._cache = arr, n, None
        return True

    def _with_cache(self, cache: KVCache | None) -> ctypes.Array:
        """The layer array with ``cache``'s K/V pools (per layer; NULL without a cache), set when the
        cache changes (a model may serve several engines, one at a time)."""
        if (self._cache() if self._cache is not None else None) is not cache:
            for i, c in enumerate(self._layers):
                kt, vt = cache.layer_kv(i) if cache is not None else (None, None)
                assert cache is None or cache.slot_row(i) == 0  # (no local pools: windows never chain)
                c.kc, c.vc = (None, None) if kt is None or vt is None else (_ptr(kt), _ptr(vt))
            self._cache = None if cache is None else weakref.ref(cache)
        return self._layers

    def run(
        self,
        x: torch.Tensor,  # [T, hidden] the embedded new tokens, packed over the sequences; T <= MAX_ROWS
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # ([T, 1, rotary_dim],) * 2
        batch: AttentionBatch,
        num_layers: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (x, h): the stream after the layers is x + h (fresh tensors)
        t = x.shape[0]
        cache, meta = batch.cache, batch.seq_meta
        assert meta is not None and t <= self.MAX_ROWS and 0 < num_layers <= len(self.layers)
        x = x.contiguous()
        cos, sin = (c.contiguous() for c in cos_sin)
        mask = batch.fixed_order_mask()
        st = self._step
        st.x, st.cos, st.sin, st.meta = _ptr(x), _ptr(cos), _ptr(sin), _ptr(meta)
        st.mask = None if mask is None else _ptr(mask)
        st.slots = batch.slot_rows_ptr(0) if batch.ctx_slots is not None and cache is not None else None
        st.t, st.rd, st.max_ctx, st.max_new, st.B = t, cos.shape[-1], batch.max_ctx, batch.max_new, batch.num_seqs
        st.kv_half, st.num_layers, st.threads = int(kv_half(cache)), num_layers, torch.get_num_threads()
        out = self.lib.ratchet_chain(ctypes.byref(self._bufs), self._with_cache(cache), ctypes.byref(st))
        # the new rows of every layer, once: attention read them from k_all / v_all, never the cache
        batch.sink.write_layers(k=self.k_all[:num_layers, :t], v=self.v_all[:num_layers, :t])
        return self.xs[out][:t].clone(), self.down[:t].clone()
