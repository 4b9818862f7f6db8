"""``POST /v1/completions``: prompts (text, token ids, or lists of either) x ``n`` choices.

``echo`` returns the prompt before the completion, with prompt logprobs when ``logprobs`` is set
(lm-evaluation-harness loglikelihood); streamed, the prompt rides on each choice's first chunk.
``echo=True, max_tokens=0`` is prompt scoring: internally
the request runs with ``max_tokens=1`` (the engine always samples at least one token, and the
prefill that produces the prompt logprobs is the same forward), and that one token is dropped
from the response: no text, no logprobs, ``completion_tokens = 0``.
"""

from __future__ import annotations

import time
from typing import Any

from ratchetlm.server.async_engine import Delta, Submission
from ratchetlm.server.common import ChoiceState, ServingContext, make_params, new_id, usage
from ratchetlm.server.errors import APIError
from ratchetlm.server.protocol import CompletionRequest
from ratchetlm.server.structured import compile_constraint, requested_constraint


class CompletionPlan:
    def __init__(self, req: CompletionRequest, ctx: ServingContext) -> None:
        self.req = req
        self.ctx = ctx
        self.id = new_id("cmpl")
        self.created = int(time.time())
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(f"logprobs must be in [0, 20], got {req.logprobs}", 400, "logprobs")
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        self.score_only = req.echo and max_tokens == 0
        if max_tokens < 0 or (max_tokens == 0 and not req.echo):
            raise APIError(f"max_tokens must be >= 1 (0 only with echo=true), got {max_tokens}", 400, "max_tokens")
        self.prompts = self._prompts(req.prompt)
        self.prompt_texts = [self._prompt_text(p, ids) for p, ids in self.prompts] if req.echo else None
        prompt_lp = req.logprobs if (req.echo and req.logprobs is not None) else None
        constraint = requested_constraint(req)
        structured = None
        if constraint is not None and not self.score_only:
            compile_constraint(ctx.llm, constraint[1], constraint[0])
            structured = constraint[1]
        self.subs = [
            Submission(i * req.n + j, ids, make_params(
                req, max_tokens=1 if self.score_only else ctx.clamp_max_tokens(max_tokens, ids), choice=j,
                logprobs=None if self.score_only else req.logprobs, prompt_logprobs=prompt_lp,
                structured=structured, defaults=ctx.sampling_defaults), req.cache_salt)
            for i, (_, ids) in enumerate(self.prompts) for j in range(req.n)
        ]
        self.offsets = [0] * len(self.subs)

    def _prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError("prompt must not be empty", 400, "prompt")
        return [(p if isinstance(p, str) else None, self.ctx.encode(p, "prompt", self.req.add_special_tokens))
                for p in items]

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.ctx.llm.tokenizer.decode(ids, skip_special_tokens=False)

    def _prompt_of(self, index: int) -> int:
        return index // self.req.n

    def _prompt_text_of(self, index: int) -> str:
        assert self.prompt_texts is not None, "prompt texts are kept only for echo"
        return self.prompt_texts[self._prompt_of(index)]

    # ------------------------------------------------------------------ rendering

    def _logprobs(self, st: ChoiceState, ids: list[int], lps: list[dict[int, float]],
                  with_prompt: bool) -> dict[str, Any] | None:
        """OpenAI completions logprobs for ``ids`` (plus the echoed prompt on the first piece)."""
        if self.req.logprobs is None:
            return None
        tt = self.ctx.token_text
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if with_prompt:
            p_ids = self.prompts[self._prompt_of(st.index)][1]
            # a preempted-and-recomputed prompt appends its prompt logprobs again: the first pass counts
            p_lps = (st.prompt_logprobs or [])[: len(p_ids)]
            p_lps += [None] * (len(p_ids) - len(p_lps))
            for tid, d in zip(p_ids, p_lps, strict=True):
                tokens.append(tt(tid))
                token_lps.append(None if d is None else d[tid])
                tops.append(None if d is None else {tt(k): v for k, v in d.items()})
        for tid, d in zip(ids, lps, strict=False):
            tokens.append(tt(tid))
            token_lps.append(d[tid])
            tops.append({tt(k): v for k, v in d.items()})
        offsets = []  # character offset of each token in this choice's returned text
        off = self.offsets[st.index]
        for t in tokens:
            offsets.append(off)
            off += len(t)
        self.offsets[st.index] = off
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _gen(self, ids: list[int], lps: list[dict[int, float]] | None) -> tuple[list[int], list]:
        if self.score_only:
            return [], []
        return ids, (lps or [])

    def response(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = []
        for st in states:
            ids, lps = self._gen(st.token_ids, st.logprobs)
            text = "" if self.score_only else "".join(st.text)
            if self.req.echo:
                text = self._prompt_text_of(st.index) + text
            choices.append({"index": st.index, "text": text,
                            "logprobs": self._logprobs(st, ids, lps, self.req.echo),
                            "finish_reason": st.finish_reason})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name,
                "choices": choices, "usage": self.usage(states)}

    def usage(self, states: list[ChoiceState]) -> dict[str, Any]:
        completion = 0 if self.score_only else sum(len(s.token_ids) for s in states)
        # each prompt is counted once (not per choice): its cached tokens are its first choice's
        cached = sum(states[i * self.req.n].cached_tokens for i in range(len(self.prompts)))
        return usage(sum(len(ids) for _, ids in self.prompts), completion, cached)

    def chunk(self, st: ChoiceState, d: Delta) -> dict[str, Any] | None:
        ids, lps = self._gen(d.token_ids, d.logprobs)
        text = "" if self.score_only else d.text
        echo = self.prompt_texts is not None and st.chunks_sent == 0  # the prompt rides on the first chunk
        if echo:
            text = self._prompt_text_of(st.index) + text
        if not text and not d.finished and not (self.req.logprobs is not None and ids):
            return None  # nothing visible yet (held-back partial character or stop prefix)
        # no "usage": null here (OpenAI's completion object has no null usage); the usage chunk ends the stream
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name,
                "choices": [{"index": st.index, "text": text, "logprobs": self._logprobs(st, ids, lps, echo),
                             "finish_reason": d.finish_reason if d.finished else None}]}

    def usage_chunk(self, states: list[ChoiceState]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name,
                "choices": [], "usage": self.usage(states)}
