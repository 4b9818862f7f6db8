"""The tensor-parallel group seen from rank 0 (the engine's process): start the ranks, hand them
commands, notice when one fails, stop them.

On one machine rank 0 starts ranks 1..N-1 as processes (``python -m ratchetlm.parallel.worker``);
under ``torchrun`` the launcher started every rank and they join from its environment
(docs/parallel.md). All ranks join one process group — gloo on CPU, NCCL on CUDA; a c10d group
object of the engine's own, not torch.distributed's global default group — whose collectives (the
model's all-reduces and the logits gather) time out after ``RATCHET_TP_TIMEOUT`` seconds (default 60).

Commands go through the group's key-value store (a ``TCPStore`` served by rank 0), numbered: a
worker blocks on the next key; rank 0 sets it and goes on without waiting for anyone, so the only
places rank 0 waits for a worker are the collectives, which are bounded. A forward is one command;
cache-only changes (staging commits) are queued and ride along with the next forward.

Failure: a rank that dies breaks the next collective at once (gloo: "connection closed by peer"),
one that hangs breaks it after the timeout. Rank 0 then raises :class:`TensorParallelError`
naming the rank, its exit code and the error it reported (a failing worker writes it to the store
before exiting), stops the other workers, and every later call raises the same error at once: the
ranks' collectives no longer line up, so the engine is done (``EngineDeadError``). A worker exits
when rank 0's store goes away or its parent process changes, so none outlives the engine.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import weakref
from typing import Any

import torch

from ratchetlm.errors import EngineDeadError
from ratchetlm.parallel.channel import IDLE, Channel, join, rank_device
from ratchetlm.parallel.runner import TPModelRunner


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank died, hung past the timeout or failed; the engine cannot go on."""


class TPGroup:
    """Rank 0's handle on the other ranks. ``send`` a command and run the same computation
    locally with :meth:`run`; ``post`` queues a cache-only command for the next send."""

    def __init__(self, size: int, store: Any, procs: list[subprocess.Popen], group: Any,
                 threads: int | None = None) -> None:
        self.size = size
        self.store = store
        self.procs = procs  # ranks 1.. when rank 0 started them (empty under torchrun)
        self.group = group
        self.channel = Channel(store)
        self.pending: list[tuple[str, Any]] = []
        self.broken: str | None = None
        self.runners = 0  # engines built on this group so far (each has its own cache on every rank)
        self._finalizer = weakref.finalize(self, _shutdown, self.channel, procs, threads)

    # ------------------------------------------------------------------ start-up

    @staticmethod
    def start(cfg: Any, mask_token_id: int | None) -> TPGroup:
        """Start ranks 1..N-1 on this machine (or, under torchrun, join the ranks it started;
        there a rank other than 0 serves rank 0 and then exits the process)."""
        import torch.distributed as dist

        n = cfg.tensor_parallel_size
        if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun
            return _from_torchrun(cfg, mask_token_id)
        threads = max(1, torch.get_num_threads() // n) if cfg.device == "cpu" else 1
        restore = torch.get_num_threads()
        if cfg.device == "cpu":  # the ranks share this machine's cores (restored at close)
            torch.set_num_threads(threads)
            from ratchetlm import kernels

            kernels.load()  # compiled once, here, before the workers look for it
        store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False, timeout=IDLE)
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
        procs = []
        try:
            for rank in range(1, n):
                p = subprocess.Popen([sys.executable, "-m", "ratchetlm.parallel.worker"], stdin=subprocess.PIPE,
                                     env=env)
                procs.append(p)
                assert p.stdin is not None
                p.stdin.write(pickle.dumps(dict(rank=rank, size=n, port=store.port, cfg=cfg, threads=threads,
                                                mask_token_id=mask_token_id, parent=os.getpid())))
                p.stdin.close()
            tp = TPGroup(n, store, procs, None, restore)
            tp._wait_for("joining")  # every rank is up (a worker that fails to start is reported, not waited for)
            tp.group = join(store, 0, n, rank_device(cfg.device, 0))
        except BaseException:
            for p in procs:
                p.kill()
            _shutdown(Channel(store), procs, restore, stop=False)
            raise
        return tp

    def make_runner(self, *args: Any, **kwargs: Any) -> TPModelRunner:
        """Rank 0's runner (the llama family's, ``engine/model_runner.ModelRunner``'s arguments) that
        mirrors itself on the workers: tensor parallelism wraps the engine's runner from outside."""
        return TPModelRunner(*args, group=self, **kwargs)

    def load_args(self) -> dict[str, Any]:
        """``load_model`` arguments for rank 0's own shard."""
        return {"tp_rank": 0, "tp_size": self.size, "tp_group": self.group}

    def wait_ready(self) -> None:
        """Block until every rank loaded its shard; raise with a failed rank's own error."""
        self._wait_for("ready")

    def _wait_for(self, stage: str) -> None:
        for rank in range(1, self.size):
            while not self.store.check([f"{stage}/{rank}"]):
                self._raise_if_failed(rank)
                time.sleep(0.05)

    def _raise_if_failed(self, rank: int) -> None:
        err = self._reported(rank)
        proc = self.procs[rank - 1] if self.procs else None
        if err is not None or (proc is not None and proc.poll() is not None):
            code = None if proc is None else proc.wait(timeout=5)
            self.close()
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to start"
                                      + (f" (exit code {code})" if code is not None else "")
                                      + (f": {err}" if err else ""))

    def _reported(self, rank: int) -> str | None:
        key = f"error/{rank}"
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - diagnosing only
            return None

    # ------------------------------------------------------------------ commands

    def post(self, op: str, payload: Any) -> None:
        self.pending.append((op, payload))

    def run(self, op: str, payload: Any, local: Any) -> Any:
        """Send ``(op, payload)`` (after the queued commands) and compute ``local()`` here; the
        workers do the same, meeting this rank in the collectives inside."""
        if self.broken is not None:
            raise TensorParallelError(self.broken)
        for rank, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise self._fail(RuntimeError(f"rank {rank} is not running"))
        self.channel.put(self.pending + [(op, payload)])
        self.pending = []
        try:
            out = local()
        except BaseException as e:
            raise self._fail(e) from e
        self.channel.forget(self.channel.n - 1)
        return out

    def _fail(self, e: BaseException) -> TensorParallelError:
        """Why the group broke (the ranks that died or reported an error); stops the workers."""
        time.sleep(0.2)  # a dying worker's exit code and message arrive a moment after the broken socket
        why = []
        for rank in range(1, self.size):
            proc = self.procs[rank - 1] if self.procs else None
            code = None if proc is None else proc.poll()
            err = self._reported(rank)
            if code is not None or err:
                why.append(f"rank {rank}" + (f" exited with code {code}" if code is not None else "")
                           + (f" ({err})" if err else ""))
        self.broken = ("tensor parallelism failed, the engine cannot continue: "
                       + ("; ".join(why) if why else f"{type(e).__name__}: {e}"))
        for p in self.procs:  # their collectives no longer line up with ours: nothing to wait for
            if p.poll() is None:
                p.kill()
        self._finalizer()
        return TensorParallelError(self.broken)

    def close(self) -> None:
        """Stop every worker (idempotent; also runs when the group is collected or at exit)."""
        self._finalizer()
        self.broken = self.broken or "the tensor-parallel group was shut down"


def _shutdown(channel: Channel, procs: list[subprocess.Popen], threads: int | None, stop: bool = True) -> None:
    """Stop the workers (a ``stop`` command, then a kill after 5 s) and give back rank 0's threads."""
    if stop:
        try:
            channel.put([("stop", None)])
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if threads is not None:
        torch.set_num_threads(threads)


def _from_torchrun(cfg: Any, mask_token_id: int | None) -> TPGroup:
    """Join the ranks ``torchrun`` started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``)."""
    import torch.distributed as dist

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size != cfg.tensor_parallel_size:
        raise ValueError(f"torchrun started {size} processes but tensor_parallel_size is {cfg.tensor_parallel_size}")
    device = rank_device(cfg.device, int(os.environ.get("LOCAL_RANK", rank)))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, size, is_master=rank == 0,
                          wait_for_workers=False, timeout=IDLE)
    if rank != 0:
        from ratchetlm.parallel.worker import serve

        serve(store, rank, size, device, cfg, mask_token_id)
        raise SystemExit(0)
    return TPGroup(size, store, [], join(store, 0, size, device))
