"""Shared pieces of the two OpenAI endpoints: sampling params, choice accumulation, SSE framing,
and the run loop that ties a :class:`RequestGroup` to a (streaming or whole) HTTP response."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from ratchetlm.sampling_params import SamplingParams, StructuredOutputsParams
from ratchetlm.server.async_engine import Delta, EngineError, RequestGroup
from ratchetlm.server.errors import APIError, from_value_error
from ratchetlm.server.metrics import ChoiceTimer, ServerMetrics
from ratchetlm.server.prepare import encode_bounded, longest_token_chars
from ratchetlm.server.protocol import CommonRequest
from ratchetlm.structured.reasoning import ReasoningFormat


def make_params(req: CommonRequest, *, max_tokens: int, choice: int, logprobs: int | None = None,
                prompt_logprobs: int | None = None,
                structured: StructuredOutputsParams | None = None,
                defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """OpenAI fields -> SamplingParams; with a seed, choice ``i`` uses ``seed + i`` so n>1 choices
    differ but each is reproducible. ``defaults``: the model's sampling defaults (``--generation-config``)
    for the fields the request leaves out. ValueErrors (naming the field) become 400s."""
    seed = None if req.seed is None else req.seed + choice
    kw: dict[str, Any] = dict(
        max_tokens=max_tokens, seed=seed, ignore_eos=req.ignore_eos,
        stop=tuple([req.stop] if isinstance(req.stop, str) else (req.stop or ())),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
    )
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "min_tokens"):
        v = getattr(req, name)
        if v is None and defaults:
            v = defaults.get(name)
        if v is not None:
            kw[name] = v
    if req.bad_words:
        kw["bad_words"] = tuple(req.bad_words)
    if req.allowed_token_ids is not None:
        kw["allowed_token_ids"] = tuple(req.allowed_token_ids)
    if structured is not None:
        kw["structured"] = structured
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise from_value_error(e) from None


@dataclass
class ChoiceState:
    """Everything one choice produced so far."""

    index: int
    timer: ChoiceTimer
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish_reason: str | None = None
    chunks_sent: int = 0

    def add(self, d: Delta, now: float) -> None:
        self.token_ids += d.token_ids
        self.text.append(d.text)
        if d.logprobs:
            self.logprobs += d.logprobs
        self.timer.tokens(len(d.token_ids), now)
        if d.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.cached_tokens is not None:
            self.cached_tokens = d.cached_tokens
        if d.finished:
            self.finish_reason = d.finish_reason
            self.timer.finished(d.finish_reason, now)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class TokenText:
    """Per-token display strings (``decode([id])``), cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid], skip_special_tokens=False)
            self._cache[tid] = s
        return s


class Runner:
    """Drive one request group: collect it whole, or stream it as SSE chunks.

    ``chunk(state, delta) -> dict | list[dict] | None`` renders one choice's delta as stream chunks
    (None = nothing worth sending yet); ``usage_chunk() -> dict`` builds the final usage chunk.

    A disconnect watcher starts with the runner (not with the stream), so a client that goes away
    even before its stream's first iteration still aborts the request. ``on_end`` runs exactly
    once, when the request completed, failed or was abandoned.
    """

    def __init__(self, request: Request, group: RequestGroup, metrics: ServerMetrics, arrival: float,
                 num_choices: int, on_end: Callable[[], None] | None = None) -> None:
        self.request = request
        self.group = group
        self.states = [ChoiceState(i, ChoiceTimer(metrics, arrival)) for i in range(num_choices)]
        self.on_end = on_end
        self.ended = False
        self.watcher = asyncio.ensure_future(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        """End the request as soon as the ASGI server reports the client gone."""
        while True:
            msg = await self.request.receive()
            if msg["type"] == "http.disconnect":
                self._end("abort")
                return

    def _end(self, reason: str | None) -> None:
        """Finish once: ``reason`` None = completed; else every unfinished choice ends with it."""
        if self.ended:
            return
        self.ended = True
        if asyncio.current_task() is not self.watcher:
            self.watcher.cancel()
        if reason is not None:
            self.group.abort()
            now = time.perf_counter()
            for st in self.states:
                if st.finish_reason is None:
                    st.finish_reason = reason
                    st.timer.finished(reason, now)
        if self.on_end is not None:
            self.on_end()

    async def collect(self) -> None:
        outcome: str | None = "abort"
        try:
            async for d in self.group.deltas():
                self.states[d.index].add(d, time.perf_counter())
            outcome = "abort" if self.group.closed else None  # closed: the client went away while we waited
        except EngineError as e:
            outcome = "error"
            raise APIError(str(e), e.status) from None
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 (a fault of this request: its client gets a 500, the server goes on)
            outcome = "error"
            raise APIError(str(e), 500) from None
        finally:
            self._end(outcome)

    async def stream(self, chunk: Callable[[ChoiceState, Delta], dict | list[dict] | None],
                     usage_chunk: Callable[[], dict] | None) -> AsyncIterator[str]:
        outcome: str | None = "abort"
        try:
            try:
                async for d in self.group.deltas():
                    st = self.states[d.index]
                    st.add(d, time.perf_counter())
                    c = chunk(st, d)
                    for one in [c] if isinstance(c, dict) else (c or []):
                        st.chunks_sent += 1
                        yield sse(one)
                outcome = "abort" if self.group.closed else None
                if usage_chunk is not None and outcome is None:
                    yield sse(usage_chunk())
            except Exception as e:  # after the stream started: report in-band, then [DONE]
                if isinstance(e, EngineError):
                    outcome = "error"
                    e = APIError(str(e), e.status)
                err = e if isinstance(e, APIError) else APIError(str(e), 500)
                yield sse(err.body())
            yield SSE_DONE
        finally:
            self._end(outcome)


@dataclass
class ServingContext:
    """What the endpoints need from the loaded model."""

    llm: Any  # ``LLM``-like: .engine, .tokenizer, .tokenize(str|ids, add_special_tokens), .apply_chat_template
    model_name: str
    metrics: ServerMetrics
    token_text: TokenText
    tool_call_parser: str | None = None  # --tool-call-parser (None/"auto": from the chat template)
    response_role: str = "assistant"  # --response-role: the role of the generated chat message
    content_format: str = "auto"  # --chat-template-content-format: string | openai | auto
    reasoning: ReasoningFormat | None = None  # --reasoning-parser, when the model can write its tags
    # the model's default sampling parameters (--generation-config, engine/generation_config.py):
    # SamplingParams fields for requests that leave them out
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # --override-generation-config's max_new_tokens caps every request's max_tokens, as in vLLM
    max_tokens_cap: int | None = None
    _token_chars: int | None = None  # the vocabulary's longest token (0: unknown), for encode_bounded

    @property
    def max_model_len(self) -> int:
        return int(self.llm.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        eng = self.llm.engine
        cfg = getattr(eng, "model_config", None) or eng.config  # LLMEngine / the DeepSeek-V4 engine
        return int(cfg.vocab_size)

    def clamp_max_tokens(self, max_tokens: int, prompt_ids: list[int]) -> int:
        """``max_tokens`` clamped to what the context leaves after the prompt (a prompt that leaves
        nothing keeps it: the engine then refuses the prompt as too long, naming it) and to
        ``max_tokens_cap``."""
        if self.max_tokens_cap is not None:
            max_tokens = min(max_tokens, self.max_tokens_cap)
        left = self.max_model_len - len(prompt_ids)
        return min(max_tokens, left) if left >= 1 else max_tokens

    def encode(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
        """Text (with the tokenizer's special tokens unless ``add_special_tokens=False``;
        engine/prompts.py) or token ids -> token ids; ids are range-checked here, before anything
        (``echo``) decodes them."""
        try:
            if isinstance(prompt, str):  # a text far past the context is refused on a bounded prefix
                if self._token_chars is None:
                    self._token_chars = longest_token_chars(self.llm.tokenizer) or 0
                ids = encode_bounded(lambda t: list(self.llm.tokenize(t, add_special_tokens)), prompt,
                                     self.max_model_len, param, self._token_chars or None)
            else:
                ids = list(self.llm.tokenize(prompt, add_special_tokens))
        except ValueError as e:
            raise APIError(str(e), 400, param) from None
        vocab = self.vocab_size
        if not isinstance(prompt, str) and any(not 0 <= t < vocab for t in ids):
            raise APIError(f"prompt token ids must be integers in [0, {vocab})", 400, param)
        return ids


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose K/V the prefix cache supplied."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
