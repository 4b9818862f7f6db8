"""benchmarks/sim_drafts.py's replay (not its numbers): a step commits the agreed prefix of its draft plus one
token, steps and costs are counted as a greedy speculative run would count them, and the oracle drafts exactly
as far as the continuation agrees."""

from __future__ import annotations

import pytest

from ratchetlm.decoding.speculative.cost_curve import CostCurve

from .bench_script import load_benchmark

FREE = CostCurve((1, 2), (1.0, 1.0))  # a verify costs a plain step, whatever its rows


@pytest.fixture(scope="module")
def sim():
    return load_benchmark("sim_drafts")


def no_prefill(p: int) -> float:
    return 0.0


def test_an_output_that_copies_its_prompt_commits_depth_plus_one_tokens_a_step_under_the_oracle(sim) -> None:
    prompt = list(range(100, 160))
    out = list(range(110, 147))  # the prompt from its 11th token, 37 tokens: 36 after the first
    case = sim.Case("qa", 1, prompt, out)
    r = sim.replay([case], "oracle", sim.Cost(FREE, 0.0), no_prefill)
    assert r["mal"] == 36 / 4  # 8 drafted and accepted + 1 a step: 9 + 9 + 9 + 9
    assert r["decode"] == pytest.approx(36 / 4)  # AR pays 36 one-row steps, the drafts 4 of the same price
    assert r["groups"]["qa"] == (9.0, pytest.approx(9.0))


def test_text_that_never_repeats_a_token_is_never_drafted_and_costs_what_plain_decoding_does(sim) -> None:
    case = sim.Case("rag", 2, list(range(1000, 1050)), list(range(2000, 2030)))
    for policy in ("engine", "vote", "history", "oracle-length", "oracle"):
        r = sim.replay([case], policy, sim.Cost(CostCurve((1, 2), (1.0, 1.5)), 0.2), no_prefill)
        assert r["mal"] == 1.0 and r["decode"] == pytest.approx(1.0)


def test_a_rejected_draft_commits_one_token_and_pays_its_step(sim) -> None:
    # "1 2 3" in the prompt, then "1" followed by "5": the copy drafts "2 3 ...", the target says "5"
    prompt = [7, 1, 2, 3, 9, 8, 4]
    out = [1, 5, 6]
    cost = sim.Cost(FREE, 0.5)  # rows free (the gain rule drafts), a drafted step 0.5 dearer
    r = sim.replay([sim.Case("qa", 3, prompt, out)], "engine", cost, no_prefill)
    assert r["mal"] == 1.0  # two steps, one token each
    assert r["decode"] == pytest.approx(2 / (1.5 + 1.0))  # the drafted step after "1", then a plain one after "5"
    r = sim.replay([sim.Case("qa", 3, prompt, out)], "oracle", cost, no_prefill)
    assert r["mal"] == 1.0 and r["decode"] == 1.0  # the oracle drafts nothing that disagrees, so pays nothing
