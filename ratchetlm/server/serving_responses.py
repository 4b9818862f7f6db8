"""``POST /v1/responses`` (OpenAI's Responses API) on the chat machinery.

The request becomes a chat request (server/protocol_responses.py) served by :class:`ChatPlan`
exactly as ``/v1/chat/completions`` serves it: the same template, tool-call parsing (streamed
calls included), structured outputs and sampling. Only the rendering differs: the choice's text
becomes an output ``message`` item with one ``output_text`` part, each call a ``function_call``
item; streams are the Responses events (``response.created`` ... ``response.completed``, each with
a ``sequence_number`` and an SSE ``event:`` line, no ``[DONE]``), translated from the chat chunks.
With ``--reasoning-parser`` the thinking comes first, as a ``reasoning`` item with one
``reasoning_text`` content part (streamed as ``response.reasoning_text.delta`` / ``.done``).

``previous_response_id`` continues a stored conversation (server/responses_store.py): the earlier
turns' messages and outputs come first, then this request's input.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from ratchetlm.server.common import SSE_DONE, ChoiceState, Runner, ServingContext
from ratchetlm.server.config import ServerConfig
from ratchetlm.server.errors import APIError, from_validation
from ratchetlm.server.protocol import ChatCompletionRequest
from ratchetlm.server.protocol_responses import ResponsesRequest, chat_request_body, responses_param
from ratchetlm.server.responses_store import ResponseStore, StoredResponse
from ratchetlm.server.serving_chat import ChatPlan

Event = dict[str, Any]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _renamed(e: APIError) -> APIError:
    """An error of the chat machinery, naming the field as the Responses request spells it."""
    param = responses_param(e.param)
    msg = e.message
    if e.param and param is not None and param != e.param and msg.startswith(e.param):
        msg = param + msg[len(e.param):]
    return APIError(msg, e.status, param)


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


class ResponsesPlan:
    """What ``_serve`` needs of a plan (``subs``, ``prompt_param``) plus :meth:`respond`, which
    renders the response (whole or as events) from the request group's run."""

    prompt_param = "input"

    def __init__(self, req: ResponsesRequest, ctx: ServingContext, store: ResponseStore,
                 limits: ServerConfig | None = None) -> None:
        self.req = req
        self.ctx = ctx
        self.store = store
        self.id = _id("resp")
        self.created = int(time.time())
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = store.get(req.previous_response_id)
            if prev is None:
                raise APIError(f"previous_response_id: no stored response has the id {req.previous_response_id!r} "
                               "(responses are kept in memory, the most recent ones only)", 404,
                               "previous_response_id")
            history = prev.history
        body = chat_request_body(req, history)
        try:
            chat_req = ChatCompletionRequest.model_validate(body, context={"limits": limits or ServerConfig()})
            self.chat = ChatPlan(chat_req, ctx)
        except ValidationError as e:
            raise _renamed(from_validation(e)) from None
        except APIError as e:
            raise _renamed(e) from None
        self.subs = self.chat.subs
        self.history_in = body["messages"][1:] if req.instructions is not None else body["messages"]
        # streaming state: the output items so far, the open message and calls
        self.items: list[dict[str, Any]] = []
        self.msg: dict[str, Any] | None = None
        self.thought: dict[str, Any] | None = None  # the open reasoning item
        self.held = ""  # leading whitespace of a message not opened yet
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its open item
        self.finish_reason: str | None = None

    # ------------------------------------------------------------------ the response object

    def snapshot(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 finish_reason: str | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None else None
        tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                  "strict": t.strict} for t in req.tools or []]
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        body = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": None,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.ctx.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store,
            "temperature": self._sampling("temperature", req.temperature),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": tools,
            "top_p": self._sampling("top_p", req.top_p), "truncation": "disabled",
            "metadata": req.metadata or {},
        }
        for key, value in (("usage", usage), ("user", req.user)):  # objects / strings when present (no nulls)
            if value is not None:
                body[key] = value
        return body

    def _sampling(self, name: str, given: float | None) -> float:
        """The value a sampling parameter ran with: the request's, else the model's default, else 1."""
        return float(given if given is not None else self.ctx.sampling_defaults.get(name, 1.0))

    def usage(self, states: list[ChoiceState]) -> dict[str, Any]:
        u = self.chat.usage(states)
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    def finish(self, states: list[ChoiceState], output: list[dict[str, Any]], reason: str | None) -> dict[str, Any]:
        """The final response object; kept for ``previous_response_id`` unless ``store`` is false."""
        status = "incomplete" if reason == "length" else "completed"
        body = self.snapshot(status, output, self.usage(states), reason)
        if self.req.store:
            self.store.put(self.id, StoredResponse(body, self.history_in + _as_chat(output)))
        return body

    def whole(self, states: list[ChoiceState]) -> dict[str, Any]:
        """The non-streamed response: the chat machinery's parsed message as output items."""
        choice = self.chat.response(states)["choices"][0]
        msg, reason = choice["message"], choice["finish_reason"]
        content, calls = msg.get("content"), msg.get("tool_calls") or []
        status = "incomplete" if reason == "length" else "completed"
        output = []
        thinking = msg.get("reasoning")
        if thinking is not None:
            output.append(_reasoning_item(thinking, status))
        if (not calls and thinking is None) or (content or "").strip():
            output.append({"id": _id("msg"), "type": "message", "role": "assistant", "status": status,
                           "content": [_text_part(content or "")]})
        for c in calls:
            output.append({"id": _id("fc"), "type": "function_call", "call_id": c["id"],
                           "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                           "status": "completed"})
        return self.finish(states, output, reason)

    async def respond(self, runner: Runner) -> Response:
        if self.req.stream:
            return StreamingResponse(self.events(runner), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await runner.collect()  # an engine fault is the request's 4xx/5xx (Runner.collect)
        return JSONResponse(self.whole(runner.states))

    # ------------------------------------------------------------------ streaming

    async def events(self, runner: Runner) -> AsyncIterator[str]:
        """The Responses event stream: created, in_progress, the items' events (translated from
        the chat chunks of :meth:`ChatPlan.chunk`), then completed / incomplete (or error and
        failed). Every event has the next ``sequence_number``."""
        seq = 0

        def sse(ev: Event) -> str:
            nonlocal seq
            ev["sequence_number"] = seq
            seq += 1
            return f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False, separators=(',', ':'))}\n\n"

        yield sse({"type": "response.created", "response": self.snapshot("in_progress", [])})
        yield sse({"type": "response.in_progress", "response": self.snapshot("in_progress", [])})
        async for line in runner.stream(self.chunk, lambda: self.final(runner.states)):
            if line == SSE_DONE:
                continue
            ev = json.loads(line[len("data: "):])
            if "type" not in ev and "error" in ev:  # the run failed after the stream started
                err = ev["error"]
                yield sse({"type": "error", "code": str(err.get("code")), "message": err["message"],
                           "param": err.get("param")})
                failed = self.snapshot("failed", self.items)
                failed["error"] = {"code": "server_error", "message": err["message"]}
                yield sse({"type": "response.failed", "response": failed})
                continue
            yield sse(ev)

    def chunk(self, st: ChoiceState, d: Any) -> list[Event]:
        """One committed delta -> its Responses events (via the chat chunks, so streamed tool
        calls are found exactly as ``/v1/chat/completions`` finds them)."""
        c = self.chat.chunk(st, d)
        out: list[Event] = []
        for one in [c] if isinstance(c, dict) else (c or []):
            choice = one["choices"][0]
            delta = choice["delta"]
            if delta.get("reasoning"):
                out += self._thinking(delta["reasoning"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            if choice["finish_reason"] is not None:
                self.finish_reason = choice["finish_reason"]
                out += self._close_all()
        return out

    def _thinking(self, text: str) -> list[Event]:
        if self.thought is None:
            self.thought = _reasoning_item("", "in_progress")
            self.thought_index = len(self.items)
            self.items.append(self.thought)
            added = {"type": "response.output_item.added", "output_index": self.thought_index,
                     "item": {**self.thought, "content": []}}
            part = {"type": "response.content_part.added", "item_id": self.thought["id"],
                    "output_index": self.thought_index, "content_index": 0,
                    "part": {"type": "reasoning_text", "text": ""}}
            return [added, part, *self._thinking(text)]
        self.thought["content"][0]["text"] += text
        return [{"type": "response.reasoning_text.delta", "item_id": self.thought["id"],
                 "output_index": self.thought_index, "content_index": 0, "delta": text}]

    def _close_thinking(self) -> list[Event]:
        item, self.thought = self.thought, None
        if item is None:
            return []
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        i, part = self.items.index(item), item["content"][0]
        return [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": i,
                 "content_index": 0, "text": part["text"]},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": i, "content_index": 0,
                 "part": dict(part)},
                {"type": "response.output_item.done", "output_index": i, "item": json.loads(json.dumps(item))}]

    def _text(self, text: str) -> list[Event]:
        if self.msg is None:
            if not (self.held + text).strip():
                self.held += text  # whitespace before calls is not a message
                return []
            text, self.held = self.held + text, ""
            return self._close_thinking() + self._open_message() + self._text(text)
        self.msg["content"][0]["text"] += text
        return [{"type": "response.output_text.delta", "item_id": self.msg["id"], "output_index": self.msg_index,
                 "content_index": 0, "delta": text, "logprobs": []}]

    def _open_message(self) -> list[Event]:
        self.msg = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
        self.msg_index = len(self.items)
        self.items.append(self.msg)
        added = {"type": "response.output_item.added", "output_index": self.msg_index,
                 "item": {**self.msg, "content": []}}
        self.msg["content"].append(_text_part(""))
        return [added, {"type": "response.content_part.added", "item_id": self.msg["id"],
                        "output_index": self.msg_index, "content_index": 0, "part": _text_part("")}]

    def _close_message(self) -> list[Event]:
        msg, self.msg = self.msg, None
        if msg is None:
            return []
        msg["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        part = msg["content"][0]
        i = self.items.index(msg)
        return [{"type": "response.output_text.done", "item_id": msg["id"], "output_index": i, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": msg["id"], "output_index": i, "content_index": 0,
                 "part": dict(part)},
                {"type": "response.output_item.done", "output_index": i, "item": json.loads(json.dumps(msg))}]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        out: list[Event] = []
        args = call["function"].get("arguments") or ""
        if call.get("id") is not None:  # a new call: its head
            out += self._close_thinking() + self._close_message()
            item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            self.calls[call["index"]] = item
            self.items.append(item)
            out.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)})
        item = self.calls[call["index"]]
        if args:
            item["arguments"] += args
            out.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                        "output_index": self.items.index(item), "delta": args})
        return out

    def _close_all(self) -> list[Event]:
        out = self._close_thinking()
        if not self.items and self.msg is None:  # nothing but (maybe) whitespace: an empty message
            text, self.held = self.held, ""
            out += self._open_message()
            if text:
                out += self._text(text)
            return out + self._close_message()
        out += self._close_message()
        for item in self.calls.values():
            item["status"] = "completed"
            i = self.items.index(item)
            out += [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": i,
                     "name": item["name"], "arguments": item["arguments"]},
                    {"type": "response.output_item.done", "output_index": i, "item": dict(item)}]
        self.calls = {}
        return out

    def final(self, states: list[ChoiceState]) -> Event:
        body = self.finish(states, self.items, self.finish_reason)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return {"type": kind, "response": body}


def _as_chat(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items -> the assistant chat message a follow-up's history holds."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}]


def add_response_routes(app: FastAPI, store: ResponseStore) -> None:
    """``GET`` / ``DELETE /v1/responses/{id}`` on the stored responses."""

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        item = store.get(response_id)
        if item is None:
            raise APIError(f"no stored response has the id {response_id!r}", 404, "response_id")
        return JSONResponse(item.body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        if not store.delete(response_id):
            raise APIError(f"no stored response has the id {response_id!r}", 404, "response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
