"""What every tensor-parallel rank shares: the process group of the model's collectives, and the
numbered command channel through the store by which rank 0 (parallel/group.py) drives the workers
(parallel/worker.py)."""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any

import torch

IDLE = timedelta(days=365)  # a worker waits this long for rank 0's next command (rank 0's exit ends the wait)


def collective_timeout() -> float:
    """Seconds a collective may wait for the slowest rank (``RATCHET_TP_TIMEOUT``, default 60)."""
    value = os.environ.get("RATCHET_TP_TIMEOUT", "60")
    try:
        t = float(value)
    except ValueError:
        t = -1.0
    if not t > 0:
        raise ValueError(f"RATCHET_TP_TIMEOUT must be a positive number of seconds, got {value!r}")
    return t


def backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """``cuda`` / ``cuda:K`` -> the GPU of this rank (``cuda:K+local_rank``); CPU stays ``cpu``."""
    if not device.startswith("cuda"):
        return device
    base = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{base + local_rank}"


def join(store: Any, rank: int, size: int, device: str) -> Any:
    """This rank's process group for the model's collectives: a c10d backend object of its own (not
    torch.distributed's global default group, so a process may hold several engines)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=collective_timeout())
    prefixed = dist.PrefixStore("pg", store)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


class Channel:
    """Numbered commands through the store: rank 0 puts them, every worker gets each in order."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.n = 0

    def put(self, msg: Any) -> None:
        self.store.set(f"cmd/{self.n}", pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        self.n += 1

    def get(self) -> Any:
        key = f"cmd/{self.n}"
        self.store.wait([key], IDLE)  # raises once rank 0's store is gone
        self.n += 1
        return pickle.loads(self.store.get(key))

    def forget(self, upto: int) -> None:
        """Drop commands before ``upto``: every worker has read them (rank 0 saw their collectives)."""
        for i in range(max(0, upto - 2), upto):
            self.store.delete_key(f"cmd/{i}")
