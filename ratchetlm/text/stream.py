"""Per-request text stream: committed token ids in, text deltas out.

This is the one object the server and ``LLM.generate`` hold per request (per choice): it owns the
incremental detokenizer and the stop-string matcher.  The engine itself only ever emits token ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ratchetlm.sampling_params import SamplingParams
from ratchetlm.text.detokenizer import Detokenizer, as_ids, make_detokenizer
from ratchetlm.text.stop import StopStringMatcher


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text released by one ``TextStream.feed``; ``stopped`` means a stop string completed, so the
    caller should finish the request with ``finish_reason="stop"`` and free its KV cache."""

    text: str
    stopped: bool


class TextStream:
    """Detokenize a request's committed tokens and apply its stop strings.

    Contract: concatenating every ``feed(...).text`` and ``finish()`` gives
    ``decode(prompt + fed)[len(decode(prompt)):]``, cut at the first stop string as
    ``StopStringMatcher`` defines. ``decode`` keeps special tokens unless ``skip_ids`` names them
    (``special_token_ids(tokenizer)`` for a request with ``skip_special_tokens``, vLLM's default):
    then it is ``decode(ids, skip_special_tokens=True)``, which drops exactly those ids before
    decoding, so they are dropped from prompt and output here before detokenizing. Feed only ids
    that should be rendered: a stop token such as EOS that ends the request is normally left out by
    the caller.  After a stop, further feeds return an empty delta with ``stopped=True``.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Iterable[int] | Any,
        stop: str | Iterable[str] | None = None,
        include_stop_str_in_output: bool = False,
        detokenizer: Detokenizer | None = None,
        skip_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.skip_ids = skip_ids
        if skip_ids:
            prompt_ids = [t for t in as_ids(prompt_ids) if t not in skip_ids]
        self.detokenizer = detokenizer if detokenizer is not None else make_detokenizer(tokenizer, prompt_ids)
        self.matcher = StopStringMatcher(stop, include_stop_str_in_output)
        self._pieces: list[str] = []

    @classmethod
    def for_request(cls, tokenizer: Any, prompt_ids: Iterable[int] | Any, params: SamplingParams,
                    special_ids: frozenset[int]) -> TextStream:
        """The stream a request's sampling parameters ask for: its stop strings, and the tokenizer's
        ``special_ids`` (``special_token_ids``, read once by the owner) left out unless
        ``skip_special_tokens=False``."""
        return cls(tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
                   skip_ids=special_ids if params.skip_special_tokens else frozenset())

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the request, if any (vLLM reports it as ``stop_reason``)."""
        return self.matcher.matched

    @property
    def text(self) -> str:
        """All text released so far (for non-streaming responses)."""
        return "".join(self._pieces)

    def feed(self, token_ids: Iterable[int] | Any) -> TextDelta:
        """Consume the tokens one engine step committed for this request."""
        if self.matcher.stopped:
            return TextDelta("", True)
        if self.skip_ids:
            token_ids = [t for t in as_ids(token_ids) if t not in self.skip_ids]
        out = self.matcher.feed(self.detokenizer.push_many(token_ids))
        self._pieces.append(out)
        return TextDelta(out, self.matcher.stopped)

    def finish(self) -> str:
        """End of request: drain the detokenizer (a dangling partial character comes out as U+FFFD)
        and release held-back stop-string prefixes.  Returns ``""`` after a stop."""
        if self.matcher.stopped:
            return ""
        out = self.matcher.feed(self.detokenizer.flush())
        out += self.matcher.flush()
        self._pieces.append(out)
        return out
