"""benchmarks/bench_specbench.py's plumbing (not its speed): the shipped Spec-Bench file's six groups, the
second MT-bench turn built on the model's own first answer, MAL counted per target forward, greedy
identity against AR, and --configs validated against the proposer registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from .bench_script import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_specbench")


def test_the_shipped_question_file_has_six_groups_of_80_and_its_license(bench):
    qs = bench.load_questions()
    assert list(qs) == ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert all(len(v) == 80 for v in qs.values())
    assert all(len(q["turns"]) == 2 for q in qs["mt_bench"])
    assert all(len(q["turns"]) == 1 for g in bench.SINGLE for q in qs[g])
    data = ROOT / "benchmarks" / "data" / "spec_bench"
    assert "Apache License" in (data / "LICENSE").read_text()
    assert "hemingkx/Spec-Bench" in (data / "NOTICE").read_text()


def test_a_subset_of_groups_draws_the_questions_a_full_run_draws(bench):
    qs = bench.load_questions()
    full = bench.draw_sample(qs, 2, 0, list(bench.GROUPS))
    part = bench.draw_sample(qs, 2, 0, ["qa", "rag"])
    assert list(part) == ["qa", "rag"] and part["qa"] == full["qa"] and part["rag"] == full["rag"]
    assert all(len(v) == 2 for v in full.values())
    assert bench.draw_sample(qs, 2, 1, ["qa"])["qa"] != full["qa"]  # the seed matters


def test_configs_are_registry_names_with_options(bench):
    assert bench.parse_config("default") == ("default", {})
    assert bench.parse_config("ngram:depth=4,depth_schedule=constant") == (
        "ngram:depth=4,depth_schedule=constant", {"method": "ngram", "depth": 4, "depth_schedule": "constant"})
    with pytest.raises(ValueError, match="speculative method must be one of"):
        bench.parse_config("no-such-proposer")
    with pytest.raises(ValueError, match="unknown speculative option"):
        bench.parse_config("ngram:colour=3")
    with pytest.raises(SystemExit, match="--configs"):
        bench.main(["--configs", "no-such-proposer"])


def test_a_tiny_run_on_the_default_model(bench, capsys):
    out = bench.main(["--configs", "ngram:depth_schedule=constant", "--per-group", "1", "--max-tokens", "8",
                      "--groups", "mt_bench", "qa", "--threads", "1", "--batch", "2"])
    cases = out["cases"]
    assert [(c.group, c.turn) for c in cases] == [("mt_bench", 1), ("mt_bench", 2), ("qa", 1)]
    first, second = cases[0], cases[1]
    assert out["chat"]  # the default model has a chat template
    llm_text = capsys.readouterr().out
    # turn 2 is asked after the model's own first answer: its prompt holds that answer
    tok = out["llm"].tokenizer
    answer = tok.decode(first.runs["AR"].tokens, skip_special_tokens=True).strip()
    assert answer and answer in tok.decode(second.prompt)
    assert len(second.prompt) > len(first.prompt) + len(first.runs["AR"].tokens) - 2
    name = "ngram:depth_schedule=constant"
    for c in cases:
        assert set(c.runs) == {"AR", name}
        assert 1 <= len(c.runs["AR"].tokens) <= 8
        assert c.runs[name].tokens == c.runs["AR"].tokens  # greedy identity
        ar = c.runs["AR"]
        assert ar.decode_forwards == ar.decode_tokens  # AR: one token per forward after the first
    rows = out["rows"]
    assert {g for (_, g) in rows} == {"mt_bench", "qa", "overall"}
    overall = rows[(name, "overall")]
    assert overall["same"] == overall["n"] == 3
    assert 1.0 <= overall["mal"] <= 8 and overall["speedup"] > 0
    # Spec-Bench's own speed-up (evaluation/speed.py): the mean of per-question tokens/s (MT-bench's two
    # turns one question) over AR's mean, from the same runs
    def speed(label, turns):
        return sum(len(c.runs[label].tokens) for c in turns) / sum(c.runs[label].seconds for c in turns)
    questions = [cases[:2], cases[2:]]
    expect = (sum(speed(name, q) for q in questions) / 2) / (sum(speed("AR", q) for q in questions) / 2)
    assert overall["specbench"] == pytest.approx(expect) and "Spec-Bench speed-up" in llm_text
    assert "| overall | 3 |" in llm_text and "MAL" in llm_text
    ratios = sorted(speed(name, [c]) / speed("AR", [c]) for c in cases)  # per case, as the spread line reads
    assert (overall["lowest"], overall["p10"]) == (pytest.approx(ratios[0]), pytest.approx(ratios[0]))
    assert overall["below"] == sum(r < 1.0 for r in ratios) and f"{overall['below']} of 3 below 1.0x" in llm_text
    # the decode phase: its speed-up is MAL over a step's cost in AR steps (forwards after the first token)
    assert overall["decode_speedup"] == pytest.approx(overall["mal"] / overall["step_cost"])
    assert overall["step_cost"] > 0 and "step cost" in llm_text
    # prefill's share of AR's time bounds any end-to-end speed-up
    share = rows[("AR", "overall")]["prefill_share"]
    ar_runs = [c.runs["AR"] for c in cases]
    assert share == pytest.approx(1 - sum(r.decode_seconds for r in ar_runs) / sum(r.seconds for r in ar_runs))
    assert 0 < share < 1 and "AR's time in prefill" in llm_text
    # --batch 2: the two first turns at once, identical to AR's
    assert out["batched"][name]["same"] == out["batched"][name]["n"] == 2
    assert out["batched"][name]["speedup"] > 0 and "batches of 2 different prompts" in llm_text
    assert out["batched"][name]["decode_speedup"] > 0 and "decode phase" in llm_text


def test_lockstep_alternates_engines_and_times_each_by_its_own_steps(bench, spec_llm, encoded, reference,
                                                                       monkeypatch):
    """--interleave step: one step of each engine in turn while both have work; each engine's seconds are
    the sum of its own steps (a clock that ticks once per reading: 1 per step), its decode phase the steps
    with no prompt computed or waiting, and its tokens are its own."""
    from .conftest import GREEDY, make_engine

    ticks = iter(range(10**6))
    monkeypatch.setattr(bench, "CLOCK", lambda: float(next(ticks)))
    engines = {"AR": make_engine(spec_llm), "ngram": make_engine(spec_llm, "speculative")}
    order: list[str] = []
    for label, eng in engines.items():
        real = eng.step
        monkeypatch.setattr(eng, "step", lambda _r=real, _l=label: order.append(_l) or _r())
    out = bench.lockstep(engines, encoded[:2], GREEDY)
    n_ar, n_spec = order.count("AR"), order.count("ngram")
    assert n_spec < n_ar  # the drafts saved steps
    assert order[: 2 * n_spec] == ["AR", "ngram"] * n_spec and set(order[2 * n_spec:]) == {"AR"}
    assert out["AR"].seconds == n_ar and out["ngram"].seconds == n_spec
    for label in engines:
        assert [r.tokens for r in out[label].runs] == reference[:2]
        assert 0 < out[label].decode_seconds < out[label].seconds
        assert out[label].decode_tokens <= sum(len(r.tokens) for r in out[label].runs)
        assert max(r.seconds for r in out[label].runs) == out[label].seconds  # the last request ends with the run
