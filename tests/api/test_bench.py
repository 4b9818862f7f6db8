"""``ratchet bench --model`` on any GGUF: a tiny qwen3 file in K-quant and 8-bit blocks, ratchetlm in
its own process; every column of the report (load, peak RSS, decode at each batch size, prefill)
is measured, and an engine that cannot run is reported as skipped instead of failing the bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ratchetlm.cli import main
from tests.core.gguf_factory import write_tiny_gguf

REPO = Path(__file__).parents[2]


def test_bench_runs_any_gguf_and_reports_every_column(tmp_path, monkeypatch, capsys):
    """The parent (``ratchet bench``: tokenizes the prompts, starts one worker process per engine, writes
    the report) runs in this process; the engine's worker is its own ``python -m ratchetlm.bench --worker``,
    on one thread (a tiny model: a second thread only spins on the shared CPU)."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the worker imports this tree's ratchetlm
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    model = write_tiny_gguf(tmp_path / "qwen3.gguf", "qwen3", ["Q4_K", "Q6_K", "Q8_0"])
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(model), "--engines", "ratchetlm,nonsense-free", "--max-tokens", "4",
            "--batch-sizes", "1,2", "--prompt-tokens", "24", "--repeats", "1", "--threads", "1", "--json", str(out)]
    with pytest.raises(SystemExit) as e:  # named, not a traceback, before any engine runs
        main(argv)
    assert "unknown engine 'nonsense-free'" in str(e.value.code) and "(ratchetlm done)" not in capsys.readouterr().out
    argv[argv.index("ratchetlm,nonsense-free")] = "ratchetlm"
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "(ratchetlm done)" in stdout, stdout[-2000:]
    assert "| ratchetlm |" in stdout and "load avg" in stdout
    (res,) = json.loads(out.read_text())["results"]
    assert res["engine"] == "ratchetlm" and res["load_s"] > 0 and res["peak_rss_gb"] > res["base_rss_gb"] > 0.1
    assert set(res["decode"]) == {"1", "2"} and all(v > 0 for v in res["decode"].values())
    assert res["prefill"] > 0 and res["kv_bytes"] > 0
