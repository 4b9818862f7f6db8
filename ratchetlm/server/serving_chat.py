"""``POST /v1/chat/completions``: the model's chat template applied to ``messages``, ``n`` choices.

Streaming never sends a role-only chunk: the role rides on each choice's first chunk that carries
content (or its finishing chunk), so time-to-first-chunk is the time to the first real token.
"""

from __future__ import annotations

import time
from typing import Any

from ratchetlm.server.async_engine import Delta, Submission
from ratchetlm.server.common import ChoiceState, ServingContext, make_params, new_id, usage
from ratchetlm.server.errors import APIError
from ratchetlm.server.protocol import ChatCompletionRequest


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
        try:
            text = ctx.llm.apply_chat_template([m.as_template_dict() for m in req.messages])
        except ValueError as e:
            raise APIError(str(e), 400, "messages") from None
        self.prompt_ids = ctx.encode(text, "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = max(1, ctx.max_model_len - len(self.prompt_ids))  # the rest of the context
        if max_tokens < 1:
            raise APIError(f"{param} must be >= 1, got {max_tokens}", 400, param)
        max_tokens = ctx.clamp_max_tokens(max_tokens, self.prompt_ids)
        self.k = (req.top_logprobs or 0) if req.logprobs else None
        self.subs = [Submission(j, self.prompt_ids, make_params(req, max_tokens=max_tokens, choice=j, logprobs=self.k))
                     for j in range(req.n)]

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
        return {"content": content}

    def response(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = [{"index": st.index, "message": {"role": "assistant", "content": "".join(st.text)},
                    "logprobs": self._logprobs(st.token_ids, st.logprobs), "finish_reason": st.finish_reason}
                   for st in states]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.ctx.model_name,
                "choices": choices, "usage": self.usage(states)}

    def usage(self, states: list[ChoiceState]) -> dict[str, int]:
        return usage(len(self.prompt_ids), sum(len(s.token_ids) for s in states))

    def chunk(self, st: ChoiceState, d: Delta) -> dict[str, Any] | None:
        if not d.text and not d.finished and not (self.k is not None and d.token_ids):
            return None  # nothing visible yet (held-back partial character or stop prefix)
        delta: dict[str, Any] = {"content": d.text}
        if st.chunks_sent == 0:
            delta = {"role": "assistant", **delta}
        c = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.ctx.model_name,
             "choices": [{"index": st.index, "delta": delta, "logprobs": self._logprobs(d.token_ids, d.logprobs),
                          "finish_reason": d.finish_reason if d.finished else None}]}
        if self.req.stream_options and self.req.stream_options.include_usage:
            c["usage"] = None
        return c

    def usage_chunk(self, states: list[ChoiceState]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.ctx.model_name, "choices": [], "usage": self.usage(states)}
