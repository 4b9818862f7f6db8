"""Data-parallel engine replicas behind one HTTP front (``ratchet serve --data-parallel-size N``).

Each replica is a process (``spawn``: a fork of a process that already ran torch's thread pool can
hang) that loads the model and runs the usual :class:`AsyncEngine` — scheduler, strategy, text
layer — unchanged. The front loads the tokenizer and chat template alone, no weights (it validates
and tokenizes requests as with one engine, against the facts a replica reports: server/front.py)
and talks to each replica over a pipe:

    front -> replica   ("add", gid, [Submission]) | ("abort", gid) | ("fail_all", (msg, status)) | ("stop", None)
    replica -> front   ("ready", pid, EngineFacts) | ("accepted", gid) | ("rejected", gid, exc)
                       | ("deltas", gid, [Delta]) | ("error", gid, (msg, status)) | ("snapshot", Snapshot)

A request goes to the live replica with the fewest unfinished choices (its running + waiting
requests, counted by the front, so it is exact at routing time). A replica that dies fails only its
own requests (503, a clean error, in-stream for streams); ``/health`` names it and the others keep
serving. :class:`ReplicaPool` offers the same surface as :class:`AsyncEngine` to the app.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ratchetlm.server.async_engine import (
    _ACCEPTED,
    _CLOSED,
    AsyncEngine,
    EngineError,
    RequestGroup,
    Snapshot,
    Submission,
)
from ratchetlm.server.front import EngineFacts

# ---------------------------------------------------------------------- the replica process


def replica_main(loader: Callable[[], Any], conn: Any) -> None:
    """Load the model, then serve the pipe until the front says stop or goes away."""
    try:
        llm = loader()
    except BaseException as e:  # noqa: BLE001 - reported to the front, which fails the start-up
        conn.send(("load_failed", f"{type(e).__name__}: {e}"))
        return
    eng = AsyncEngine(llm.engine, llm.tokenizer)
    # an engine that cannot step any more (a tensor-parallel rank died) ends this replica: the front
    # then reports it in /health and routes to the others; the delay lets its errors reach the front
    eng.on_dead = lambda: threading.Timer(1.0, os._exit, args=(3,)).start()
    eng.start()
    conn.send(("ready", os.getpid(), EngineFacts.of(llm)))
    asyncio.run(_serve_pipe(eng, conn))
    eng.shutdown()


async def _serve_pipe(eng: AsyncEngine, conn: Any) -> None:
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    groups: dict[int, Any] = {}

    def read() -> None:  # a thread: the pipe blocks
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("stop", None)  # the front is gone: end with it
            loop.call_soon_threadsafe(inbox.put_nowait, msg)
            if msg[0] == "stop":
                return

    async def run(gid: int, subs: list[Submission]) -> None:
        g = groups[gid] = eng.group(subs)
        try:
            await g.start()
        except Exception as e:  # noqa: BLE001 - the front re-raises it (400 / 503 as for one engine)
            groups.pop(gid, None)
            conn.send(("rejected", gid, e))
            return
        conn.send(("accepted", gid))
        try:
            async for d in g.deltas():
                conn.send(("deltas", gid, [d]))
        except EngineError as e:
            conn.send(("error", gid, (str(e), e.status)))
        groups.pop(gid, None)

    async def publish() -> None:
        last = None
        while True:
            if eng.snapshot is not last:
                last = eng.snapshot
                conn.send(("snapshot", last))
            await asyncio.sleep(0.05)

    threading.Thread(target=read, name="ratchet-replica-pipe", daemon=True).start()
    pub = asyncio.create_task(publish())
    tasks = set()
    while True:
        kind, arg = await inbox.get()
        if kind == "stop":
            break
        if kind == "add":
            t = asyncio.create_task(run(*arg))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        elif kind == "abort" and arg in groups:
            groups[arg].abort()
        elif kind == "fail_all":
            eng.fail_all(*arg)
    pub.cancel()


# ---------------------------------------------------------------------- the front


class RemoteGroup(RequestGroup):
    """A :class:`RequestGroup` whose choices run on a replica: ``deltas`` and ``_post`` are the
    parent's; submitting and aborting go over the replica's pipe."""

    def __init__(self, pool: ReplicaPool, subs: list[Submission]) -> None:
        super().__init__(pool, subs)  # type: ignore[arg-type]  # the pool stands in for the engine
        self.gid = next(pool._gids)
        self.pool = pool
        self.replica: Replica | None = None
        self.pending = len(subs)  # choices not finished yet, as the replica has reported them (reader thread)

    async def start(self) -> None:
        self.replica = self.pool._route(self)
        first = await self.queue.get()
        if first is not _ACCEPTED:
            self.replica.release(self)
            raise first

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            if self.replica is not None:
                self.replica.send(("abort", self.gid))
                self.replica.release(self)
            self.queue.put_nowait(_CLOSED)


class Replica:
    def __init__(self, index: int, loader: Callable[[], Any], ctx: Any) -> None:
        self.index = index
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=replica_main, args=(loader, child), name=f"ratchet-replica-{index}",
                                daemon=True)
        self.proc.start()
        child.close()
        self.groups: dict[int, RemoteGroup] = {}
        self.lock = threading.Lock()  # groups and the pipe's send side: handlers and the reader
        self.snapshot = Snapshot()
        self.alive = False
        self.pid: int | None = None
        self.facts: EngineFacts | None = None  # what the loaded engine checks requests against
        self.served = 0  # requests routed here (the routing spread, shown by /health)

    def wait_ready(self) -> None:
        msg = self.conn.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"data-parallel replica {self.index} failed to load the model: {msg[1]}")
        self.pid, self.facts, self.alive = msg[1], msg[2], True
        threading.Thread(target=self._read, name=f"ratchet-replica-{self.index}-reader", daemon=True).start()

    @property
    def load(self) -> int:
        """Unfinished choices here (running + waiting)."""
        return sum(g.pending for g in self.groups.values())

    def send(self, msg: tuple[str, Any]) -> None:
        with self.lock:
            if self.alive:
                try:
                    self.conn.send(msg)
                except (OSError, ValueError):
                    pass  # the reader sees the pipe close and fails this replica's requests

    def release(self, g: RemoteGroup) -> None:
        with self.lock:
            self.groups.pop(g.gid, None)

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "snapshot":
                self.snapshot = msg[1]
                continue
            with self.lock:
                g = self.groups.get(msg[1])
            if g is None:
                continue
            if kind == "accepted":
                g._post(_ACCEPTED)
            elif kind == "rejected":
                g._post(msg[2])
            elif kind == "deltas":
                g.pending -= sum(d.finished for d in msg[2])
                g._post(msg[2])
                if g.pending <= 0:
                    self.release(g)
            elif kind == "error":
                self.release(g)
                g._post(EngineError(*msg[2]))
        with self.lock:
            self.alive = False
            dead, self.groups = list(self.groups.values()), {}
        for g in dead:
            g._post(EngineError(f"data-parallel replica {self.index} stopped while running this request", 503))


class ReplicaPool:
    """N engine processes with :class:`AsyncEngine`'s surface (``group``, ``snapshot``, ``alive``,
    ``fail_all``, ``shutdown``)."""

    def __init__(self, loader: Callable[[], Any], n: int) -> None:
        assert n >= 1
        ctx = mp.get_context("spawn")
        self.replicas = [Replica(i, loader, ctx) for i in range(n)]
        self._gids = itertools.count()
        try:
            for r in self.replicas:
                r.wait_ready()
        except BaseException:
            self.shutdown()
            raise

    @property
    def facts(self) -> EngineFacts:
        """The engines' facts (the replicas load the same model with the same flags)."""
        facts = self.replicas[0].facts
        assert facts is not None, "every replica reported ready"
        return facts

    def start(self) -> None:  # the replicas run from construction
        return None

    @property
    def alive(self) -> bool:
        return any(r.alive for r in self.replicas)

    def group(self, subs: list[Submission]) -> RemoteGroup:
        return RemoteGroup(self, subs)

    def _route(self, g: RemoteGroup) -> Replica:
        live = [r for r in self.replicas if r.alive]
        if not live:
            raise EngineError("every data-parallel replica has stopped", 503)
        r = min(live, key=lambda r: (r.load, r.index))
        with r.lock:
            r.groups[g.gid] = g
        r.served += 1
        r.send(("add", (g.gid, g.subs)))
        return r

    @property
    def snapshot(self) -> Snapshot:
        """The live replicas' snapshots summed (counters and gauges add up; a per-replica rate
        such as an acceptance rate is averaged)."""
        snaps = [r.snapshot for r in self.replicas if r.alive]
        if not snaps:
            return Snapshot()
        out: dict[str, Any] = {}
        for f in fields(Snapshot):
            vals = [getattr(s, f.name) for s in snaps]
            if isinstance(vals[0], dict):
                keys = set().union(*vals)
                out[f.name] = {k: _combine(k, [v.get(k, 0.0) for v in vals]) for k in keys}
            else:
                out[f.name] = sum(vals)
        return Snapshot(**out)

    def status(self) -> list[dict[str, Any]]:
        return [{"replica": r.index, "alive": r.alive, "pid": r.pid, "requests_routed": r.served,
                 "requests_running": r.snapshot.running if r.alive else 0,
                 "requests_waiting": r.snapshot.waiting if r.alive else 0} for r in self.replicas]

    def fail_all(self, message: str, status: int = 503) -> None:
        for r in self.replicas:
            r.send(("fail_all", (message, status)))

    def shutdown(self, timeout: float = 5.0) -> None:
        for r in self.replicas:
            r.send(("stop", None))
        for r in self.replicas:
            r.proc.join(timeout)
            if r.proc.is_alive():
                r.proc.kill()
                r.proc.join(timeout)


def _combine(key: str, vals: list[float]) -> float:
    rate = any(w in key for w in ("rate", "efficiency", "per_forward", "avg", "mean"))
    return sum(vals) / len(vals) if rate else sum(vals)
