"""vLLM-compatible speculative counters, per request (``seq.stats``) and aggregated (/metrics).

A *draft* is one verification step that carried at least one draft token; draft tokens are
the tree nodes verified (for a chain: its length); accepted tokens are draft tokens the
verifier kept (the correction/bonus token is not counted). Mean acceptance length is
``1 + accepted / drafts`` (it counts the bonus token, as vLLM does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [depth] drafts accepting >= pos+1 tokens

    def observe(self, draft_tokens: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += draft_tokens
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < accepted:
            self.accepted_per_pos += [0] * (accepted - len(self.accepted_per_pos))
        for i in range(accepted):
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
