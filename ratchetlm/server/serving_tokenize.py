"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (text, tokenized as ``/v1/completions`` does) or chat ``messages``
(rendered by the chat template, with ``tools``, ``add_generation_prompt``, ``continue_final_message``
and ``chat_template_kwargs``, as ``/v1/chat/completions`` does); ``add_special_tokens`` defaults to
each endpoint's own (true for a prompt, false for messages), so the ids are exactly what is fed. It
answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
``/detokenize`` turns ``tokens`` back into ``{"prompt": text}``.
"""

from __future__ import annotations

from typing import Any

from ratchetlm.server.common import ServingContext
from ratchetlm.server.errors import APIError
from ratchetlm.server.protocol import DetokenizeRequest, TokenizeRequest
from ratchetlm.server.serving_chat import chat_prompt


def tokenize(req: TokenizeRequest, ctx: ServingContext) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of prompt and messages", 400, "prompt")
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = ctx.encode(chat_prompt(ctx, req, tools), "messages", bool(req.add_special_tokens))
    else:
        assert req.prompt is not None
        ids = ctx.encode(req.prompt, "prompt", req.add_special_tokens is not False)
    strs = [ctx.token_text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, ctx: ServingContext) -> dict[str, Any]:
    vocab = ctx.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", 400, "tokens")
    return {"prompt": ctx.llm.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(ctx: ServingContext) -> dict[str, Any]:
    """vLLM's ``GET /tokenizer_info``: what a client needs to tokenize and template like the server
    (lm-evaluation-harness uses it with ``/tokenize`` and ``/detokenize`` as a remote tokenizer)."""
    tok = ctx.llm.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__, "model_max_length": ctx.max_model_len,
                            "vocab_size": ctx.vocab_size, "chat_template": getattr(tok, "chat_template", None)}
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        v = getattr(tok, name, None)
        info[name] = v if isinstance(v, str) else None
    return info
