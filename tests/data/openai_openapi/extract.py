"""Extract the component schemas the server tests validate against from OpenAI's published
OpenAPI document (github.com/openai/openai-openapi, ``openapi.json``, MIT licensed: LICENSE here).

    python tests/data/openai_openapi/extract.py path/to/openapi.json [COMMIT]

writes ``schemas.json``: the named response schemas and everything they reference, verbatim except
that string-valued ``description`` keys are dropped (size). ``nullable`` is left as published; the
validator (tests/server/openai_schema.py) reads it as JSON Schema's null type.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOTS = [
    # /v1/chat/completions, /v1/completions, /v1/models, errors
    "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
    "ListModelsResponse", "Model", "ErrorResponse",
    # /v1/responses and /v1/embeddings
    "Response", "ResponseStreamEvent", "CreateEmbeddingResponse",
    # request bodies the tests send, checked as OpenAI's API would accept them
    "CreateResponse", "CreateEmbeddingRequest",
]


def _refs(node: object, out: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            out.add(ref.rsplit("/", 1)[1])
        for v in node.values():
            _refs(v, out)
    elif isinstance(node, list):
        for v in node:
            _refs(v, out)


def _strip(node: object) -> object:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def main(src: str, commit: str = "") -> None:
    doc = json.loads(Path(src).read_text())
    schemas = doc["components"]["schemas"]
    keep: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found: set[str] = set()
        _refs(schemas[name], found)
        todo += sorted(found)
    out = {"source": "https://github.com/openai/openai-openapi openapi.json", "commit": commit,
           "openapi": doc["openapi"], "roots": ROOTS,
           "components": {"schemas": {k: _strip(schemas[k]) for k in sorted(keep)}}}
    Path(__file__).with_name("schemas.json").write_text(json.dumps(out, separators=(",", ":"), sort_keys=True))


if __name__ == "__main__":
    main(*sys.argv[1:])
