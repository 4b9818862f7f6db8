"""``ratchet bench --model`` on any GGUF: a tiny qwen3 file in K-quant and 8-bit blocks, ratchetlm in
its own process; every column of the report (load, peak RSS, decode at each batch size, prefill)
is measured, and an engine that cannot run is reported as skipped instead of failing the bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.core.gguf_factory import write_tiny_gguf

REPO = Path(__file__).parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")


def test_bench_runs_any_gguf_and_reports_every_column(tmp_path):
    model = write_tiny_gguf(tmp_path / "qwen3.gguf", "qwen3", ["Q4_K", "Q6_K", "Q8_0"])
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "ratchetlm", "bench", "--model", str(model), "--engines", "ratchetlm,nonsense-free",
           "--max-tokens", "4", "--batch-sizes", "1,2", "--prompt-tokens", "24", "--repeats", "1", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode != 0 and "unknown engine 'nonsense-free'" in r.stdout + r.stderr  # named, not a traceback
    cmd[cmd.index("ratchetlm,nonsense-free")] = "ratchetlm"
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| ratchetlm |" in r.stdout and "load avg" in r.stdout
    (res,) = json.loads(out.read_text())["results"]
    assert res["engine"] == "ratchetlm" and res["load_s"] > 0 and res["peak_rss_gb"] > res["base_rss_gb"] > 0.1
    assert set(res["decode"]) == {"1", "2"} and all(v > 0 for v in res["decode"].values())
    assert res["prefill"] > 0 and res["kv_bytes"] > 0
