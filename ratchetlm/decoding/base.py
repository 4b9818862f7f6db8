"""The one interface every decoding strategy implements: propose → (forward) → commit.

Each step a strategy proposes, per sequence, N tentative tokens on top of the sequence's
committed KV (``seq.num_cached``). The engine runs one forward over all proposals of the
batch and hands each strategy the logits rows it asked for. The strategy then says which
proposal rows' K/V become persistent (``kv_rows``, written to the next slots in order) and
which token ids are appended to the committed sequence. Nothing else is ever committed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeVar

import torch

from ratchetlm.sequence import Sequence


@dataclass
class Proposal:
    """``n`` tentative tokens of one sequence for this step.

    ``direct_write``: every row's K/V is known to be committed (prefill, plain decode), so rows
    are written straight to slots ``num_cached + i``. Otherwise rows are staged and only the
    rows named by the commit are copied into the cache.
    """

    token_ids: list[int]  # [n]
    positions: list[int]  # [n] absolute RoPE positions
    logit_rows: list[int]  # rows whose logits the strategy needs, in this order
    mask: torch.Tensor | None = None  # [n, n] bool visibility among the new tokens; None = causal
    direct_write: bool = True
    state: Any = None  # strategy-private (tree unpack map, window layout, ...)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert n > 0 and len(self.positions) == n, (n, len(self.positions))
        assert all(0 <= r < n for r in self.logit_rows)
        assert self.mask is None or tuple(self.mask.shape) == (n, n)


@dataclass
class Commit:
    """What one step commits for one sequence.

    ``kv_rows``: proposal rows whose K/V become the sequence's next ``len(kv_rows)`` cache
    entries, in order (for a direct-write proposal it must be ``range(n)``).
    ``token_ids``: tokens appended to the committed sequence (may be empty, e.g. mid prefill).
    """

    kv_rows: list[int]
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # one per appended token when requested
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class StrategyContext:
    """What a strategy may use besides logits: the runner (for draft forwards) and model facts."""

    runner: Any  # ratchetlm.engine.model_runner.ModelRunner
    model_config: Any  # ratchetlm.models.config.ModelConfig
    max_model_len: int
    extras: dict[str, Any] = field(default_factory=dict)


class DecodeStrategy(ABC):
    name: ClassVar[str]
    # Proposes staged rows (``direct_write=False``): the engine then exports the staging
    # buffer's no-write-on-reject metrics next to the strategy's own (LLMEngine.metrics).
    stages: ClassVar[bool] = False

    def __init__(self, ctx: StrategyContext, options: Mapping[str, Any] | None = None) -> None:
        self.ctx = ctx
        self.options = dict(options or {})

    @abstractmethod
    def tokens_wanted(self, seq: Sequence) -> int:
        """Upper bound on the proposal size for ``seq`` this step (the scheduler reserves KV for it)."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        """One proposal per sequence, each with at most ``budgets[i]`` tokens."""

    @abstractmethod
    def commit(self, seqs: list[Sequence], proposals: list[Proposal], logits: list[torch.Tensor]) -> list[Commit]:
        """``logits[i]``: ``[len(proposals[i].logit_rows), vocab]`` fp32."""

    def check_request(self, params: Any) -> None:
        """Raise ``ValueError`` naming the field if this strategy cannot honour ``params`` (a
        SamplingParams) exactly; called before a request is queued."""
        return None

    def continue_step(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal | None]:
        """After this step's commits: another proposal for some sequences in the same step, on top
        of what was just committed (speculative chunk verify), within ``budgets[i]`` more tokens;
        None = the sequence is done for this step. The engine repeats forward → commit until
        every entry is None."""
        return [None] * len(seqs)

    def on_preempt(self, seq: Sequence) -> None:
        """The sequence lost its KV and will be recomputed; drop private state."""
        seq.strategy_state.clear()

    def on_step_discarded(self, seq: Sequence) -> None:
        """A step that included ``seq`` raised and is discarded: it will be re-run from the same
        committed state (tokens and KV unchanged). Drop private state the discarded propose/commit
        may have changed; the default drops it all (it is rebuilt as after a preemption)."""
        self.on_preempt(seq)

    def on_finish(self, seq: Sequence) -> None:
        """The sequence finished (stop, length, abort); free strategy-owned resources (draft KV)."""
        return None

    def metrics(self) -> dict[str, float]:
        """Aggregate counters for /metrics (strategy-specific)."""
        return {}


_REGISTRY: dict[str, type[DecodeStrategy]] = {}


def register(name: str) -> Callable[[type[DecodeStrategy]], type[DecodeStrategy]]:
    def deco(cls: type[DecodeStrategy]) -> type[DecodeStrategy]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


_Config = TypeVar("_Config")


def config_from_options(cls: type[_Config], options: Mapping[str, Any], what: str) -> _Config:
    """Builds a strategy's frozen config dataclass from user options; unknown keys raise a
    ``ValueError`` that names them and lists the known ones (values are validated by the config)."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown {what} option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return cls(**dict(options))
