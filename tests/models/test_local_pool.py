"""Gemma's local layers in a KV pool of their own (engine/layer_groups.py): as a sequence grows past
its window, the blocks (and bytes) its sliding layers hold stay bounded while the global layers keep
the whole context; the text is HF's greedy text and the same as with one pool that keeps every
block; batched, preempted, speculative and prefix-cached runs equal alone; a prefix hit needs the
local pool to still hold the window before it ends."""

from __future__ import annotations

import pytest

from ratchetlm import LLM, SamplingParams
from ratchetlm.engine import model_runner
from ratchetlm.kv.block_manager import BlockManager
from ratchetlm.kv.cache import KVCache
from tests.core.prefix_oracle import assert_cached_blocks_match_prefill
from tests.models.tiny import drain, engine_on, hf_logits, hf_model, save_hf

WINDOW, BLOCK, CHUNK = 16, 4, 8
PROMPT = list(b"The ratchet only moves forward and the window slides along with it. ")  # 68 tokens
NEW = 90  # 158 positions = 40 blocks


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    model = hf_model("Gemma3ForCausalLM", sliding_window=WINDOW, query_pre_attn_scalar=16,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    llm = LLM(str(save_hf(tmp_path_factory.mktemp("gemma3"), model)), progress=False, dtype="float32")
    return model, llm


def _run(engine, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[list[int]], list[tuple[int, int]]]:
    """Greedy to completion: outputs, all tokens, and the blocks in use in the (global, local) pools
    at every forward."""
    used = []
    execute = engine.runner.execute

    def counting(*args, **kwargs):
        used.append(tuple(g.num_blocks - g.num_free for g in engine.blocks.groups))
        return execute(*args, **kwargs)

    engine.runner.execute = counting
    sids = [engine.add_request(p, _greedy(n)) for p in prompts]
    drain(engine)
    seqs = [engine.release(s) for s in sids]
    return [s.output_ids for s in seqs], [s.token_ids for s in seqs], used


def _one_pool(monkeypatch) -> None:
    """The layout before local pools: every layer in one pool that keeps every block."""
    def one(cfg, mc, kv_heads, dtype, device, max_model_len, local, cache_key):
        n = cfg.kv_cache_blocks
        return (KVCache(mc.num_layers, n, cfg.block_size, kv_heads, mc.head_dim, dtype, device),
                BlockManager(n, cfg.block_size, enable_caching=cfg.enable_prefix_caching, cache_key=cache_key))
    monkeypatch.setattr(model_runner, "grouped_cache", one)


def test_local_blocks_stay_bounded_global_keep_everything(gemma, monkeypatch):
    model, llm = gemma
    eng = engine_on(llm, kv_cache_blocks=64, block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=1)
    full, local = eng.blocks.groups
    assert eng.cache.slot_groups == ("kv", "kv_local") and list(eng.cache.layers("k_local")) == [0, 2]
    assert local.window == WINDOW and full.window is None
    # the local pool: one sequence's window + one step; the sequence's local K/V would need 40 blocks
    assert local.num_blocks == 8 < local.blocks_needed(len(PROMPT) + NEW)
    assert eng.cache.stacked["k_local"].shape == (2, 8 * BLOCK, 2, 16)  # its bytes: 8 blocks of 2 layers, not 64
    assert list(eng.cache.layers("k")) == [1]  # the pool that keeps every block holds the global layer only
    writes: dict[int, set[str]] = {}  # layer -> pools its new K/V rows went to
    write = eng.cache.write

    def recording(pool, layer, values, slots):
        writes.setdefault(layer, set()).add(pool)
        return write(pool, layer, values, slots)

    monkeypatch.setattr(eng.cache, "write", recording)
    (out,), _, used = _run(eng, [PROMPT], NEW)
    assert writes == {0: {"k_local", "v_local"}, 1: {"k", "v"}, 2: {"k_local", "v_local"}}
    ids = list(PROMPT)
    for _ in range(NEW):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    assert out == ids[len(PROMPT):]
    assert max(u for _, u in used) <= local.blocks_held(len(PROMPT) + NEW, CHUNK) == 7, used
    assert max(u for u, _ in used) == full.blocks_needed(len(PROMPT) + NEW - 1)  # (the last token has no K/V)
    # in bytes: a block of one layer's K+V is 4 x 2 heads x 16 dims x 4 bytes x 2; the local layers
    # hold 7 blocks of 2 layers at most, the global layer all 40 -- not 40 blocks of 3 layers
    layer_block = BLOCK * 2 * 16 * 4 * 2
    block_bytes = [BLOCK * (eng.cache.row_bytes(k) + eng.cache.row_bytes(v)) for k, v in (("k", "v"),
                                                                                          ("k_local", "v_local"))]
    assert block_bytes == [layer_block, 2 * layer_block]
    peak = max(g * block_bytes[0] + u * block_bytes[1] for g, u in used)
    assert peak <= (40 + 2 * 7) * layer_block < 40 * 3 * layer_block, peak
    audit = eng.blocks.audit()
    assert audit["referenced"] == audit["local_referenced"] == 0

    _one_pool(monkeypatch)  # the same model on a cache that keeps every local block
    kept = engine_on(llm, kv_cache_blocks=64, block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=1)
    assert not hasattr(kept.blocks, "groups")
    sid = kept.add_request(PROMPT, _greedy(NEW))
    drain(kept)
    assert kept.release(sid).output_ids == out


def test_batched_preempted_and_speculative_equal_alone(gemma):
    _, llm = gemma
    prompts = [PROMPT, PROMPT[::-1], list(b"abcabcabcabcabcabcabcabc" * 3)]
    alone = [llm.generate([p], _greedy(NEW))[0].outputs[0].token_ids for p in prompts]
    tight = engine_on(llm, kv_cache_blocks=48, block_size=BLOCK, max_num_batched_tokens=CHUNK + 2, max_num_seqs=3)
    got, _, used = _run(tight, prompts, NEW)
    assert got == alone and tight.scheduler.num_preemptions > 0
    local = tight.blocks.groups[1]
    assert max(u for _, u in used) <= 3 * local.blocks_held(10**6, CHUNK + 2) < 3 * 40
    for opts in ({"method": "ngram", "depth": 4, "num_candidates": 2, "depth_schedule": "constant"},
                 {"method": "draft", "draft_layers": 1, "depth": 3, "depth_schedule": "constant"}):
        spec = engine_on(llm, kv_cache_blocks=128, block_size=BLOCK, max_num_batched_tokens=2 * CHUNK,
                         decoding="speculative", decoding_options=opts)
        got, histories, _ = _run(spec, prompts, NEW)
        histories = [h[:-1] for h in histories]  # (the last token has no K/V)
        assert got == alone, opts["method"]
        assert spec.strategy.metrics()["spec_decode_num_drafts"] > 0
        # no rejected draft row reached either pool: every named block holds a plain prefill's K/V
        assert assert_cached_blocks_match_prefill(spec, histories, atol=1e-4) > 0


def test_prefix_hits_need_the_local_window(gemma):
    """A long sequence leaves all its blocks named in the global pool but only its last ones in the
    small local pool: a prompt ending where the local pool still holds the window hits; one ending
    in the middle cannot (its local window was evicted) and computes everything. Same text either way."""
    _, llm = gemma
    eng = engine_on(llm, kv_cache_blocks=64, block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=1)
    _, (done,), _ = _run(eng, [PROMPT], NEW)  # 158 tokens, 157 with K/V: blocks 0-38 named
    for cut, hit in ((155, 152), (81, 0)):
        hits = eng.blocks.stats.hits
        (out,), _, _ = _run(eng, [done[:cut]], 3)
        assert eng.blocks.stats.hits - hits == hit, cut
        assert out == done[cut : cut + 3]
    audit = eng.blocks.audit()
    assert audit["referenced"] == audit["local_referenced"] == 0
    assert audit["cached_unreferenced"] >= 39 and audit["local_cached_unreferenced"] <= 8
