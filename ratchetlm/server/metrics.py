"""Prometheus metrics on a per-app ``CollectorRegistry`` (no process-global registry).

Request-path metrics (token counters, TTFT / inter-token / end-to-end histograms) are updated by
the HTTP handlers. Engine state (running/waiting requests, KV usage, the strategy's own counters
such as speculative acceptance or WeDLM commits) is read from the engine thread's latest
:class:`Snapshot` at scrape time, so a scrape never touches the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ratchetlm.server.async_engine import Snapshot

PREFIX = "ratchet:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0)


class _EngineCollector(Collector):
    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot | None]) -> None:
        self.model_name = model_name
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot()
        if s is None:  # still loading
            return
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).",
             1.0 - s.kv_blocks_free / s.kv_blocks_total if s.kv_blocks_total else 0.0),
            ("kv_cache_blocks_free", "Free KV-cache blocks.", s.kv_blocks_free),
            ("kv_cache_blocks_total", "Total KV-cache blocks.", s.kv_blocks_total),
            ("engine_steps", "Engine steps run so far.", s.steps),
            ("num_preemptions", "Sequences preempted (KV freed, recomputed later) so far.", s.preemptions),
            ("num_failed_requests", "Requests that failed an engine step alone (fault isolation) so far.",
             s.failed_requests),
        ):
            yield _gauge(name, doc, self.model_name, value)
        yield from _prefix_cache(s.prefix_cache, self.model_name)
        for key, value in sorted(s.strategy.items()):
            yield _gauge("strategy_" + _sanitize(key), f"Decoding strategy counter {key}.", self.model_name,
                         float(value))


def _gauge(name: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
    g.add_metric([model_name], float(value))
    return g


_PREFIX_CACHE = (  # (BlockManager.metrics() key, counter?, help); token counts like vLLM's
    ("prefix_cache_queries", True, "Prompt tokens looked up in the prefix cache (first admissions)."),
    ("prefix_cache_hits", True, "Of those, tokens whose K/V the prefix cache supplied."),
    ("prefix_cache_hit_rate", False, "prefix_cache_hits / prefix_cache_queries since start (0-1)."),
    ("prefix_cache_recompute_queries", True, "Tokens looked up again after a preemption."),
    ("prefix_cache_recompute_hits", True, "Of those, tokens found cached (usually the request's own)."),
    ("prefix_cache_evictions", True, "Cached blocks evicted to make room."),
    ("prefix_cache_blocks", False, "KV blocks holding a named committed prefix, referenced or not."),
    ("prefix_cache_blocks_unreferenced", False, "Cached blocks no request holds (evictable, counted as free)."),
)


def _prefix_cache(values: dict[str, float], model_name: str):
    if not values:  # caching off, or an engine without a prefix cache (DeepSeek-V4)
        return
    for key, counter, doc in _PREFIX_CACHE:
        family = CounterMetricFamily if counter else GaugeMetricFamily
        m = family(PREFIX + key, doc, labels=["model_name"])
        m.add_metric([model_name], float(values[key]))
        yield m


def _sanitize(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


class ServerMetrics:
    """All metrics of one app. ``observe_*`` are called from the event loop."""

    def __init__(self, model_name: str, snapshot: Callable[[], Snapshot | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        lab = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", lab, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", lab, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       lab + ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between successive token-bearing outputs of a request.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish.", lab,
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(model_name, snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ChoiceTimer:
    """Per-choice latency bookkeeping: feeds TTFT, inter-token latency and e2e histograms."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.m = metrics
        self.arrival = arrival
        self.last: float | None = None

    def tokens(self, n: int, t: float) -> None:
        if n <= 0:
            return
        m = self.m.model_name
        if self.last is None:
            self.m.ttft.labels(m).observe(t - self.arrival)
        else:
            self.m.itl.labels(m).observe(t - self.last)
        self.last = t
        self.m.generation_tokens.labels(m).inc(n)

    def finished(self, reason: str | None, t: float) -> None:
        m = self.m.model_name
        self.m.e2e.labels(m).observe(t - self.arrival)
        self.m.request_success.labels(m, reason or "abort").inc()
