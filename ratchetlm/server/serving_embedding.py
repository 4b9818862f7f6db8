"""``POST /v1/embeddings`` on the pooling runner (``ratchet serve --runner pooling``, engine/pooling.py).

``input``: a string, a list of strings, a list of token ids or a list of token-id lists (OpenAI's
four shapes); ``encoding_format``: ``float`` (lists of numbers) or ``base64`` (the float32 values'
little-endian bytes, what the openai client asks for by default); ``dimensions`` is a 400 unless
it is the model's hidden size (no model served here is trained for shorter vectors). vLLM's
``normalize`` overrides the server's ``--pooling-normalize`` for one request.

The vectors are computed in the request-preparation pool, by write-free forwards, one at a time
(``LLM.forward_lock``): the pooling runner never generates, so the engine thread never runs a
forward meanwhile and no KV block is taken (engine/pooling.py).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import torch
from pydantic import Field

from ratchetlm.engine.pooling import PoolingParams, encode
from ratchetlm.server.common import ServingContext
from ratchetlm.server.errors import APIError
from ratchetlm.server.protocol import _Request


class EmbeddingRequest(_Request):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    normalize: bool | None = None  # vLLM's extra


def runner_of(ctx: ServingContext) -> str:
    return str(getattr(getattr(ctx.llm, "config", None), "runner", "generate"))


def create_embeddings(req: EmbeddingRequest, ctx: ServingContext) -> dict[str, Any]:
    if runner_of(ctx) != "pooling":
        raise APIError("this server runs the generate runner: embeddings need `ratchet serve --runner pooling`",
                       400, "model")
    items: list[Any] = [req.input] if isinstance(req.input, str) or (
        req.input and all(isinstance(t, int) for t in req.input)) else list(req.input)
    if not items:
        raise APIError("input: must not be empty", 400, "input")
    vocab = ctx.vocab_size
    for i, item in enumerate(items):
        if isinstance(item, str) and not item:
            raise APIError(f"input[{i}]: an empty string has no tokens to embed", 400, "input")
        if isinstance(item, list) and (not item or any(not 0 <= t < vocab for t in item)):
            raise APIError(f"input[{i}]: token ids must be a non-empty list of integers in [0, {vocab})", 400,
                           "input")
    hidden = int(ctx.llm.model_config.hidden_size)
    if req.dimensions is not None and req.dimensions != hidden:
        raise APIError(f"dimensions={req.dimensions} is not supported: this model's embeddings have {hidden} "
                       "dimensions and it was not trained for shorter ones", 400, "dimensions")
    try:
        outs = encode(ctx.llm, items, PoolingParams(normalize=req.normalize), "embed")
    except ValueError as e:
        raise APIError(str(e), 400, "input") from None
    data = []
    for i, o in enumerate(outs):
        vec: torch.Tensor = o.outputs.data.to(torch.float32)
        emb: Any = (base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode("ascii")
                    if req.encoding_format == "base64" else vec.tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"object": "list", "data": data, "model": ctx.model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
