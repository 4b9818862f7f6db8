"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 128  # n / best_of per prompt
UNTIL_MAX_MODEL_LEN = sys.maxsize  # max_tokens=None: every strategy stops at max_model_len first


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output text (vLLM's ``StructuredOutputsParams``): exactly one of

    ``json`` a JSON schema (dict or JSON string), ``regex``, ``choice`` (the output is one of these
    strings), ``grammar`` (a Lark or GBNF/EBNF grammar, llama.cpp's format), ``json_object=True``
    (any JSON object). ``whitespace_flexible``: JSON grammars allow free whitespace between tokens;
    off by default (compact JSON), because small models otherwise ramble in whitespace.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured choice must be a list of strings")
            if not self.choice:
                raise ValueError("structured choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured json schema is not valid JSON: {e}") from None
            object.__setattr__(self, "json", parsed)
        if self.json is not None and not isinstance(self.json, Mapping | bool):
            raise ValueError(f"structured json schema must be a JSON object, got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured {name} must be a non-empty string")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured json_object must be a boolean")
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A canonical string naming the constraint (the compiled-grammar cache key)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.whitespace_flexible], sort_keys=True)


@dataclass(frozen=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name of the same constraint (``SamplingParams(guided_decoding=...)``).
    ``backend`` / ``disable_fallback`` pick vLLM's grammar engine: accepted (llguidance runs here);
    ``disable_any_whitespace`` sets ``whitespace_flexible`` to its negation when given;
    ``whitespace_pattern``, ``structural_tag`` and ``disable_additional_properties=True`` would
    change the constraint and are refused."""

    backend: str | None = None
    backend_was_auto: bool = False
    disable_fallback: bool = False
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"guided decoding {name} is not supported here")
        if self.disable_additional_properties:
            raise ValueError("guided decoding disable_additional_properties=True is not supported here: "
                             "write additionalProperties: false in the schema")
        if self.disable_any_whitespace is not None:
            object.__setattr__(self, "whitespace_flexible", not self.disable_any_whitespace)
        super().__post_init__()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Invalid values raise ``ValueError`` naming the field.

    ``temperature == 0`` is greedy. ``top_k`` of -1 or 0 disables top-k; ``top_p`` of 1 and
    ``min_p`` of 0 disable those filters. ``seed`` makes one request's sampling reproducible
    regardless of what else is in the batch. ``stop`` strings are matched by the text layer.

    Logits controls (applied to the model's logits before temperature and the filters, for every
    decoding strategy; speculative verification tests drafts against the same distribution):
    ``repetition_penalty`` (HF/vLLM: logits of tokens seen in the prompt or output are divided by it
    when positive, multiplied when negative; 1 = off), ``frequency_penalty`` / ``presence_penalty``
    (OpenAI: subtract ``f * count`` / ``p * [count > 0]`` over output tokens; in [-2, 2]),
    ``logit_bias`` (token id -> bias added to its logit, in [-100, 100]), ``allowed_token_ids``
    (only these may be generated), ``bad_words`` (strings never generated: their last token is banned
    wherever the tokens before it were just generated), ``min_tokens`` (EOS and ``stop_token_ids``
    are banned until that many tokens were generated), ``structured`` (a grammar the output must
    match, :class:`StructuredOutputsParams`).

    vLLM's choices: ``n`` independent samples per prompt (with a ``seed``, choice ``i`` samples with
    ``seed + i``, as vLLM derives its child requests' seeds); ``best_of`` (>= n) samples of which the
    ``n`` with the highest cumulative logprob are returned. ``max_tokens=None``: up to ``max_model_len``.
    """

    n: int = 1
    best_of: int | None = None
    max_tokens: int = 16  # None (vLLM's spelling): up to max_model_len, stored as UNTIL_MAX_MODEL_LEN
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per sampled token (0 = only the token)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    min_tokens: int = 0
    structured: StructuredOutputsParams | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's name for ``structured``
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name (a GuidedDecodingParams)

    def __post_init__(self) -> None:
        self._vllm_conventions()
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # normalise before freezing semantics
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens is None:  # vLLM: no limit but the context length (the engine's max_model_len)
            object.__setattr__(self, "max_tokens", UNTIL_MAX_MODEL_LEN)
        _check_int("max_tokens", self.max_tokens, lo=1)
        self._check_choices()
        _check_num("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, lo=-1)
        _check_num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=20)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=20)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._check_logits_controls()

    def _vllm_conventions(self) -> None:
        """vLLM spellings: ``None`` lists, ``seed=-1``, ``logprobs=True``, ``structured_outputs`` /
        ``guided_decoding`` for ``structured``."""
        for name in ("stop", "stop_token_ids", "bad_words"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if self.seed == -1:
            object.__setattr__(self, "seed", None)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                object.__setattr__(self, name, 1)
        for alias in ("structured_outputs", "guided_decoding"):
            value = getattr(self, alias)
            if value is not None:
                if self.structured is not None and self.structured != value:
                    raise ValueError(f"give one of structured, structured_outputs and guided_decoding (vLLM's "
                                     f"names): not both {alias} and another")
                object.__setattr__(self, "structured", value)
                object.__setattr__(self, alias, None)

    def _check_choices(self) -> None:
        """``n`` choices per prompt; ``best_of`` >= n samples, of which the n most likely are returned."""
        _check_int("n", self.n, lo=1, hi=MAX_CHOICES)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, lo=self.n, hi=MAX_CHOICES)
        if self.greedy and (self.n > 1 or (self.best_of or 1) > 1):
            raise ValueError(f"n and best_of must be 1 with greedy sampling (temperature=0): every choice would "
                             f"be the same; got n={self.n}, best_of={self.best_of}")

    @property
    def num_samples(self) -> int:
        """Sequences one prompt runs: ``best_of`` when given, else ``n``."""
        return self.best_of or self.n

    def _check_logits_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check_num(name, v)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        _check_num("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError("logit_bias must map token ids to numbers")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)  # JSON object keys arrive as strings ("50256")
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                _check_num("logit_bias", v)
                if not -100.0 <= v <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {v} for token {tid}")
                bias[tid] = float(v)
            object.__setattr__(self, "logit_bias", bias or None)
        if self.allowed_token_ids is not None:
            ids = tuple(self.allowed_token_ids)
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            object.__setattr__(self, "allowed_token_ids", ids)
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        for w in self.bad_words:
            if not isinstance(w, str) or not w:
                raise ValueError(f"bad_words must be non-empty strings, got {w!r}")
        _check_int("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens)  # hi None: no bound
        if self.structured is not None and not isinstance(self.structured, StructuredOutputsParams):
            if isinstance(self.structured, Mapping):
                object.__setattr__(self, "structured", StructuredOutputsParams(**self.structured))
            else:
                raise ValueError("structured must be a StructuredOutputsParams (or a dict of its fields)")

    @property
    def has_logits_controls(self) -> bool:
        """Whether anything but temperature and the filters shapes this request's distribution."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.bad_words
                    or self.min_tokens or self.structured is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, v: object, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bound}, got {v}")


def _check_num(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")


