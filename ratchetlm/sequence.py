"""A request's token state as counts: committed tokens and how many of them have KV."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from ratchetlm.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """Invariant: ``num_cached <= len(token_ids)``; the first ``num_cached`` tokens have their
    K/V committed in the paged cache at the slots given by ``block_table``. Prefill, a draft
    tree and a WeDLM window are all just tentative tokens computed on top of ``num_cached``;
    only a commit advances it. ``token_ids`` only ever grows (the ratchet)."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    num_cached: int = 0
    block_table: list[int] = field(default_factory=list)
    # the local (sliding-window) layers' own pool, for a model that also has global layers
    # (engine/layer_groups.py); -1 where the window has moved past
    local_block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    # Per-strategy private state (draft trees, WeDLM windows); dropped on preemption.
    strategy_state: dict[str, Any] = field(default_factory=dict)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, when requested
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # counters the strategy reports (forwards, drafts, ...)
    # The request's logits controls (penalties, bias, bans, grammar; layers/logits_processors.py), or
    # None. It has seen exactly the committed output; it survives preemption (token_ids do too).
    controls: Any = None
    num_preemptions: int = 0
    # Prefix cache (kv/block_manager.py): names of the sequence's full blocks, computed lazily
    # from its tokens; a per-request key folded into their root; prompt tokens found cached at
    # first admission (``usage.prompt_tokens_details.cached_tokens``).
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None
    num_prefix_hit_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
