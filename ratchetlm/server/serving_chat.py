"""``POST /v1/chat/completions``: the model's chat template applied to ``messages``, ``n`` choices.

Streaming never sends a role-only chunk: the role rides on each choice's first chunk that carries
content (or its finishing chunk), so time-to-first-chunk is the time to the first real token.

Tools (server/structured.py, structured/tool_calls.py): the tools reach the prompt, the output is
searched for calls in the model family's format, calls become ``message.tool_calls`` (streamed,
structured/tool_stream.py: ``delta.tool_calls``, the id and name as soon as they are written, then
the arguments piece by piece) with ``finish_reason "tool_calls"``; text outside the calls stays
``content``. ``tool_choice: "required"`` or a named
function is enforced by a grammar; ``"none"`` leaves the tools out of the prompt.

Reasoning (``--reasoning-parser``, structured/reasoning.py): the thinking is split off first, as
``message.reasoning`` and ``message.reasoning_content`` (``delta.reasoning`` /
``delta.reasoning_content`` when streamed); tool calls are searched for in the rest only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ratchetlm.server.async_engine import Delta, Submission
from ratchetlm.server.common import ChoiceState, ServingContext, make_params, new_id, usage
from ratchetlm.server.errors import APIError
from ratchetlm.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from ratchetlm.server.structured import ToolPlan, compile_constraint, requested_constraint, tool_plan
from ratchetlm.structured.reasoning import ReasoningSplitter, split_reasoning
from ratchetlm.structured.tool_calls import ToolCall
from ratchetlm.structured.tool_stream import StreamingToolParser


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.as_template_dict() for m in messages]


def chat_prompt(ctx: ServingContext, req: ChatCompletionRequest | TokenizeRequest,
                tools: list[dict[str, Any]] | None) -> str:
    """``req.messages`` through the model's chat template, as the chat endpoint and ``/tokenize`` both feed
    it; a template that refuses them is the client's 400 on ``messages``."""
    assert req.messages is not None
    try:
        return ctx.llm.apply_chat_template(template_messages(req.messages), tools=tools,
                                           tool_parser=ctx.tool_call_parser,
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message,
                                           chat_template_kwargs=req.chat_template_kwargs,
                                           content_format=ctx.content_format)
    except ValueError as e:
        raise APIError(str(e), 400, "messages") from None


class ChatPlan:
    def __init__(self, req: ChatCompletionRequest, ctx: ServingContext) -> None:
        self.req = req
        self.ctx = ctx
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError("top_logprobs requires logprobs=true", 400, "top_logprobs")
            if not 0 <= req.top_logprobs <= 20:
                raise APIError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", 400, "top_logprobs")
        template = getattr(ctx.llm.tokenizer, "chat_template", None)
        self.tools: ToolPlan | None = tool_plan(req, template, ctx.tool_call_parser)
        constraint = requested_constraint(req)
        if self.tools is not None and self.tools.forced is not None:
            if constraint is not None:
                raise APIError(f"tool_choice {self.tools.choice!r} and {constraint[0]} both constrain the output; "
                               "send one of them", 400, constraint[0])
            constraint = ("tool_choice", self.tools.forced)
        if constraint is not None:
            compile_constraint(ctx.llm, constraint[1], constraint[0])
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] if self.tools and self.tools.parses else None
        text = chat_prompt(ctx, req, tools)
        self.prompt_ids = ctx.encode(text, "messages", req.add_special_tokens)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is None:  # the model's default (generation_config's max_new_tokens), else the rest of the context
            max_tokens = ctx.sampling_defaults.get("max_tokens") or max(1, ctx.max_model_len - len(self.prompt_ids))
        if max_tokens < 1:
            raise APIError(f"{param} must be >= 1, got {max_tokens}", 400, param)
        max_tokens = ctx.clamp_max_tokens(max_tokens, self.prompt_ids)
        self.k = (req.top_logprobs or 0) if req.logprobs else None
        structured = constraint[1] if constraint is not None else None
        self.subs = [Submission(j, self.prompt_ids, make_params(req, max_tokens=max_tokens, choice=j, logprobs=self.k,
                                                                structured=structured,
                                                                defaults=ctx.sampling_defaults),
                                req.cache_salt)
                     for j in range(req.n)]
        self.parsers: dict[int, StreamingToolParser] = {}
        # --reasoning-parser: whether the output starts inside the thinking (the prompt opened it)
        self.reasoning = ctx.reasoning
        # ... unless a grammar makes the whole output the answer: JSON (or a forced tool call) from
        # its first token leaves no room for thinking, so none of it is taken for thinking
        answer_only = constraint is not None and (constraint[0] in ("response_format", "tool_choice")
                                                  or constraint[1].json is not None or bool(constraint[1].json_object))
        self.reasoning_inside = ctx.reasoning is not None and ctx.reasoning.starts_inside(text) and not answer_only
        self.splitters: dict[int, ReasoningSplitter] = {}

    def _logprobs(self, ids: list[int], lps: list[dict[int, float]] | None) -> dict[str, Any] | None:
        if self.k is None:
            return None
        tt = self.ctx.token_text
        content = []
        for tid, d in zip(ids, lps or [], strict=False):
            top = sorted(d.items(), key=lambda kv: -kv[1])[: self.k]
            content.append({
                "token": tt(tid), "logprob": d[tid], "bytes": list(tt(tid).encode("utf-8")),
                "top_logprobs": [{"token": tt(k), "logprob": v, "bytes": list(tt(k).encode("utf-8"))} for k, v in top],
            })
        return {"content": content, "refusal": None}  # OpenAI's schema: refusal required, null when none

    def _calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a finished choice."""
        if self.tools is None or not self.tools.parses:
            return text, [], finish_reason
        content, calls = self.tools.fmt.parse(text)
        if not self.tools.parallel:
            calls = calls[:1]
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return (content if calls or content is not None else text), calls, finish_reason

    def response(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = []
        for st in states:
            text, thinking = "".join(st.text), None
            if self.reasoning is not None:
                thinking, text = split_reasoning(self.reasoning, text, self.reasoning_inside)
            content, calls, reason = self._calls(text, st.finish_reason)
            if thinking is not None and not content:
                content = None  # all thinking (vLLM's null content)
            message: dict[str, Any] = {"role": self.ctx.response_role, "content": content, "refusal": None}
            if thinking is not None and self.req.include_reasoning:
                message["reasoning"] = message["reasoning_content"] = thinking
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            choices.append({"index": st.index, "message": message,
                            "logprobs": self._logprobs(st.token_ids, st.logprobs), "finish_reason": reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.ctx.model_name,
                "choices": choices, "usage": self.usage(states)}

    def usage(self, states: list[ChoiceState]) -> dict[str, Any]:
        # the prompt is counted once, as OpenAI does for n > 1: its cached tokens are choice 0's
        return usage(len(self.prompt_ids), sum(len(s.token_ids) for s in states), states[0].cached_tokens)

    def _chunk(self, st: ChoiceState, delta: dict[str, Any], logprobs: dict[str, Any] | None,
               finish_reason: str | None, first: bool) -> dict[str, Any]:
        if first:
            delta = {"role": self.ctx.response_role, **delta}
        c = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.ctx.model_name,
             "choices": [{"index": st.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
        if self.req.stream_options and self.req.stream_options.include_usage:
            c["usage"] = None
        return c

    def chunk(self, st: ChoiceState, d: Delta) -> dict[str, Any] | list[dict[str, Any]] | None:
        first = st.chunks_sent == 0
        if self.reasoning is not None:  # the thinking goes out first, the rest as content below
            sp = self.splitters.get(st.index)
            if sp is None:
                sp = self.splitters[st.index] = ReasoningSplitter(self.reasoning, self.reasoning_inside)
            thinking, text = sp.feed(d.text)
            if d.finished:
                more = sp.finish()
                thinking, text = thinking + more[0], text + more[1]
            if not self.req.include_reasoning:
                thinking = ""
            out: list[dict[str, Any]] = []
            if thinking or (self.k is not None and d.token_ids and not text):
                delta = {"reasoning": thinking, "reasoning_content": thinking} if thinking else {"content": ""}
                out.append(self._chunk(st, delta, self._logprobs(d.token_ids, d.logprobs), None, first))
                d = dataclasses.replace(d, token_ids=[], logprobs=None)  # their log-probs went out here
                first = False
            rest = self._content_chunks(st, dataclasses.replace(d, text=text), first)
            return out + ([rest] if isinstance(rest, dict) else rest or [])
        return self._content_chunks(st, d, first)

    def _content_chunks(self, st: ChoiceState, d: Delta, first: bool) -> dict[str, Any] | list[dict[str, Any]] | None:
        if self.tools is not None and self.tools.parses:
            return self._tool_chunks(st, d, first)
        if not d.text and not d.finished and not (self.k is not None and d.token_ids):
            return None  # nothing visible yet (held-back partial character or stop prefix)
        return self._chunk(st, {"content": d.text}, self._logprobs(d.token_ids, d.logprobs),
                           d.finish_reason if d.finished else None, first)

    def _tool_chunks(self, st: ChoiceState, d: Delta, first: bool) -> list[dict[str, Any]]:
        """Content is released up to a possible call; a call's id and name go out as soon as they
        are written, then its arguments piece by piece (structured/tool_stream.py)."""
        assert self.tools is not None
        parser = self.parsers.get(st.index)
        if parser is None:
            parser = self.parsers[st.index] = StreamingToolParser(
                self.tools.fmt, self.tools.forced is not None, None if self.tools.parallel else 1)
        out: list[dict[str, Any]] = []
        text, calls = parser.feed(d.text)
        if text or (self.k is not None and d.token_ids):
            out.append(self._chunk(st, {"content": text}, self._logprobs(d.token_ids, d.logprobs), None, first))
            first = False
        if d.finished:
            rest, more = parser.finish()
            if rest:
                out.append(self._chunk(st, {"content": rest}, None, None, first))
                first = False
            calls += more
        for c in calls:
            out.append(self._chunk(st, {"tool_calls": [c.as_openai()]}, None, None, first))
            first = False
        if d.finished:
            reason = "tool_calls" if parser.streamed and d.finish_reason == "stop" else d.finish_reason
            out.append(self._chunk(st, {}, None, reason, first))
        return out

    def usage_chunk(self, states: list[ChoiceState]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.ctx.model_name, "choices": [], "usage": self.usage(states)}
