"""Prefix-cache counters (kv/block_manager.py keeps them; /metrics exports them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Token counts of prefix lookups. A request's first admission is a query; re-admissions after
    preemption (which usually re-hit the sequence's own blocks) are counted apart so they do not
    inflate the hit rate users read."""

    queries: int = 0  # tokens looked up (whole sequence at admission)
    hits: int = 0  # of those, tokens found cached
    requests: int = 0
    requests_hit: int = 0  # requests with at least one cached block
    recompute_queries: int = 0  # the same, for re-admissions after preemption
    recompute_hits: int = 0
    evictions: int = 0  # cached blocks dropped to make room

    def observe(self, num_tokens: int, hit_tokens: int, recompute: bool) -> None:
        if recompute:
            self.recompute_queries += num_tokens
            self.recompute_hits += hit_tokens
            return
        self.queries += num_tokens
        self.hits += hit_tokens
        self.requests += 1
        self.requests_hit += hit_tokens > 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
