"""The ``ratchet`` command as shell users drive it: --version / --help with defaults, a prompt from
standard input, JSON output for scripts, ``ratchet serve MODEL``, and Ctrl-C ending ``generate``
and ``serve`` quietly with exit code 130."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ratchetlm import __version__
from ratchetlm.cli import main
from ratchetlm.models.loader import default_model_path
from ratchetlm.server.cli import build_parser as serve_parser
from tests.server.conftest import start_server

REPO = Path(__file__).parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
RATCHET = [sys.executable, "-m", "ratchetlm"]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"ratchet {__version__}"


@pytest.fixture
def in_process(capsys):
    """``main(argv)`` in this process -> (exit code, stdout, stderr): no interpreter, torch and
    transformers start-up (~4 s of CPU a run) where what a test reads is the command's own output
    (``python -m`` itself is run by the tests around). The ``ratchetlm`` logger that the command sets
    up (a handler on the captured stderr, no propagation) is put back afterwards."""
    import logging

    log = logging.getLogger("ratchetlm")
    saved = list(log.handlers), log.level, log.propagate

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's --help / usage errors
            code = int(e.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    yield run
    log.handlers[:] = saved[0]
    log.setLevel(saved[1])
    log.propagate = saved[2]


def test_help_lists_commands_and_defaults(in_process):
    code, out, _ = in_process(["--help"])  # (`python -m ratchetlm` itself: the generate tests below)
    assert code == 0 and all(c in out for c in ("generate", "serve", "bench"))
    code, out, _ = in_process(["generate", "--help"])
    assert code == 0 and "most tokens to generate (default: 128)" in " ".join(out.split())
    assert "(default: 16)" in out and "(default: auto)" in out  # block size, dtype


def test_serve_help_shows_defaults_and_model_positional():
    text = serve_parser().format_help()
    assert "(default: 8000)" in text and "(default: 30.0)" in text and "MODEL" in text
    args = serve_parser().parse_args(["/models/x.gguf", "--port", "9"])
    assert (args.model_tag, args.port) == ("/models/x.gguf", 9)


def test_bool_flags_alone_mean_true_and_bad_values_are_refused(capsys):
    p = serve_parser()
    assert p.parse_args(["--enforce-eager"]).enforce_eager is True
    assert p.parse_args(["--enable-prefix-caching", "false"]).enable_prefix_caching is False
    with pytest.raises(SystemExit):
        p.parse_args(["--enable-prefix-caching", "maybe"])
    assert "expected true or false" in capsys.readouterr().err


def test_generate_reads_stdin_and_prints_json(in_process, monkeypatch):
    """``-`` reads the prompt from standard input (as ``echo ... | ratchet generate -`` gives it): the
    command's main in this process, stdin a pipe's text (``python -m ratchetlm`` itself, with its exit
    codes, runs in the Ctrl-C tests below; a subprocess here paid ~5 s of interpreter, torch and
    transformers start-up for what the command prints)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("The capital of France is\n"))
    code, stdout, stderr = in_process(["generate", "-", "--json", "--max-tokens", "4"])
    assert code == 0, stderr
    out = json.loads(stdout)
    assert out["prompt"] == "The capital of France is"  # echo's newline dropped
    assert out["text"].strip().startswith("Paris") and len(out["token_ids"]) == out["usage"]["completion_tokens"]
    assert out["finish_reason"] in ("stop", "length") and out["usage"]["prompt_tokens"] == 5
    assert stderr.count("INFO ratchet: dtype=float32 (GGUF on CPU, block kernels: ") == 1


def test_generate_refuses_an_empty_stdin(in_process, monkeypatch):
    """Refused before the model loads: the command's main in this process (its return value is the
    exit code), not a python + torch start-up for one error line."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = in_process(["generate", "-"])
    assert code == 2 and "standard input is empty" in err and "Traceback" not in err


def test_generate_suggests_chat_when_an_instruct_model_ends_at_once(in_process):
    """The bundled instruct model answers a bare question with EOS at once (the first thing users try):
    generate says so and names --chat; with --chat it answers and says nothing of the kind."""
    hint = "try --chat"
    code, out, err = in_process(["generate", "What is a ratchet?", "--max-tokens", "8"])
    assert code == 0 and out.strip() == "What is a ratchet?" and hint in err
    code, out, err = in_process(["generate", "What is a ratchet?", "--max-tokens", "8", "--chat"])
    assert code == 0 and out.strip() and hint not in err


def _default_sigint() -> None:
    """A test runner started in the background by a script (`cmd &`, no job control) ignores SIGINT,
    and an ignored signal stays ignored across exec: give the child what a terminal's process has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_generate_quietly_with_130():
    p = subprocess.Popen([*RATCHET, "generate", "Tell me a very long story.", "--max-tokens", "4000", "--ignore-eos"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, preexec_fn=_default_sigint)
    assert p.stdout is not None
    seen = b""
    deadline = time.monotonic() + 600
    while len(seen) < len(b"Tell me a very long story.") + 8 and time.monotonic() < deadline:
        seen += os.read(p.stdout.fileno(), 64)  # the prompt, then generated text
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err


def test_ctrl_c_ends_serve_quietly_with_130():
    srv = start_server(base_args=[str(default_model_path()), "--max-model-len", "256", "--kv-cache-blocks", "32",
                                  "--torch-threads", "1"],  # its step-cost probe: a second thread only spins
                       stderr=subprocess.PIPE, preexec_fn=_default_sigint)
    assert srv.health().json()["status"] == "ok"
    srv.proc.send_signal(signal.SIGINT)
    _, err = srv.proc.communicate(timeout=120)
    assert srv.proc.returncode == 130
    text = err.decode()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text
    assert text.count("dtype=float32 (GGUF on CPU, block kernels: ") == 1  # logged once at start


@pytest.mark.parametrize("flags, message", [
    (["-tp", "0"], "tensor_parallel_size"), (["--gpu-memory-utilization", "3"], "gpu_memory_utilization"),
    (["a.gguf", "--model", "b.gguf"], "two models given"),
])
def test_serve_refuses_bad_engine_flags_before_starting(flags, message, capsys):
    try:
        rc = main(["serve", *flags])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2 and message in capsys.readouterr().err
