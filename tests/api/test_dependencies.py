"""Dependency ranges (pyproject.toml): the environment under test lies inside them, they admit the
pins of the stacks users install us beside, and the transformers floor really works."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).parents[2]
REQS = {r.name: r for r in (Requirement(s) for s in tomllib.loads((REPO / "pyproject.toml").read_text())
                            ["project"]["dependencies"])}

# What the stacks pin (SGLang 0.5.23: its wheel's METADATA; vLLM 0.33: its torch)
BESIDE = {
    "sglang 0.5.23": {"torch": "2.14.1", "transformers": "5.19.0", "tokenizers": "0.23.2", "llguidance": "1.7.6"},
    "vllm 0.33": {"torch": "2.14.1"},
}


def test_no_exact_pins():
    for name, req in REQS.items():
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"{name} is pinned: {req}"


def test_installed_versions_are_inside_the_ranges():
    for name, req in REQS.items():
        v = version(name).split("+")[0]  # torch's local tag (+cpu) is not part of the range
        assert req.specifier.contains(v, prereleases=True), f"installed {name} {v} is outside {req}"


@pytest.mark.parametrize("stack", sorted(BESIDE))
def test_ranges_admit_the_stacks_we_install_beside(stack):
    for name, v in BESIDE[stack].items():
        assert REQS[name].specifier.contains(v), f"{stack} needs {name}=={v}; we ask {REQS[name]}"


# pytest plugins of the test environment that a pytest subprocess running plain tests does not need:
# importing them (schemathesis, hypothesis, anyio) is ~3 CPU-s of its start-up
NO_PLUGINS = ["-p", "no:schemathesis", "-p", "no:hypothesispytest", "-p", "no:anyio"]


def _floor(name: str) -> str:
    floors = [s.version for s in REQS[name].specifier if s.operator == ">="]
    assert len(floors) == 1, f"{name} needs one >= floor"
    return floors[0]


@pytest.mark.slow
def test_transformers_floor_converts_and_templates(tmp_path):
    """Install the floor release over this environment's transformers (``--target``, no deps) and
    run the tokenizer tests with it in a subprocess: a floor that is too low fails here (5.17
    converts the bundled GGUF tokenizer with the wrong eos)."""
    floor = _floor("transformers")
    assert Version(floor) <= Version(version("transformers"))
    target = tmp_path / "floor"
    # --no-compile: no .pyc for its ~2,000 modules (the subprocess imports a few dozen of them)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
                          str(target), f"transformers=={floor}"], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(REPO)]), RATCHETLM_CACHE=str(tmp_path / "c"))
    # one interpreter: it prints the transformers it imported (from the floor's --target), then runs the
    # tests with it; without the test suite's heavy pytest plugins, which these tests do not use (an
    # interpreter and the plugins were ~6 CPU-s of this test's ~28)
    tests = ["tests/text/test_tokenizer_cache.py", "tests/api/test_outputs.py::test_prompt_dicts_and_lists"]
    driver = ("import sys, transformers, pytest; print(transformers.__version__, flush=True); "
              "sys.exit(pytest.main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", driver, "-q", "-p", "no:cacheprovider", "-n", "0", *NO_PLUGINS,
                          *tests], capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    assert Version(run.stdout.split("\n", 1)[0].strip()) == Version(floor), run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0, run.stdout[-3000:]
