"""``LLM(tensor_parallel_size=2)`` on CPU (gloo): one worker process holds the other half of every
layer and its own KV cache; rank 0 schedules, plans and samples. Against the same file on one rank:
logits within fp32 tolerance, and greedy output token for token with plain decoding, a batch under
preemption, the prefix cache, and speculative decoding (n-gram chain with chunked continuation,
n-gram tree, layer-skip self-draft: staged rows committed on both ranks)."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.models.loader import ModelLoadError
from tests.models.tiny import engine_logits, hf_model, run, write_gguf
from tests.parallel.conftest import children, engine_on

PROMPTS = [[(7 * i + 3 * j) % 200 + 20 for j in range(9 + 3 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def pair(tiny_gguf):
    one = LLM(tiny_gguf, dtype="float32", progress=False, numerics="exact", kv_cache_blocks=128)
    two = LLM(tiny_gguf, dtype="float32", progress=False, numerics="exact", kv_cache_blocks=128, tensor_parallel_size=2)
    yield one, two
    two.close()


@pytest.fixture(scope="module")
def greedy(pair):
    """Plain greedy decoding on one rank: the oracle for every run below."""
    return run(engine_on(pair[0]), PROMPTS, 24)


def test_each_rank_holds_half_of_every_layer_and_of_the_vocabulary(pair):
    model = pair[1].engine.model
    layer = model.layers[0]
    # 2 of 4 query heads + the one KV head (replicated) for k and v, 16 dims each; 64 of 128 MLP rows
    assert layer.qkv.blocks.shape == ((2 + 1 + 1) * 16, 64)
    assert layer.o_proj.blocks.shape == (64, 32) and layer.gate_up.blocks.shape == (128, 64)
    assert layer.down.blocks.shape == (64, 64)
    assert model.embed.blocks.shape == (129, 64) and model.lm_head.blocks.shape == (129, 64)
    assert pair[1].engine.cache.k.shape[2] == 1  # its KV heads only


def test_logits_match_one_rank_within_fp32_tolerance(pair):
    ids = PROMPTS[5][:20]
    one = engine_logits(pair[0], ids, [0, 7, 12], n_decode=4)
    two = engine_logits(pair[1], ids, [0, 7, 12], n_decode=4)
    assert one.keys() == two.keys()
    for row in one:
        assert two[row].shape == (258,)
        torch.testing.assert_close(two[row], one[row], rtol=0, atol=1e-4)


def test_greedy_batch_is_token_for_token_the_one_rank_output(pair, greedy):
    assert run(engine_on(pair[1]), PROMPTS, 24) == greedy


def test_batch_under_preemption(pair, greedy):
    eng = engine_on(pair[1], kv_cache_blocks=6, block_size=16)
    assert run(eng, PROMPTS, 24) == greedy
    assert eng.scheduler.num_preemptions > 0


def test_prefix_cache_hit_computes_the_same_continuation(pair, greedy):
    eng = engine_on(pair[1])
    assert run(eng, PROMPTS[4:5], 24) == greedy[4:5]
    sid = eng.add_request(PROMPTS[4], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    seq = eng.release(sid)
    assert seq is not None and seq.num_prefix_hit_tokens >= 16 and seq.output_ids == greedy[4]


@pytest.mark.parametrize("options", [
    {"method": "ngram", "depth": 4, "min_n": 1, "depth_schedule": "constant", "chunk_size": 1},
    {"method": "ngram", "num_candidates": 3, "depth": 3, "min_n": 1, "depth_schedule": "constant"},
    {"method": "draft", "draft_layers": 1, "num_candidates": 2, "depth": 3},
], ids=["ngram-chain-scv", "ngram-tree", "self-draft"])
def test_speculative_decoding_is_plain_greedy(pair, greedy, options):
    eng = engine_on(pair[1], decoding="speculative", decoding_options=options)
    assert run(eng, PROMPTS, 24) == greedy
    m = eng.metrics()
    # drafts were accepted and rejected: staged rows committed on both ranks decided later steps
    assert m["spec_decode_num_accepted_tokens"] > 0 and m["kv_staging_tokens_rejected"] > 0, m
    if options.get("chunk_size") == 1:  # SCV: accepted chunks continued in the same step
        assert m["spec_decode_scv_continued_chunks"] > 0, m


def test_generate_text_matches(pair):
    params = SamplingParams(max_tokens=12, temperature=0)
    assert [o.outputs[0].text for o in pair[1].generate(["abc", "hello world"], params)] == \
        [o.outputs[0].text for o in pair[0].generate(["abc", "hello world"], params)]


def test_models_that_cannot_be_split_are_refused_before_any_rank_starts(tiny_gguf):
    before = children()
    with pytest.raises(ModelLoadError, match="must divide the model's 9 attention heads"):
        LLM(None, tensor_parallel_size=2, progress=False, numerics="exact")  # SmolLM2-135M: 9 heads, 3 KV heads
    for method in ("eagle", "eagle_ngram"):  # the head reads the target's embedding and head rows, split over ranks
        with pytest.raises(ValueError, match=f"method='{method}'.*tensor_parallel_size"):
            LLM(tiny_gguf, tensor_parallel_size=2, progress=False, numerics="exact", speculative={"method": method})
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tiny_gguf, tensor_parallel_size=0, progress=False, numerics="exact")
    assert children() == before


def test_fused_checkpoint_tensors_split_in_place(tmp_path):
    """Phi-3 stores q/k/v and gate/up fused: each rank's rows are cut out of the one block tensor."""
    path = str(write_gguf(tmp_path / "phi3.gguf", hf_model("Phi3ForCausalLM"), quant="Q8_0"))
    one = LLM(path, dtype="float32", progress=False, numerics="exact", kv_cache_blocks=32)
    two = LLM(path, dtype="float32", progress=False, numerics="exact", kv_cache_blocks=32, tensor_parallel_size=2)
    try:
        assert len(two.engine.model.layers[0].qkv.blocks.parts) == 3  # q, k, v rows of this rank
        assert run(engine_on(two), PROMPTS[:3], 12) == run(engine_on(one), PROMPTS[:3], 12)
    finally:
        two.close()


def test_local_layer_pools_on_every_rank(tmp_path):
    """Gemma 3 (local, global, local layers; window 8, shorter than the prompts): every rank builds
    the same two pools from rank 0's global block count, the local pool releases behind the window,
    and n-gram drafts are staged and committed into both pools on both ranks: greedy output under
    preemption and speculative output == one rank's."""
    model = hf_model("Gemma3ForCausalLM", sliding_window=8, query_pre_attn_scalar=16,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    path = str(write_gguf(tmp_path / "gemma3.gguf", model, quant="Q8_0", window_flags=True))
    opts = dict(kv_cache_blocks=24, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    one = LLM(path, dtype="float32", progress=False, **opts)
    two = LLM(path, dtype="float32", progress=False, tensor_parallel_size=2, **opts)  # the workers' config
    ngram = dict(decoding="speculative",
                 decoding_options={"method": "ngram", "depth": 4, "num_candidates": 2, "depth_schedule": "constant"})
    try:
        want = run(engine_on(one, **opts), PROMPTS[:4], 24)
        eng = engine_on(two, **opts)
        assert eng.cache.slot_groups == ("kv", "kv_local") and eng.blocks.groups[1].num_blocks < 24
        assert run(eng, PROMPTS[:4], 24) == want and eng.scheduler.num_preemptions > 0
        spec = engine_on(two, **opts, **ngram)
        assert run(spec, PROMPTS[:4], 24) == want
        assert spec.strategy.metrics()["spec_decode_num_accepted_tokens"] > 0
    finally:
        two.close()
