"""vLLM-compatible speculative counters, per request (``seq.stats``) and aggregated (/metrics).

A *draft* is one verification step that carried at least one draft token; draft tokens are
the tree nodes verified (for a chain: its length); accepted tokens are draft tokens the
verifier kept (the correction/bonus token is not counted). Mean acceptance length is
``1 + accepted / drafts`` (it counts the bonus token, as vLLM does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [depth] drafts accepting >= pos+1 tokens

    def observe(self, draft_tokens: int, accepted: int, new_draft: bool = True, offset: int = 0) -> None:
        """One verification. SCV verifies one draft in several chunks: every chunk after the first
        (``new_draft=False``) adds to the same draft, its positions starting at ``offset``."""
        self.num_drafts += new_draft
        self.num_draft_tokens += draft_tokens
        self.num_accepted_tokens += accepted
        end = offset + accepted
        if len(self.accepted_per_pos) < end:
            self.accepted_per_pos += [0] * (end - len(self.accepted_per_pos))
        for i in range(offset, end):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self, prefix: str) -> dict[str, Any]:
        return {
            f"{prefix}num_drafts": self.num_drafts,
            f"{prefix}num_draft_tokens": self.num_draft_tokens,
            f"{prefix}num_accepted_tokens": self.num_accepted_tokens,
            f"{prefix}accepted_per_pos": list(self.accepted_per_pos),
            f"{prefix}mean_acceptance_length": self.mean_acceptance_length,
            f"{prefix}acceptance_rate": self.acceptance_rate,
        }

    @classmethod
    def from_stats(cls, stats: dict[str, Any], prefix: str) -> SpecCounters:
        return cls(stats.get(f"{prefix}num_drafts", 0), stats.get(f"{prefix}num_draft_tokens", 0),
                   stats.get(f"{prefix}num_accepted_tokens", 0), list(stats.get(f"{prefix}accepted_per_pos", [])))


@functools.lru_cache(maxsize=8)
def _keys(prefix: str) -> tuple[str, ...]:  # as_dict's keys, in its order
    return tuple(SpecCounters().as_dict(prefix))


def observe_into(stats: dict[str, Any], prefix: str, draft_tokens: int, accepted: int, new_draft: bool = True,
                 offset: int = 0) -> None:
    """``stats.update(c.as_dict(prefix))`` of ``c = SpecCounters.from_stats(stats, prefix)`` after
    ``c.observe(...)``, the dictionary updated in place: a request's every verify step did that
    round trip (two objects, a dozen formatted keys, ~0.05 ms on one core)."""
    k_drafts, k_tokens, k_accepted, k_pos, k_mal, k_rate = _keys(prefix)
    drafts = stats.get(k_drafts, 0) + new_draft
    tokens = stats.get(k_tokens, 0) + draft_tokens
    acc = stats.get(k_accepted, 0) + accepted
    pos = list(stats.get(k_pos, []))
    end = offset + accepted
    if len(pos) < end:
        pos += [0] * (end - len(pos))
    for i in range(offset, end):
        pos[i] += 1
    stats[k_drafts], stats[k_tokens], stats[k_accepted], stats[k_pos] = drafts, tokens, acc, pos
    stats[k_mal] = 1.0 + acc / drafts if drafts else 0.0
    stats[k_rate] = acc / tokens if tokens else 0.0


@dataclass
class ChunkCounters:
    """Speculative chunk verify: one entry per chunk verification. ``accepted`` is the chunk's
    accepted draft prefix (plus the next draft node when the target's own token matched it),
    ``committed`` the tokens the chunk's commit appended (accepted prefix + the target's token)."""

    chunks: int = 0
    continued: int = 0  # chunks verified after an earlier chunk of the same draft, in the same step
    accepted: int = 0
    committed: int = 0
    by_accepted: list[int] = field(default_factory=list)  # [n] chunks whose accepted prefix was n

    def observe(self, accepted: int, committed: int, continued: bool) -> None:
        self.chunks += 1
        self.continued += continued
        self.accepted += accepted
        self.committed += committed
        if len(self.by_accepted) <= accepted:
            self.by_accepted += [0] * (accepted + 1 - len(self.by_accepted))
        self.by_accepted[accepted] += 1

    def as_dict(self, prefix: str) -> dict[str, Any]:
        return {f"{prefix}scv_chunks": self.chunks, f"{prefix}scv_continued_chunks": self.continued,
                f"{prefix}scv_accepted_tokens": self.accepted, f"{prefix}scv_committed_tokens": self.committed}

    def metrics(self, prefix: str) -> dict[str, float]:
        out: dict[str, float] = dict(self.as_dict(prefix))
        out[f"{prefix}scv_mean_committed_per_chunk"] = self.committed / self.chunks if self.chunks else 0.0
        for n, k in enumerate(self.by_accepted):
            out[f"{prefix}scv_chunks_accepting_{n}"] = k
        return out

    @classmethod
    def from_stats(cls, stats: dict[str, Any], prefix: str) -> ChunkCounters:
        return cls(stats.get(f"{prefix}scv_chunks", 0), stats.get(f"{prefix}scv_continued_chunks", 0),
                   stats.get(f"{prefix}scv_accepted_tokens", 0), stats.get(f"{prefix}scv_committed_tokens", 0))
