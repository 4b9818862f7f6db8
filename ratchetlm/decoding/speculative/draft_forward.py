"""One forward of a draft model outside the engine's step, on a paged cache of its choosing.

Used by the model-based proposers: the layer-skip self-draft (the target's own model and
cache, first N layers) and a separate draft model (its own model and cache). Each sequence
feeds ``n_i`` tokens on top of ``ctx_slots[i]`` committed context rows; K/V go to ``sink``
(a :class:`~ratchetlm.kv.sink.NullSink` for write-free draft steps, a
:class:`~ratchetlm.kv.sink.DirectSink` for catching the draft cache up on committed tokens).
Attention reads the new tokens' K/V from the forward itself, so writing nothing is exact.
"""

from __future__ import annotations

import torch

from ratchetlm.kv.cache import KVCache
from ratchetlm.kv.sink import KVSink
from ratchetlm.layers.attention import build_attention_batch
from ratchetlm.models.llama import LlamaModel


@torch.inference_mode()
def draft_forward(
    model: LlamaModel,
    cache: KVCache,
    ctx_slots: list[torch.Tensor],  # per seq [context_len] int64 slots in ``cache``
    tokens: list[list[int]],  # per seq [n_i] tokens fed on top of the context
    positions: list[list[int]],  # per seq [n_i] absolute RoPE positions
    masks: list[torch.Tensor | None],  # per seq [n_i, n_i] bool visibility, None = causal
    rows: list[list[int]],  # per seq rows whose logits are wanted
    sink: KVSink,
    num_layers: int | None = None,
    ctx_starts: list[int] | None = None,  # per seq position of its first context row (None: all 0)
) -> list[torch.Tensor]:  # per seq [len(rows_i), vocab] fp32
    dev = cache.device
    pos = torch.tensor([p for pp in positions for p in pp], dtype=torch.long, device=dev)
    ids = torch.tensor([t for tt in tokens for t in tt], dtype=torch.long, device=dev)
    batch = build_attention_batch(pos, [len(t) for t in tokens], ctx_slots, masks, sink, cache,
                                  dtype=cache.dtype, ctx_starts=ctx_starts)
    hidden = model(ids, batch, num_layers=num_layers)
    flat, o = [], 0
    for tt, rr in zip(tokens, rows, strict=True):
        flat += [o + r for r in rr]
        o += len(tt)
    logits = model.logits(hidden[torch.tensor(flat, dtype=torch.long, device=dev)]).cpu()
    out, o = [], 0
    for rr in rows:
        out.append(logits[o : o + len(rr)])
        o += len(rr)
    return out
