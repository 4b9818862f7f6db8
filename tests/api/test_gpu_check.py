"""benchmarks/gpu_check.py (issue 39), the one device run that proves and times the CUDA path, runs
end to end on a CPU in its dry-run mode (tiny random models, few tokens): every section is in its
JSON with real numbers, the oracles it checks hold (fp32 greedy == HF transformers, batched == alone,
speculative == plain AR), and the Markdown page names the machine and versions beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_check")
    # its `pytest -m cuda tests/cuda` subprocess without the test environment's heavy pytest plugins, which
    # the CUDA tests do not use (importing schemathesis, hypothesis and anyio: ~3 of its ~7 CPU-s here)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": str(out),
           "PYTEST_ADDOPTS": "-p no:schemathesis -p no:hypothesispytest -p no:anyio"}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--dry-run"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


@pytest.mark.slow
def test_every_section_ran_and_recorded_its_numbers(dry_run):
    report, _ = dry_run
    from benchmarks.gpu_check_report import SECTIONS

    assert set(report["sections"]) == set(SECTIONS)
    for name, s in report["sections"].items():
        assert s["status"] == "ok", (name, s)
    tests = report["sections"]["cuda_tests"]
    assert tests["failed"] == tests["test_errors"] == 0
    assert tests["passed"] + tests["skipped"] >= 16  # collected the CUDA tests (skipped: no GPU here)
    decode = report["sections"]["decode"]
    assert decode["batches"] == [1, 2] and len(decode["rows"]) == 2
    for row in decode["rows"]:
        for b in decode["batches"]:
            for what in ("ours", "hf eager", "hf static+compile"):
                assert row[f"{what} b{b}"] > 0, (row, what, b)
    for curve in report["sections"]["cost_curve"]["curves"]:
        assert len(curve["ms"]) == 3 and curve["ratio"][0] == 1.0 and min(curve["ms"]) > 0
    assert len(report["sections"]["cost_curve"]["curves"]) == 2


@pytest.mark.slow
def test_the_oracles_it_checks_hold_in_fp32(dry_run):
    report, _ = dry_run
    parity = report["sections"]["parity"]
    assert parity["batched_equals_alone"] is True
    assert parity["greedy_equals_hf"] == [True] * 4
    spec = report["sections"]["spec_bench"]
    assert set(spec["configs"]) == {"plain AR", "speculative default", "speculative hybrid",
                                    "speculative hybrid, 32 nodes"}
    n = spec["num_prompts"]
    assert n == 6 and all(c["identical_to_ar"] == f"{n}/{n}" for c in spec["configs"].values())
    # Spec-Bench's own question file, one first turn from each of its six groups, each group reported
    from benchmarks.bench_specbench import GROUPS

    assert spec["prompts"].startswith("Spec-Bench question.jsonl")
    for k in spec["configs"]:
        assert set(spec["groups"][k]) == set(GROUPS), k
        assert all(g["identical_to_ar"] == "1/1" and g["mal"] >= 1.0 for g in spec["groups"][k].values())
    assert spec["configs"]["plain AR"]["mal"] == 1.0  # one token per plain step


@pytest.mark.slow
def test_markdown_names_the_machine_and_versions(dry_run):
    report, md = dry_run
    assert f"torch {torch.__version__}" in md and "CUDA None" in md and report["env"]["date"] in md
    for name in report["sections"]:
        assert f"## {name}: ok" in md
    assert "| llama-1b-shape (random) | 1 |" in md
    assert "| group | speculative default | speculative hybrid | speculative hybrid, 32 nodes |" in md
    assert "| rag | " in md


def test_spec_bench_groups_take_turns_so_a_cut_run_keeps_every_group():
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_specbench import GROUPS
    from benchmarks.gpu_check_speed import spec_bench_prompts

    source, cases = spec_bench_prompts(24)
    assert source.startswith("Spec-Bench question.jsonl") and len(cases) == 24
    groups = [g for g, _ in cases]
    for start in range(0, 24, len(GROUPS)):  # every run of six prompts holds each group once
        assert sorted(groups[start:start + len(GROUPS)]) == sorted(GROUPS)
    assert len({t for _, t in cases}) == 24  # four different questions per group, none repeated
