"""Scripts written against vLLM's documented offline API run unchanged but for the import line
(and a local model path in place of a hub name: nothing is downloaded)."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from ratchetlm.models.loader import default_model_path

SCRIPTS = Path(__file__).parent / "scripts"


SCRIPT_NAMES = ("vllm_quickstart.py", "vllm_chat_sampling.py")


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def _run_script(path: str) -> Ran:
    """``python script.py`` as far as the script can tell, in this process: its own ``__main__`` namespace,
    its stdout and stderr captured, its warnings printed to that stderr as the interpreter prints them
    (its default filters: each once per place; deprecations only from ``__main__``), an exception its
    traceback on stderr and exit status 1.
    A python + torch + transformers start-up per script, or one for both, cost ~5 CPU-s."""
    out, err = io.StringIO(), io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.resetwarnings()  # the interpreter's default filters (no -W), the last one first
        warnings.simplefilter("default")
        for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        warnings.showwarning = show
        try:
            runpy.run_path(path, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # noqa: BLE001 (the script's failure is its exit status and traceback)
            traceback.print_exc()
            code = 1
    return Ran(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, Ran]:
    """Each script (with the local model path in place of the hub name) -> its exit status and output."""
    tmp = tmp_path_factory.mktemp("vllm_scripts")
    result = {}
    for name in SCRIPT_NAMES:
        text = (SCRIPTS / name).read_text()
        assert text.count('"facebook/opt-125m"') == 1 and "from ratchetlm import LLM, SamplingParams" in text
        (tmp / name).write_text(text.replace('"facebook/opt-125m"', repr(str(default_model_path()))))
        result[name] = _run_script(str(tmp / name))
    return result


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
