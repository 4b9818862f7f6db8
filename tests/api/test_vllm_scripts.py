"""Scripts written against vLLM's documented offline API run unchanged but for the import line
(and a local model path in place of a hub name: nothing is downloaded)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ratchetlm.models.loader import default_model_path

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parents[2]


def _run(name: str, tmp_path: Path) -> subprocess.CompletedProcess:
    text = (SCRIPTS / name).read_text()
    assert text.count('"facebook/opt-125m"') == 1 and "from ratchetlm import LLM, SamplingParams" in text
    script = tmp_path / name
    script.write_text(text.replace('"facebook/opt-125m"', repr(str(default_model_path()))))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)


def test_quickstart(tmp_path):
    r = _run("vllm_quickstart.py", tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("Prompt: ")]
    assert len(lines) == 4
    assert lines[2].startswith("Prompt: 'The capital of France is', Generated text: '")
    assert all(re.fullmatch(r"""Prompt: '.+', Generated text: (['"]).+\1""", ln) for ln in lines), lines


def test_chat_with_parallel_sampling_and_logprobs(tmp_path):
    r = _run("vllm_chat_sampling.py", tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert re.fullmatch(r"request \d+: \d+ prompt tokens, finished=True", out[0])
    choices = [ln for ln in out if ln.startswith("choice ")]
    assert [c.split(":")[0] for c in choices] == ["choice 0", "choice 1"]
    for c in choices:
        m = re.match(r"choice \d: finish_reason=(stop|length) tokens=(\d+) cumulative_logprob=-[\d.]+ "
                     r"first_token_rank=(\d+) text=", c)
        assert m and 2 <= int(m.group(2)) <= 8
    # the ignored vLLM argument is named in one warning
    assert r.stderr.count("ignores these vLLM engine arguments") == 1 and "trust_remote_code" in r.stderr


@pytest.mark.parametrize("name", ["vllm_quickstart.py", "vllm_chat_sampling.py"])
def test_scripts_are_vllm_code(name):
    """The only ratchetlm name in a script is its import line."""
    lines = [ln for ln in (SCRIPTS / name).read_text().splitlines() if "ratchetlm" in ln and not ln.startswith("#")]
    assert lines == ["from ratchetlm import LLM, SamplingParams"]
