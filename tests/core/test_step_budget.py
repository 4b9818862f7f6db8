"""The step-time budget: while streams decode, a long prompt is fed in chunks the cost model keeps
under ``max_step_ms``; decode rows are scheduled first in every step; the output is the same token
for token as with the prompt fed whole."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from ratchetlm import SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.engine.step_cost import (
    SAMPLE_EVERY,
    STRETCH_MIN,
    LinearStepCost,
    MeasuredStepCost,
    Prior,
    Rows,
    reads,
)

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


def long_prompt(llm, tokens: int = LONG) -> list[int]:
    return llm.tokenize(" ".join(f"item{i}" for i in range(400)))[:tokens]


def run_mixed(llm, max_step_ms: float, cost=FAKE, stream_tokens: int = STREAM, prompt_tokens: int = LONG,
              engine=None, **kwargs):
    """Four streams decode; then a ``prompt_tokens``-token prompt arrives. Returns (outputs by request, the
    schedule of every step after it arrived: [(seq_id, tokens, prefilling, context)], stream ids,
    long id); ``engine`` receives the engine."""
    eng = engine_on(llm, max_step_ms=max_step_ms, **kwargs)
    if engine is not None:
        engine.append(eng)
    eng.scheduler.cost = cost
    enc = llm.tokenize
    streams = [eng.add_request(enc(f"Count slowly from {i} upwards:"), greedy(stream_tokens)) for i in range(4)]
    for _ in range(3):  # admitted and prefilled together, then decoding
        eng.step()
    assert all(eng.seqs[s].num_output_tokens >= 2 for s in streams)
    long = eng.add_request(long_prompt(llm, prompt_tokens), greedy(4))
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


def predicted(step, cost=FAKE) -> float:
    return cost.predict_ms([Rows.prefill(n, c) if pf else Rows.decode(n, c) for _, n, pf, c in step])


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


def test_decode_rows_over_the_target_stretch_the_step_to_a_multiple_of_their_own_time(llm_default):
    """A machine too busy for the target: the prompt's chunks fill STRETCH_MIN x the decode rows'
    time (the prompt keeps most of each step) instead of crawling at a few tokens a step."""
    busy = LinearStepCost(fixed=20.0, per_row=1.0, per_logit=0.5, per_context=0.002)
    _, steps, _, long = run_mixed(llm_default, 3.0, busy)  # four decode rows alone predict ~26 ms
    chunks = []
    for st in steps:
        chunk = [(n, c) for sid, n, pf, c in st if sid == long and pf]
        if chunk and chunk[0][0] + chunk[0][1] < LONG:  # (not the last chunk: what was left)
            decodes = [Rows.decode(n, c) for _, n, pf, c in st if not pf]
            budget = STRETCH_MIN * busy.predict_ms(decodes)
            # the largest chunk under the stretched budget: one more token would not fit
            assert 3.0 < predicted(st, busy) <= budget < predicted(st, busy) + 1.0 + busy.per_context * LONG, st
            chunks.append(chunk[0][0])
    assert chunks and min(chunks) > 16, chunks


@dataclass
class PromptHeavy:
    """A fake cost (ms) in which a prompt row is dearer the more it attends to: a row through the LM
    head (every decode and draft row, a chunk's last) 1 ms; each other row of a chunk after ``c``
    cached tokens ``scale`` x (1 + c / 4) ms. Beside four decode rows (a 15 ms step at least:
    STRETCH_MIN x 4 ms) a chunk is 11 tokens at the prompt's start, then 3, then 2, then 1 (from about
    its 37th token); ``scale`` = the rows a stream decodes a step keeps about that schedule.
    With ``sample_every``, every ``sample_every``-th step that could feed the prompt holds the decode
    rows alone (as MeasuredStepCost asks, to re-measure them)."""

    scale: float = 1.0
    sample_every: int = 0
    asked: int = 0

    def predict_ms(self, rows: list[Rows]) -> float:
        return sum(r.logits + (r.n - r.logits) * self.scale * (1 + r.context / 4) for r in rows)

    def decode_ms(self, rows: list[Rows]) -> float:
        return self.predict_ms(rows)

    def wants_decode_sample(self) -> bool:
        self.asked += 1
        return bool(self.sample_every) and self.asked % self.sample_every == 0

    def observe(self, rows: list[Rows], ms: float) -> None:
        return None


SMALL = {"prompt_tokens": 64, "stream_tokens": 48}


@pytest.fixture(scope="module")
def plain_small(llm_default):
    """The reference: the 64-token prompt fed whole (no step-time budget), plain decoding."""
    return run_mixed(llm_default, math.inf, **SMALL)[0]


@pytest.mark.parametrize(("decoding", "scale"), [
    ({}, 1.0),
    ({"decoding": "speculative", "decoding_options": {"method": "ngram"}}, 9.0),  # a row and 8 drafts a stream
], ids=["autoregressive", "ngram"])
def test_chunks_of_a_few_tokens_give_the_same_tokens_as_the_whole_prompt(llm_default, plain_small, decoding, scale):
    """Chunks of 1 to 12 tokens that end anywhere in a KV block (beside an n-gram strategy's drafts,
    too): every request's greedy output equals plain decoding's with the prompt fed whole, token for
    token."""
    outs, steps, _, long = run_mixed(llm_default, 1.0, PromptHeavy(scale), **SMALL, **decoding)
    chunks = [n for st in steps for sid, n, pf, _ in st if sid == long and pf]
    assert sum(chunks) == 64 and chunks.count(1) >= 5 and any(n % 16 for n in chunks[:-1]), chunks
    if not decoding:
        assert chunks[:6] == [11, 3, 3, 2, 2, 2] and chunks[-15:] == [1] * 15, chunks
    assert list(outs.values()) == list(plain_small.values())


def test_decode_only_sample_steps_while_a_prompt_is_fed_change_no_token(llm_default, plain_small):
    """Every third step that could feed the prompt holds the streams' decode rows alone (the measured
    cost model's re-measurement): those steps feed no prompt token, the prompt still completes, and
    every output equals plain decoding's with the prompt fed whole."""
    outs, steps, streams, long = run_mixed(llm_default, 1.0, PromptHeavy(sample_every=3), **SMALL)
    fed = [sum(n for sid, n, pf, _ in st if sid == long and pf) for st in steps]
    first, last = next(i for i, n in enumerate(fed) if n), max(i for i, n in enumerate(fed) if n)
    gaps = [i for i in range(first, last) if not fed[i]]
    assert sum(fed) == 64 and len(gaps) >= 5, fed
    for i in gaps:  # the streams decoded in those steps
        assert sorted(sid for sid, *_ in steps[i]) == sorted(streams), steps[i]
    assert list(outs.values()) == list(plain_small.values())


def test_tiny_chunks_under_preemption_and_prefix_caching(llm_default, plain_small):
    """A pool too small for the streams and the prompt: the prompt, fed a few tokens a step, is
    preempted (its partial block freed), re-hits its own committed blocks and resumes mid-prompt; a
    later request with the same prompt starts from its cached blocks. Outputs equal plain decoding's,
    and the block bookkeeping is whole."""
    engine: list[LLMEngine] = []
    # prompt rows 13/11 as dear: the chunks of a 10 ms share of the step (8, 3, 3, 2, ..., 1 from position
    # 28), slow enough that the streams outgrow the pool before the prompt is in
    outs, _, _, long = run_mixed(llm_default, 1.0, PromptHeavy(13 / 11), engine=engine, kv_cache_blocks=18, **SMALL)
    eng = engine[0]
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.stats.recompute_hits > 0
    assert list(outs.values()) == list(plain_small.values())
    again = eng.add_request(long_prompt(llm_default, 64), greedy(4))
    while eng.has_unfinished():
        eng.step()
    seq = eng.release(again)
    assert seq.num_prefix_hit_tokens == 48 and seq.output_ids == plain_small[long]
    assert eng.blocks.audit()["referenced"] == 0


def test_measured_cost_learns_fixed_and_per_row_parts_from_the_steps():
    """The prior says 10 ms + 1 ms a row; the machine really takes 30 ms + 3 ms a row: after a mix of
    decode-only and prompt-chunk steps the fit predicts both kinds within a few percent."""
    prior = Prior(fixed=10.0, per_row=1.0, head=0.0, attention=0.0)
    cost = MeasuredStepCost(lambda _stop: prior, warmup=1)
    decode, chunk = [Rows.decode(1, 50)] * 4, [*[Rows.decode(1, 50)] * 4, Rows.prefill(60, 0)]
    assert cost.predict_ms(decode) == pytest.approx(14.0) and cost.predict_ms(chunk) == pytest.approx(74.0)
    cost.observe(decode, 1000.0)  # warm-up: ignored
    assert (cost.fixed, cost.per_row) == (10.0, 1.0)
    for i in range(60):
        rows = chunk if i % 3 == 0 else decode
        cost.observe(rows, 30.0 + 3.0 * sum(r.n for r in rows))
    assert cost.predict_ms(decode) == pytest.approx(42.0, rel=0.05)
    assert cost.predict_ms(chunk) == pytest.approx(222.0, rel=0.05)
    assert cost.fixed > 0 and cost.per_row > 0


def test_measured_cost_learns_what_a_cached_token_costs():
    """The prior knows nothing of attention; the machine pays 5 us a row for each cached token it reads
    and 20 us a sequence for each cached token it holds (the K/V read once). After decode steps at
    growing contexts and chunk steps of 4 to 16 rows at contexts growing to 1,950 (a long prompt being
    fed), the next chunks' steps are predicted within a few percent, a 2-row one (mostly the
    sequence's K/V read) within 10%."""
    prior = Prior(fixed=10.0, per_row=1.0, head=0.0, attention=0.0)
    cost = MeasuredStepCost(lambda _stop: prior, warmup=0)
    cost.calibrate()

    def truth(rows):
        return 8.0 + 2.0 * sum(r.n for r in rows) + 0.005 * reads(rows) + 0.02 * sum(r.context for r in rows)

    for i in range(80):
        decode = [Rows.decode(1, 40 + i + 10 * j) for j in range(4)]
        rows = decode if i % 2 else [*decode, Rows.prefill(4 + i % 13, 25 * i)]
        cost.observe(rows, truth(rows))
    for k, rel in ((12, 0.03), (8, 0.05), (2, 0.1)):
        late = [*(Rows.decode(1, 150) for _ in range(4)), Rows.prefill(k, 2000)]
        assert cost.predict_ms(late) == pytest.approx(truth(late), rel=rel), k
    assert cost.per_read > 0 and cost.per_context > 0


def decoding_at_30_ms() -> tuple[MeasuredStepCost, list[Rows]]:
    """A cost model that has seen 30 steps of four decode rows, each taking 30 ms; and those rows."""
    cost = MeasuredStepCost(lambda _stop: Prior(fixed=10.0, per_row=5.0, head=0.0, attention=0.0), warmup=0)
    cost.calibrate()
    decode = [Rows.decode(1, 100)] * 4
    for _ in range(30):
        cost.observe(decode, 30.0)
    return cost, decode


def test_a_long_prompt_does_not_move_what_a_decode_step_is_predicted_to_cost():
    """Decode steps measured 30 ms; then a hundred chunk steps all take 60 ms more than the fit
    expects of their rows (a cost the model's rows do not explain). The decode steps' prediction,
    which the budget scales, stays near 30 ms: a step is forgotten only by newer steps of its kind,
    and the chunk steps' common cost goes to ``per_chunk``."""
    cost, decode = decoding_at_30_ms()
    assert cost.predict_ms(decode) == pytest.approx(30.0, rel=0.02)
    for i in range(100):
        rows = [*decode, Rows.prefill(8 + i % 3, 20 * i)]
        cost.observe(rows, 30.0 + 5.0 * rows[-1].n + 60.0)
    assert cost.predict_ms(decode) == pytest.approx(30.0, rel=0.05)
    assert cost.predict_ms([*decode, Rows.prefill(9, 2000)]) == pytest.approx(30.0 + 45.0 + 60.0, rel=0.05)


def test_an_outlier_step_moves_the_fit_a_bounded_amount():
    prior = Prior(fixed=10.0, per_row=1.0, head=0.0, attention=0.0)
    cost = MeasuredStepCost(lambda _stop: prior, warmup=0)
    cost.calibrate()
    rows = [Rows.decode(1, 0)] * 4
    cost.observe(rows, 1e6)  # a page fault storm: counted as 4x the prediction at most
    assert 14.0 < cost.predict_ms(rows) < 4 * 14.0


def chunk_steps(cost: MeasuredStepCost, n: int, ms: float, start: int = 0) -> None:
    """``n`` steps of four decode rows and an 8-token chunk at a growing context, each taking ``ms``
    x what a decode step takes (30 ms at load 1)."""
    for i in range(start, start + n):
        cost.observe([*[Rows.decode(1, 100 + i)] * 4, Rows.prefill(8 + i % 5, 20 * i)], ms)


def test_the_decode_time_the_budget_scales_follows_the_machine_while_a_prompt_is_fed():
    """Decode steps take 30 ms; a prompt's chunk steps begin (120 ms); after 40 of them the machine
    gets twice as slow (chunk steps 240 ms) and only the decode-only steps the scheduler is asked for
    every SAMPLE_EVERY chunk steps measure the decode rows (60 ms). What the budget scales
    (``decode_ms``) is 30 ms before and 60 ms once three such samples arrived (the median of the last
    five), while the fit's own decode prediction, held by the decode steps of long ago, lags; one
    outlier sample (a 600 ms stall) does not move it."""
    cost, decode = decoding_at_30_ms()
    assert not cost.wants_decode_sample()
    chunk_steps(cost, 40, 120.0)
    assert cost.decode_ms(decode) == pytest.approx(30.0, rel=0.02)
    samples = 0
    for i in range(40, 40 + 7 * (SAMPLE_EVERY + 1)):
        if cost.wants_decode_sample():
            samples += 1
            cost.observe(decode, 600.0 if samples == 4 else 60.0)
        chunk_steps(cost, 1, 240.0, start=i)
        if samples == 2:
            assert cost.decode_ms(decode) < 45.0  # two of five: the median is still the old time
        if samples == 3:  # three of five; the fit alone (what the budget scaled before) still lags
            assert cost.decode_ms(decode) == pytest.approx(60.0, rel=0.1) and cost.predict_ms(decode) < 45.0
    assert samples >= 6
    assert cost.decode_ms(decode) == pytest.approx(60.0, rel=0.05)


def test_a_decode_sample_is_asked_for_every_sample_every_chunk_steps_and_taken_once():
    cost = MeasuredStepCost(lambda _stop: Prior(fixed=10.0, per_row=1.0, head=0.0, attention=0.0), warmup=0,
                            sample_every=3)
    cost.calibrate()
    chunk_steps(cost, 2, 50.0)
    assert not cost.wants_decode_sample()
    chunk_steps(cost, 1, 50.0)
    assert cost.wants_decode_sample() and not cost.wants_decode_sample()  # taken: not asked for twice
    chunk_steps(cost, 2, 50.0)
    cost.observe([Rows.decode(1, 10)], 12.0)  # a decode-only step restarts the count
    chunk_steps(cost, 2, 50.0)
    assert not cost.wants_decode_sample()
    chunk_steps(cost, 1, 50.0)
    assert cost.wants_decode_sample()


def test_the_lazy_refit_gives_the_fit_of_a_refit_every_step(monkeypatch):
    """The parts are solved only when a prediction needs them (or every ``refit_every`` steps), yet
    they equal those of a model solved after every step; a decode-only stream of 64 steps solves 4
    times, and a second prediction with no step between solves nothing."""
    from ratchetlm.engine import step_cost

    prior = Prior(fixed=10.0, per_row=1.0, head=0.2, attention=1e-3)
    lazy = MeasuredStepCost(lambda _stop: prior, warmup=0)
    eager = MeasuredStepCost(lambda _stop: prior, warmup=0, refit_every=1)
    solves = [0]
    solve = step_cost.nonnegative_least_squares

    def counted(a, b):
        solves[0] += 1
        return solve(a, b)

    monkeypatch.setattr(step_cost, "nonnegative_least_squares", counted)
    for cost in (lazy, eager):
        cost.calibrate()
    for i in range(64):
        rows = [Rows.decode(1 + i % 3, 50 + i) for _ in range(4)]
        for cost in (lazy, eager):
            cost.observe(rows, 20.0 + 2.0 * sum(r.n for r in rows) + 0.01 * i)
    assert solves[0] == 64 + 4
    for i in range(30):
        rows = [Rows.decode(1, 120), Rows.prefill(5 + i % 7, 40 * i)]
        for cost in (lazy, eager):
            cost.observe(rows, 30.0 + 3.0 * rows[1].n + 0.02 * rows[1].context)
    solves[0] = 0
    assert lazy.parts() == pytest.approx(eager.parts(), rel=1e-9, abs=1e-12)
    probe = [Rows.decode(1, 200), Rows.prefill(9, 1500)]
    assert lazy.predict_ms(probe) == pytest.approx(eager.predict_ms(probe), rel=1e-9)
    assert solves[0] == 1  # the lazy model's one solve; the eager one had none pending


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "100"])
def test_max_step_ms_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="max_step_ms"):
        EngineConfig(max_step_ms=bad)


def test_max_step_ms_defaults_by_device_and_maps_to_its_flag():
    assert EngineConfig().step_time_target() == 60.0
    assert EngineConfig(max_step_ms=math.inf).step_time_target() == math.inf
    import argparse

    from ratchetlm.cli import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--max-step-ms", "40"]))["max_step_ms"] == 40.0
    assert engine_kwargs(p.parse_args([]))["max_step_ms"] is None


def test_steps_before_the_probe_are_fitted_once_it_runs():
    """An offline engine probes when a prompt first needs a chunk: the decode steps before it (here
    45 ms, the probe says 14) are what the budget then scales, not the probe's guess."""
    cost = MeasuredStepCost(lambda _stop: Prior(fixed=10.0, per_row=1.0, head=0.0, attention=0.0), warmup=2)
    decode = [Rows.decode(1, 100)] * 4
    for _ in range(40):
        cost.observe(decode, 45.0)
    assert cost.prior is None
    assert cost.decode_ms(decode) == pytest.approx(45.0, rel=0.02)
    assert cost.observed == 32  # the last 2 x refit_every of them


class _CountingModel:
    """The model, counting its forwards (attributes pass through)."""

    def __init__(self, model) -> None:
        self.model, self.forwards = model, 0

    def __call__(self, *args, **kwargs):
        self.forwards += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_the_probe_stops_before_its_next_forward_once_asked(llm_default):
    """A server shutting down asks the engine thread's probe to stop: it raises ProbeStopped before
    its next forward (a process must not exit while a thread is inside one), and runs whole otherwise."""
    from ratchetlm.engine.step_probe import ProbeStopped, probe_prior

    eng = llm_default.engine
    model = _CountingModel(eng.model)
    with pytest.raises(ProbeStopped):
        probe_prior(model, llm_default.model_config, eng.device, eng.dtype, stop=lambda: model.forwards >= 2)
    assert model.forwards == 2
    whole = probe_prior(model, llm_default.model_config, eng.device, eng.dtype, repeats=1)
    assert whole.per_row > 0 and model.forwards > 4
    cost = MeasuredStepCost(lambda stop: probe_prior(model, llm_default.model_config, eng.device, eng.dtype,
                                                     stop=stop))
    with pytest.raises(ProbeStopped):
        cost.calibrate(stop=lambda: True)
    assert cost.prior is None  # probed again when next needed
