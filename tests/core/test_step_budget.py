"""The step-time budget: while streams decode, a long prompt is fed in chunks the cost model keeps
under ``max_step_ms``; decode rows are scheduled first in every step; the output is the same token
for token as with the prompt fed whole."""

from __future__ import annotations

import math

import pytest

from ratchetlm import SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.engine.step_cost import LinearStepCost, MeasuredStepCost, Rows, Shape

# a deterministic cost model (ms): the schedule must not depend on how busy the test machine is
FAKE = LinearStepCost(fixed=2.0, per_row=1.0, per_logit=0.5, per_context=0.002)
TARGET = 40.0
LONG = 200  # prompt tokens
STREAM = 24  # tokens each stream generates


def engine_on(llm, **kwargs) -> LLMEngine:
    cfg = EngineConfig(**{"dtype": "float32", "progress": False, "kv_cache_blocks": 96, **kwargs})
    return LLMEngine(cfg, llm.engine.model, llm.model_config)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_mixed(llm, max_step_ms: float, cost=FAKE):
    """Four streams decode; then a LONG-token prompt arrives. Returns (outputs by request, the
    schedule of every step after it arrived: [(seq_id, tokens, prefilling, context)], long id)."""
    eng = engine_on(llm, max_step_ms=max_step_ms)
    eng.scheduler.cost = cost
    enc = llm.encode
    streams = [eng.add_request(enc(f"Count slowly from {i} upwards:"), greedy(STREAM)) for i in range(4)]
    for _ in range(3):  # admitted and prefilled together, then decoding
        eng.step()
    assert all(eng.seqs[s].num_output_tokens >= 2 for s in streams)
    text = " ".join(f"item{i}" for i in range(400))
    long_prompt = enc(text)[:LONG]
    long = eng.add_request(long_prompt, greedy(4))
    steps: list[list[tuple[int, int, bool, int]]] = []
    schedule = eng.scheduler.schedule

    def recorded():
        out = schedule()
        steps.append([(s.seq_id, n, eng.scheduler.prefilling(s), s.num_cached) for s, n in out])
        return out

    eng.scheduler.schedule = recorded  # type: ignore[method-assign]
    while eng.has_unfinished():
        eng.step()
    outs = {sid: eng.release(sid).output_ids for sid in [*streams, long]}
    return outs, steps, streams, long


def predicted(step) -> float:
    return FAKE.predict_ms([Rows.prefill(n, c) if pf else Rows.decode(n, c) for _, n, pf, c in step])


@pytest.fixture(scope="module")
def chunked(llm_default):
    return run_mixed(llm_default, TARGET)


def test_long_prompt_is_chunked_under_the_target_and_decodes_are_never_starved(chunked):
    outs, steps, streams, long = chunked
    prompt_steps = [st for st in steps if any(sid == long and pf for sid, _, pf, _ in st)]
    chunks = [n for st in prompt_steps for sid, n, pf, _ in st if sid == long and pf]
    assert sum(chunks) == LONG and len(chunks) > 1, chunks
    for st in prompt_steps:
        kinds = [pf for _, _, pf, _ in st]
        assert kinds == sorted(kinds)  # decode rows first, then the prompt chunk
        assert sum(1 for sid, *_ in st if sid in streams) == 4  # every stream is still decoding
        assert predicted(st) <= TARGET, st
    # the chunk adapts to what the step holds: the prompt's own context (and the streams') grows,
    # so the chunks shrink; the last one is what is left
    assert chunks[:-1] == sorted(chunks[:-1], reverse=True) and chunks[0] > chunks[-2], chunks
    # each stream is in every step from the prompt's arrival until it finished
    for sid in streams:
        ran = [i for i, st in enumerate(steps) if any(s == sid for s, *_ in st)]
        assert ran == list(range(len(ran))) and len(ran) == STREAM - 3, (sid, ran)


def test_chunked_prefill_gives_the_same_tokens_as_the_whole_prompt(llm_default, chunked):
    whole, whole_steps, _, whole_long = run_mixed(llm_default, math.inf)
    assert [n for st in whole_steps for sid, n, pf, _ in st if sid == whole_long and pf] == [LONG]
    assert list(chunked[0].values()) == list(whole.values())


def test_without_decode_rows_a_prompt_takes_the_whole_token_budget(llm_default):
    """Nobody waits for a token: the prompt is not chunked (idle TTFT is unchanged)."""
    eng = engine_on(llm_default, max_step_ms=1.0)
    eng.scheduler.cost = FAKE
    sid = eng.add_request(list(range(100, 100 + LONG)), greedy(1))
    out = eng.scheduler.schedule()
    assert [(s.seq_id, n) for s, n in out] == [(sid, LONG)]


def test_a_step_over_the_target_still_feeds_a_minimum_chunk(llm_default):
    """Decode rows alone over the target: the prompt still advances by ``min_chunk`` (block_size)."""
    _, steps, _, long = run_mixed(llm_default, 3.0)  # four decode rows alone predict 12 ms
    chunks = [n for st in steps for sid, n, pf, _ in st if sid == long and pf]
    assert chunks[:-1] == [16] * (len(chunks) - 1) and sum(chunks) == LONG


def test_measured_cost_scales_to_the_observed_steps():
    shape = Shape(rows=(1, 8, 64), body=(1.0, 2.0, 16.0), head=0.1, attention=0.001, one_row_ms=10.0)
    cost = MeasuredStepCost(lambda: shape, alpha=0.5, warmup=1)
    rows = [Rows.decode(1, 100), Rows.prefill(63, 0)]
    units = 16.0 + 0.1 * 2 + 0.001 * (1 * 100.5 + 63 * 31.5)
    assert cost.predict_ms(rows) == pytest.approx(10.0 * units)
    cost.observe(rows, 15.0 * units)  # warm-up: ignored
    assert cost.ms_per_unit == 10.0
    cost.observe(rows, 15.0 * units)  # half way to 15 ms a unit
    assert cost.ms_per_unit == pytest.approx(12.5)
    cost.observe(rows, 1000.0 * units)  # an outlier moves the scale at most 2x before averaging
    assert cost.ms_per_unit == pytest.approx(12.5 + 0.5 * (25.0 - 12.5))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "100"])
def test_max_step_ms_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="max_step_ms"):
        EngineConfig(max_step_ms=bad)


def test_max_step_ms_defaults_by_device_and_maps_to_its_flag():
    assert EngineConfig().step_time_target() == 100.0
    assert EngineConfig(max_step_ms=math.inf).step_time_target() == math.inf
    import argparse

    from ratchetlm.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--max-step-ms", "40"]))["max_step_ms"] == 40.0
    assert engine_kwargs(p.parse_args([]))["max_step_ms"] is None
