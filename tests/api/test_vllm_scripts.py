"""Scripts written against vLLM's documented offline API run unchanged but for the import line
(and a local model path in place of a hub name: nothing is downloaded)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchetlm.models.loader import default_model_path

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parents[2]


SCRIPT_NAMES = ("vllm_quickstart.py", "vllm_chat_sampling.py")
# one interpreter runs the scripts one after the other, each as `python script.py` would (its own __main__
# namespace; an exception is its traceback on stderr and exit status 1), then marks the end of its output on
# stdout and stderr: the scripts' own behaviour, without a python + torch + transformers start-up (~6 CPU-s) each
_DRIVER = """
import runpy, sys, traceback
for path in sys.argv[1:]:
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        print("\\n@@ end of script, exit status %d @@" % code, file=stream, flush=True)
"""


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, Ran]:
    """Each script (with the local model path in place of the hub name) -> its exit status and output."""
    tmp = tmp_path_factory.mktemp("vllm_scripts")
    paths = []
    for name in SCRIPT_NAMES:
        text = (SCRIPTS / name).read_text()
        assert text.count('"facebook/opt-125m"') == 1 and "from ratchetlm import LLM, SamplingParams" in text
        (tmp / name).write_text(text.replace('"facebook/opt-125m"', repr(str(default_model_path()))))
        paths.append(str(tmp / name))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", _DRIVER, *paths], capture_output=True, text=True, timeout=600, env=env)
    marks = re.compile(r"\n@@ end of script, exit status (-?\d+) @@\n")
    outs, errs = marks.split(p.stdout), marks.split(p.stderr)
    assert p.returncode == 0 and len(outs) == len(errs) == 2 * len(SCRIPT_NAMES) + 1, p.stderr[-3000:]
    return {name: Ran(int(outs[2 * i + 1]), outs[2 * i], errs[2 * i]) for i, name in enumerate(SCRIPT_NAMES)}


def test_quickstart(ran):
    r = ran["vllm_quickstart.py"]
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("Prompt: ")]
    assert len(lines) == 4
    assert lines[2].startswith("Prompt: 'The capital of France is', Generated text: '")
    assert all(re.fullmatch(r"""Prompt: '.+', Generated text: (['"]).+\1""", ln) for ln in lines), lines


def test_chat_with_parallel_sampling_and_logprobs(ran):
    r = ran["vllm_chat_sampling.py"]
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
