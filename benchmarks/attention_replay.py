"""A decode step's attention calls replayed alone, on the step's own buffers.

``AttentionReplay()`` wraps ``DecodeChain.run`` (of whichever ratchetlm tree is imported) to keep the last
step's chain, batch and layer count; ``ms(threads)`` then calls ``kernels/attention.c`` once per layer as the
chain did (same queries, cache, slots and thread count) and returns the milliseconds the calls took on
``clock`` (wall by default; ``time.thread_time`` for CPU time on a shared machine). ``four_streams`` builds the
scenario both use. Used by bench_attention_context.py and bench_chunk_cost.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ratchetlm.models.decode_chain as decode_chain
from ratchetlm import SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.layers.attention import kv_half


def four_streams(llm: Any, ids: list[int], cached: int) -> LLMEngine:
    """A fresh engine (defaults) on ``llm``'s model with four greedy streams prefilled to ``cached`` tokens of
    ``ids`` each (offset by 7 tokens, so no prefix is shared) and one token decoded."""
    eng = LLMEngine(EngineConfig(progress=False), llm.engine.model, llm.model_config)
    for i in range(4):
        eng.add_request(ids[i * 7 : i * 7 + cached], SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True))
    while any(not s.output_ids for s in eng.seqs.values()):
        eng.step()
    return eng


class AttentionReplay:
    def __init__(self) -> None:
        self.last: dict[str, Any] = {}
        run = decode_chain.DecodeChain.run
        last = self.last

        def recorded(chain: Any, x: Any, cos_sin: Any, batch: Any, num_layers: int) -> Any:
            last.update(chain=chain, batch=batch, layers=num_layers)
            return run(chain, x, cos_sin, batch, num_layers)

        decode_chain.DecodeChain.run = recorded  # type: ignore[method-assign]

    def ms(self, threads: int, clock: Callable[[], float] = time.perf_counter) -> float:
        ch, b = self.last["chain"], self.last["batch"]
        slots, half = b.slot_rows_ptr(0), int(kv_half(b.cache))
        t0 = clock()
        for i in range(self.last["layers"]):
            kc, vc = b.cache.layer_kv(i)
            ch.lib.ratchet_attention(ch.qb.data_ptr(), ch.k_all[i].data_ptr(), ch.v_all[i].data_ptr(), kc.data_ptr(),
                                     vc.data_ptr(), slots, b.max_ctx, b.seq_meta.data_ptr(), b.max_new, 0, b.num_seqs,
                                     ch.nh, ch.nkv, ch.hd, 0.125, 0.0, half, ch.attn.data_ptr(), threads)
        return (clock() - t0) * 1e3
