"""The front process of ``ratchet serve --data-parallel-size 2``: its peak resident memory and CPU time
at start-up, beside a replica's, for two checkouts interleaved (a peer: the other checkout).

    python benchmarks/bench_dp_front.py --checkout /path/to/other/checkout --runs 2 [--serve-args '...']

Each run starts the server from one checkout (``PYTHONPATH``), waits for ``/health``, reads
``/proc/<pid>/status`` (VmHWM: peak RSS) and ``/proc/<pid>/stat`` (user + system CPU) of the front and
of each replica, and stops it. Prints one line per run and the medians per checkout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_common import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--dtype", "float32", "--kv-cache-blocks", "128", "--torch-threads", "1", "--log-level", "warning",
        "--data-parallel-size", "2"]


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def one_run(checkout: Path) -> dict[str, float]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(checkout), TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ratchetlm", "serve", "--port", str(port), *ARGS], env=env,
                            cwd=str(checkout))
    try:
        with httpx.Client(timeout=10) as c:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}")
                try:
                    r = c.get(f"http://127.0.0.1:{port}/health")
                    if r.status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            ready_s = time.perf_counter() - t0
            replicas = [r["pid"] for r in r.json()["replicas"]]
        return {"ready_s": ready_s, "front_rss_mb": peak_rss_mb(proc.pid), "front_cpu_s": cpu_s(proc.pid),
                "replica_rss_mb": max(peak_rss_mb(p) for p in replicas),
                "replica_cpu_s": max(cpu_s(p) for p in replicas)}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", required=True, help="the other checkout (the peer)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="more `ratchet serve` flags, e.g. '--gguf-kernels false'")
    a = ap.parse_args()
    ARGS.extend(a.serve_args.split())
    trees = {"this": ROOT, "peer": Path(a.checkout).resolve()}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for i in range(a.runs):
        for name, tree in (trees.items() if i % 2 == 0 else reversed(trees.items())):
            r = one_run(tree)
            results[name].append(r)
            print(name, " ".join(f"{k}={v:.1f}" for k, v in r.items()), flush=True)
    for name, rs in results.items():
        print(f"median {name} ({trees[name]}):", " ".join(
            f"{k}={statistics.median(r[k] for r in rs):.1f}" for k in rs[0]))


if __name__ == "__main__":
    main()
