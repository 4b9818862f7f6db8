"""Validate response bodies, stream chunks and errors against OpenAI's published schemas
(tests/data/openai_openapi/schemas.json, extracted from github.com/openai/openai-openapi).

``violations(component, body)`` lists what a strict client would reject (empty: valid);
``COMPONENT_OF`` names the schema of each response shape. OpenAPI's ``nullable: true`` is read as
JSON Schema's null type, and a ``oneOf`` with a ``discriminator`` as ``anyOf``. To validate
another endpoint, add its response schema to ``extract.py``'s ``ROOTS`` (``Response``,
``ResponseStreamEvent``, ``CreateEmbeddingResponse`` and the request bodies ``CreateResponse`` /
``CreateEmbeddingRequest`` are already there) and name it here.

Two places where the published document describes less than OpenAI's own API sends, read as the API
sends them (:data:`RELAXED`, nothing else is relaxed): the legacy completions object is also the
shape of each streamed chunk, whose ``finish_reason`` is null until the last; and with ``echo`` the
first prompt token has no log-prob (nothing precedes it): null in ``token_logprobs`` /
``top_logprobs``, as OpenAI's completions API and vLLM answer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "openai_openapi" / "schemas.json"

# response shape -> component schema (a streamed completion's chunks are CreateCompletionResponse
# objects, as OpenAI documents them)
COMPONENT_OF = {
    "chat": "CreateChatCompletionResponse", "chat_chunk": "CreateChatCompletionStreamResponse",
    "completion": "CreateCompletionResponse", "completion_chunk": "CompletionChunk",
    "models": "ListModelsResponse", "model": "Model", "error": "ErrorResponse",
    "response": "Response", "response_event": "ResponseStreamEvent", "embeddings": "CreateEmbeddingResponse",
}


def _json_schema(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` -> a JSON Schema that also admits null."""
    if isinstance(node, list):
        return [_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _json_schema(v) for k, v in node.items() if k != "nullable"}
    if "discriminator" in out and "oneOf" in out:
        # the discriminator picks the branch, so overlapping branches (a user message is both an
        # EasyInputMessage and an Item) are not an error, as they are not for OpenAI's own SDKs
        out["anyOf"] = out.pop("oneOf")
    if node.get("nullable") is True:
        t = out.get("type")
        if isinstance(t, str) and "$ref" not in out and not any(k in out for k in ("anyOf", "oneOf", "allOf")):
            out["type"] = [t, "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        else:
            return {"anyOf": [out, {"type": "null"}]}
    return out


def _completion_choice(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]["items"]


def _echo_nulls(doc: dict[str, Any]) -> None:
    lp = _completion_choice(doc)["properties"]["logprobs"]["anyOf"][0]["properties"]
    for name in ("token_logprobs", "top_logprobs"):
        lp[name]["items"] = {"anyOf": [lp[name]["items"], {"type": "null"}]}


def _chunk_finish_reason(doc: dict[str, Any]) -> None:
    fr = _completion_choice(doc)["properties"]["finish_reason"]
    fr["type"], fr["enum"] = ["string", "null"], [*fr["enum"], None]


# component -> (why, patch): the only departures from the published document (see the docstring)
RELAXED: dict[str, list[Any]] = {
    "CreateCompletionResponse": [("echo: the first prompt token has no log-prob", _echo_nulls)],
    "CompletionChunk": [("echo: the first prompt token has no log-prob", _echo_nulls),
                        ("a streamed chunk's finish_reason is null until the last", _chunk_finish_reason)],
}


@functools.cache
def _document(component: str) -> dict[str, Any]:
    doc = _json_schema(json.loads(SCHEMAS.read_text()))
    for _, patch in RELAXED.get(component, []):
        patch(doc)
    return doc


@functools.cache
def _validator(component: str) -> Any:
    from jsonschema import Draft202012Validator

    doc = _document(component)
    name = "CreateCompletionResponse" if component == "CompletionChunk" else component
    if name not in doc["components"]["schemas"]:
        raise KeyError(f"{name} is not in {SCHEMAS.name}: add it to extract.py's ROOTS")
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return Draft202012Validator(schema)


def violations(component: str, body: Any) -> list[str]:
    """Every violation of ``component`` (a schema name, or a key of ``COMPONENT_OF``) by ``body``."""
    name = COMPONENT_OF.get(component, component)
    return [f"{name} at {'/'.join(str(p) for p in e.absolute_path) or '.'}: {e.message}"
            for e in _validator(name).iter_errors(body)]


def assert_valid(component: str, body: Any) -> None:
    found = violations(component, body)
    assert not found, "\n".join(found)
