"""WeDLM window decoding under tensor parallelism: the bundled trained WeDLM model (Qwen3 layout,
QK-norm, tied head, 4 heads / 2 KV heads: one KV head per rank) split over 2 ranks decodes the
held-out prompts token for token as on one rank, several tokens per forward."""

from __future__ import annotations

from pathlib import Path

import pytest

from ratchetlm import LLM, SamplingParams
from ratchetlm.training.corpus import held_out
from tests.parallel.conftest import engine_on

TRAINED = str(Path(__file__).resolve().parents[2] / "ratchetlm" / "assets" / "wedlm-tiny")


@pytest.fixture(scope="module")
def pair():
    one = LLM(TRAINED, dtype="float32", progress=False, max_model_len=256)
    two = LLM(TRAINED, dtype="float32", progress=False, max_model_len=256, tensor_parallel_size=2)
    yield one, two
    two.close()


@pytest.mark.parametrize("window, tau", [(8, 0.4), (16, 0.8)])
def test_wedlm_on_two_ranks_is_the_one_rank_output(pair, window, tau):
    assert pair[1].engine.cache.k.shape[2] == 1
    prompts = [pair[0].tokenize(ex.prompt) for ex in held_out(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    outs = []
    for llm in pair:
        eng = engine_on(llm, decoding="wedlm", decoding_options=dict(window_size=window, entropy_threshold=tau),
                        kv_cache_blocks=64, max_model_len=256)
        ids = [eng.add_request(p, params) for p in prompts]
        most = 0  # most tokens one sequence committed in one step
        while eng.has_unfinished():
            most = max([most] + [len(o.new_token_ids) for o in eng.step()])
        outs.append(([eng.seqs[i].output_ids for i in ids], most))
    assert outs[1][0] == outs[0][0]
    assert outs[1][1] > 1  # not vacuous: windows committed several tokens in one forward
