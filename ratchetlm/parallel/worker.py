"""A tensor-parallel worker (ranks 1..N-1): load this rank's shard, then mirror rank 0's runner.

Started by rank 0 (``python -m ratchetlm.parallel.worker``, its launch arguments pickled on stdin)
or by ``torchrun`` (parallel/group.py). It holds its slice of the weights and its own paged KV
cache — its KV heads, in the same blocks and slots as rank 0's — and runs every forward rank 0
runs, on the plan rank 0 decided (:class:`~ratchetlm.engine.model_runner.ForwardPlan`): the
scheduler, the block tables, the strategy and sampling live on rank 0 only. It also applies rank
0's staging commits, so its cache holds exactly the rows rank 0's holds. Any failure is written to
the store, where rank 0 reads it, and ends the process.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import torch


def serve(store: Any, rank: int, size: int, device: str, cfg: Any, mask_token_id: int | None) -> None:
    """Join the group, load this rank's shard, run rank 0's commands until it says stop."""
    from ratchetlm.engine.model_runner import build_runner
    from ratchetlm.models.registry import load_model
    from ratchetlm.parallel.channel import Channel, join

    try:
        store.set(f"joining/{rank}", b"1")
        group = join(store, rank, size, device)
        dtype = cfg.torch_dtype()
        loaded = load_model(cfg.model, torch.device(device), dtype, progress=False, mask_token_id=mask_token_id,
                            gguf_kernels=cfg.gguf_kernels, numerics=cfg.numerics, tp_rank=rank, tp_size=size,
                            tp_group=group)
        store.set(f"ready/{rank}", b"1")
        channel = Channel(store)
        runners: dict[int, Any] = {}  # one per engine rank 0 built on this model
        while True:
            for op, payload in channel.get():
                if op == "stop":
                    return
                if op == "cache":  # rank 0's cache geometry: the same blocks, this rank's KV heads
                    rid, num_blocks, max_model_len = payload
                    runners[rid] = build_runner(replace(cfg, kv_cache_blocks=num_blocks, kv_cache_bytes=None),
                                                loaded.model, loaded.config, dtype, torch.device(device),
                                                max_model_len)
                elif op == "forward":
                    runners[payload[0]].forward(payload[1])
                elif op == "commit":
                    if not runners[payload[0]].commit_rows(*payload[1:]):
                        raise RuntimeError("a staging commit that succeeded on rank 0 failed here")
                elif op == "drop":
                    runners.pop(payload, None)
                else:
                    raise ValueError(f"unknown command {op!r}")
    except BaseException as e:
        try:
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}".encode())
        except Exception:  # noqa: BLE001 - rank 0 is gone: nobody to tell
            pass
        raise


def _watch_parent(parent: int) -> None:
    """Exit when the process that started this one is gone (no orphan outlives the engine)."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="ratchet-tp-parent-watch", daemon=True).start()


def main() -> int:
    import torch.distributed as dist

    from ratchetlm.parallel.channel import IDLE, rank_device

    args = pickle.loads(sys.stdin.buffer.read())
    _watch_parent(args["parent"])
    torch.set_num_threads(args["threads"])
    rank, size = args["rank"], args["size"]
    store = dist.TCPStore("127.0.0.1", args["port"], size, is_master=False, timeout=IDLE)
    try:
        serve(store, rank, size, rank_device(args["cfg"].device, rank), args["cfg"], args["mask_token_id"])
    except BaseException as e:  # noqa: BLE001 - reported through the store; keep stderr to one line
        print(f"ratchet tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing to tear down: skip the interpreter's (slow, on a busy machine) finalization
