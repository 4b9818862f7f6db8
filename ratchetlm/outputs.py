"""What ``LLM.generate`` / ``LLM.chat`` return, in vLLM's shape.

``RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished, ...)``
with one :class:`CompletionOutput` per choice (``SamplingParams.n``), so vLLM code reading
``out.outputs[0].text`` runs unchanged. The fields of the earlier single-choice result
(``out.text``, ``out.token_ids``, ``out.finish_reason``, ``out.logprobs``) remain as deprecated
aliases of ``out.outputs[0]``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Logprob(float):
    """A token's log-probability (vLLM's ``Logprob``). It *is* the float (code that reads logprob
    dicts as ``{token_id: float}`` keeps working) and carries ``.logprob``, ``.rank`` (1 = most
    likely token of the model's raw distribution) and ``.decoded_token``."""

    __slots__ = ("rank", "decoded_token")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple[Any, ...]:  # pickles across data-parallel replica processes
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank}, decoded_token={self.decoded_token!r})"


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One choice. ``cumulative_logprob`` (sum of the sampled tokens' raw logprobs) and ``logprobs``
    are set when the request asked for ``logprobs`` (or used ``best_of``); ``stop_reason`` is the
    stop string or stop token id that ended it (None for EOS, length, abort)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


_warned: set[str] = set()


def _deprecated(name: str) -> None:
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"RequestOutput.{name} is deprecated: use RequestOutput.outputs[0].{name} (vLLM's shape)",
                      DeprecationWarning, stacklevel=3)


@dataclass
class RequestOutput:
    """One prompt's result: its choices in ``outputs`` (``n`` of them, by ``index``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict[str, Any] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    # -------- deprecated single-choice aliases (ratchetlm < 0.2): outputs[0]'s fields
    @property
    def text(self) -> str:
        _deprecated("text")
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        _deprecated("token_ids")
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        _deprecated("finish_reason")
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> SampleLogprobs | None:
        _deprecated("logprobs")
        return self.outputs[0].logprobs


def with_decoded(lps: Mapping[int, float] | None, decode: Any) -> dict[int, Logprob] | None:
    """``{token: logprob}`` -> ``{token: Logprob}`` with ``decoded_token`` filled (ranks kept)."""
    if lps is None:
        return None
    return {t: Logprob(float(v), getattr(v, "rank", None), decode(t)) for t, v in lps.items()}
