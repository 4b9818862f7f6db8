"""The engine in its own thread, HTTP handlers on the event loop.

``LLMEngine`` is not thread-safe, so exactly one thread (the engine thread) calls
``add_request``/``step``/``abort``/``release``. Handlers talk to it through a thread-safe command
queue; results come back on one ``asyncio.Queue`` per HTTP request (a :class:`RequestGroup`, one
engine request per choice), fed with ``loop.call_soon_threadsafe`` once per step.

The engine thread is also the output processor: it owns each choice's :class:`TextStream`
(detokenizer + stop strings), so a stop string aborts the request in the same step it completes,
exactly as ``LLM.stream`` does. The scheduler itself never sees text.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from ratchetlm.engine.llm_engine import EngineDeadError, StepOutput
from ratchetlm.engine.step_probe import ProbeStopped
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.text.detokenizer import special_token_ids
from ratchetlm.text.stream import TextStream

_log = logging.getLogger("ratchetlm.server")
# how long shutdown waits for the engine thread: a step (bounded by the step-time budget) or one of the
# probe's forwards; the first forward also packs the weights, seconds for a large model on a busy CPU
SHUTDOWN_WAIT_S = 60.0
MAX_RECOVERIES = 8  # consecutive loop faults before the engine thread gives up (then every request is a 503)


@dataclass(frozen=True)
class Submission:
    """One engine request: a choice of an HTTP request."""

    index: int  # choice index in the response
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # prefix-cache isolation key (shares blocks only within one salt)


@dataclass
class Delta:
    """What one choice committed in one step. ``prompt_logprobs`` and ``cached_tokens`` (prompt tokens
    whose K/V came from the prefix cache) are set on the choice's first delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cached_tokens: int | None = None


class EngineError(RuntimeError):
    """The engine failed while running this request, or the server is ending it (shutdown);
    reported with HTTP ``status``, or in-stream as an error event."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Snapshot:
    """Engine state published by the engine thread after every step (read lock-free by /health)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    steps: int = 0
    preemptions: int = 0
    failed_requests: int = 0  # requests failed alone by fault isolation
    strategy: dict[str, float] = field(default_factory=dict)
    prefix_cache: dict[str, float] = field(default_factory=dict)  # BlockManager.metrics(); empty when off


_ACCEPTED = object()
_CLOSED = object()  # the handler closed the group (client gone): stop waiting for deltas


class RequestGroup:
    """The handler's side of one HTTP request: submit, then iterate deltas of all its choices."""

    def __init__(self, owner: AsyncEngine, subs: list[Submission]) -> None:
        self.owner = owner
        self.subs = subs
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.seq_ids: dict[int, int] = {}  # engine seq_id -> choice index (engine thread only)
        self.closed = False

    async def start(self) -> None:
        """Queue the choices in the engine; raises the engine's ValueError/QueueFullError, or
        :class:`EngineError` (503) when the engine thread has stopped."""
        if self.owner.dead is not None:
            raise EngineError(self.owner.dead, 503)
        self.owner._commands.put(("add", self))
        first = await self.queue.get()
        if first is not _ACCEPTED:
            raise first

    async def deltas(self):
        """Yield :class:`Delta` until every choice finished or the group is closed (check
        :attr:`closed`); raises :class:`EngineError`."""
        remaining = len(self.subs)
        while remaining:
            item = await self.queue.get()
            if item is _CLOSED:
                return
            if isinstance(item, BaseException):
                raise item
            for d in item:
                remaining -= d.finished
                yield d

    def abort(self) -> None:
        """Client gone (call on the event loop): the engine thread aborts and frees every unfinished
        choice before its next step, and a handler waiting in :meth:`deltas` returns at once."""
        if not self.closed:
            self.closed = True
            self.owner._commands.put(("abort", self))
            self.queue.put_nowait(_CLOSED)

    def _post(self, item: Any) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the handler's event loop is closed: nobody is waiting any more
            pass


@dataclass
class _Live:
    group: RequestGroup
    index: int
    text: TextStream
    prompt_logprobs_sent: bool = False


class AsyncEngine:
    """Runs ``engine.step()`` in a daemon thread while any request is unfinished."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.special_ids = special_token_ids(tokenizer)  # left out of a request's text by skip_special_tokens
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._live: dict[int, _Live] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.dead: str | None = None  # why the engine thread stopped for good (then every request is a 503)
        self.on_dead: Any = None  # called once the thread stopped for good (a data-parallel replica exits)
        self.snapshot = Snapshot()
        self._publish()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ratchet-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = SHUTDOWN_WAIT_S) -> None:
        """Stop the engine thread and wait for it: it stops between steps (or between the probe's
        forwards), and the process must not exit while it is inside a torch op (torch's teardown then
        aborts the process: "terminate called without an active exception", exit 134)."""
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                _log.error("the engine thread did not stop within %.0f s", timeout)

    def fail_all(self, message: str, status: int = 503) -> None:
        """End every request in flight with ``message`` (graceful shutdown past its timeout)."""
        self._commands.put(("fail_all", (message, status)))

    def group(self, subs: list[Submission]) -> RequestGroup:
        return RequestGroup(self, subs)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        """The engine loop. Nothing a request does may end it: a step that raises fails the requests
        in flight; a fault outside the step (delivering, aborting, publishing) is contained by
        :meth:`_recover`. Only an engine that keeps failing with nothing left to fail ends the
        thread, and then every waiting and later request gets a 503 instead of hanging."""
        failures = 0  # consecutive iterations that needed a recovery
        cost = getattr(self.engine, "step_cost", None)
        if cost is not None:  # the step-time budget's probe, now rather than in a request's first step
            try:
                cost.calibrate(stop=self._stop.is_set)
            except ProbeStopped:  # shutdown came first: the loop below does not start
                pass
            except Exception:  # noqa: BLE001 (the scheduler probes again when it first needs it)
                _log.exception("step cost probe failed")
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                    failures = 0
                except EngineDeadError:
                    raise
                except Exception as e:
                    failures += 1
                    if failures > MAX_RECOVERIES:
                        raise
                    self._recover(e)
        except EngineDeadError as e:  # a tensor-parallel rank died: every later step would fail too
            self.dead = f"the engine stopped: {e}"
            _log.error("engine stopped: %s", e)
        except BaseException as e:
            self.dead = f"the engine stopped after repeated internal errors: {type(e).__name__}: {e}"
            _log.exception("engine thread stopped")
        finally:
            self._end_thread()
            if self.dead is not None and not self._stop.is_set() and self.on_dead is not None:
                self.on_dead()

    def _iterate(self) -> None:
        busy = self.engine.has_unfinished()
        try:
            cmd = self._commands.get(block=not busy, timeout=None if busy else 0.5)
            self._handle(*cmd)
            while True:  # drain everything queued before stepping: aborts free KV before the next step
                self._handle(*self._commands.get_nowait())
        except queue.Empty:
            pass
        if self.engine.has_unfinished():
            try:
                outs = self.engine.step()
            except EngineDeadError:
                raise  # ends the thread (_run)
            except Exception as e:  # fail the requests in flight, keep serving
                if not self._live:
                    raise  # nobody to fail: a step that keeps raising is a loop fault (see _run)
                self._fail_all(e)
                outs = []
            self._deliver(outs)
        self._publish()

    def _recover(self, e: Exception) -> None:
        """A fault outside ``engine.step`` (a bug in delivery, abort or publishing): end every
        request in flight with the error, without trusting the bookkeeping that just failed, and
        give the engine back its blocks."""
        _log.exception("engine loop fault; failing the requests in flight")
        err = EngineError(f"internal server error: {type(e).__name__}: {e}")
        groups = {id(l.group): l.group for l in self._live.values()}
        for sid in list(self._live):
            self._drop(sid, "abort")
        for g in groups.values():
            g.seq_ids.clear()
            g._post(err)

    def _end_thread(self) -> None:
        """The thread is ending (shutdown or dead): nobody may wait for it any more."""
        if self.dead is None:
            self.dead = "the server is shutting down"
        err = EngineError(self.dead, 503)
        groups = {id(l.group): l.group for l in self._live.values()}
        self._live.clear()
        while True:  # requests queued but never taken
            try:
                kind, g = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                groups[id(g)] = g
        for g in groups.values():
            g._post(err)

    def _handle(self, kind: str, g: Any) -> None:
        if kind == "add":
            self._add(g)
        elif kind == "abort":
            for sid in list(g.seq_ids):
                self._drop(sid, "abort")
        elif kind == "fail_all":
            self._fail_all(EngineError(*g))

    def _add(self, g: RequestGroup) -> None:
        if g.closed:
            return
        try:
            first: dict[tuple[int, ...], int] = {}  # the n choices of a prompt share its KV blocks
            for sub in g.subs:
                key = tuple(sub.prompt_ids)
                sid = self.engine.add_request(sub.prompt_ids, sub.params, cache_salt=sub.cache_salt,
                                              share_prompt_with=first.get(key))
                first.setdefault(key, sid)
                g.seq_ids[sid] = sub.index
                ts = TextStream.for_request(self.tokenizer, sub.prompt_ids, sub.params, self.special_ids)
                self._live[sid] = _Live(g, sub.index, ts)
        except Exception as e:  # bad prompt / queue full: undo the choices already queued
            for sid in list(g.seq_ids):
                self._drop(sid, "abort")
            g._post(e)
            return
        g._post(_ACCEPTED)

    def _drop(self, sid: int, reason: str) -> None:
        live = self._live.pop(sid, None)  # forgotten first: a failing abort must not leave it half-live
        if live is not None:
            live.group.seq_ids.pop(sid, None)
        try:
            self.engine.abort(sid, reason)
            self.engine.release(sid)
        except Exception:  # the caller still answers the request; the engine ends it at max_tokens at worst
            _log.exception("aborting request %d failed", sid)

    def _deliver(self, outs: list[StepOutput]) -> None:
        by_group: dict[int, tuple[RequestGroup, list[Delta]]] = {}
        failed: dict[int, tuple[RequestGroup, str]] = {}
        for out in outs:
            live = self._live.get(out.seq_id)
            if live is None:
                continue
            if out.error is not None:  # this request failed the step alone; its group's other choices end too
                self._drop(out.seq_id, "error")
                failed.setdefault(id(live.group), (live.group, out.error))
                continue
            try:  # text, stop strings, logprobs: a fault here is this request's alone
                d = self._delta(out, live)
            except Exception as e:
                _log.exception("delivering request %d failed", out.seq_id)
                self._drop(out.seq_id, "error")
                failed.setdefault(id(live.group), (live.group, f"{type(e).__name__}: {e}"))
                continue
            by_group.setdefault(id(live.group), (live.group, []))[1].append(d)
        for g, err in failed.values():
            by_group.pop(id(g), None)
            for sid in list(g.seq_ids):
                self._drop(sid, "abort")
            g._post(EngineError(f"the request failed while decoding: {err}"))
        for g, ds in by_group.values():
            g._post(ds)

    def _delta(self, out: StepOutput, live: _Live) -> Delta:
        visible = out.new_token_ids
        if out.finish_reason == "stop" and visible and self.engine.is_stop_token(out.seq_id, visible[-1]):
            visible = visible[:-1]  # EOS / stop token ids end the request but are not text
        td = live.text.feed(visible)
        finished, reason = out.finished, out.finish_reason
        if td.stopped and not finished:
            self.engine.abort(out.seq_id, "stop")  # stop string: free the KV now
            finished, reason = True, "stop"
        text = td.text + (live.text.finish() if finished else "")
        seq = None
        if finished:
            seq = self.engine.release(out.seq_id)
            self._live.pop(out.seq_id, None)
            live.group.seq_ids.pop(out.seq_id, None)
        # The prompt is fully prefilled once a token commits, so the first delta carries the
        # prompt logprobs (a streamed ``echo`` needs them up front); a later recompute after
        # preemption is not sent again.
        prompt_lp = cached = None
        if not live.prompt_logprobs_sent:
            live.prompt_logprobs_sent = True
            seq = seq or self.engine.seqs.get(out.seq_id)
            if seq is not None:
                cached = seq.num_prefix_hit_tokens
                if seq.params.prompt_logprobs is not None:
                    prompt_lp = list(seq.prompt_logprobs)
        return Delta(live.index, list(out.new_token_ids), text, out.new_logprobs, finished, reason, prompt_lp,
                     cached)

    def _fail_all(self, e: Exception) -> None:
        groups = {id(l.group): l.group for l in self._live.values()}
        for sid in list(self._live):
            self._drop(sid, "abort")
        err = e if isinstance(e, EngineError) else EngineError(f"engine step failed: {type(e).__name__}: {e}")
        for g in groups.values():
            g._post(err)

    def _publish(self) -> None:
        eng = self.engine
        metrics = getattr(eng, "metrics", None) or getattr(getattr(eng, "strategy", None), "metrics", None)
        cache_metrics = getattr(getattr(eng, "blocks", None), "metrics", None)
        self.snapshot = Snapshot(
            running=len(eng.scheduler.running),
            waiting=len(eng.scheduler.waiting),
            kv_blocks_free=eng.blocks.num_free,
            kv_blocks_total=eng.blocks.num_blocks,
            steps=eng.stats.steps,
            preemptions=getattr(eng.scheduler, "num_preemptions", 0),
            failed_requests=eng.stats.extra.get("failed_requests", 0),
            strategy=dict(metrics()) if metrics is not None else {},
            prefix_cache=dict(cache_metrics()) if cache_metrics is not None else {},
        )
