"""Rebuild ``responses_embeddings.json`` from OpenAI's published OpenAPI document
(github.com/openai/openai-openapi, ``openapi.json``): the component schemas that the Responses and
embeddings requests, responses and stream events reference, transitively, with their prose
(descriptions, examples) left out. Usage: ``python subset.py path/to/openapi.json COMMIT``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOTS = ["Response", "ResponseStreamEvent", "CreateResponse", "CreateEmbeddingRequest", "CreateEmbeddingResponse",
         "ErrorResponse"]
PROSE = {"description", "example", "examples", "x-oaiMeta", "x-oaiExpandable", "x-stainless-const", "title"}


def strip(node, in_properties=False):
    """Drop prose keywords from schemas (never a property that happens to be named like one)."""
    if isinstance(node, list):
        return [strip(v) for v in node]
    if not isinstance(node, dict):
        return node
    if in_properties:
        return {k: strip(v) for k, v in node.items()}
    return {k: strip(v, k in ("properties", "patternProperties", "$defs")) for k, v in node.items() if k not in PROSE}


def closure(schemas, roots):
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        text = json.dumps(schemas[name])
        stack += [part.split('"')[0] for part in text.split('"#/components/schemas/')[1:]]
    return sorted(seen)


def main(src: str, commit: str) -> None:
    doc = json.loads(Path(src).read_text())
    schemas = doc["components"]["schemas"]
    out = {"source": "https://github.com/openai/openai-openapi/blob/" + commit + "/openapi.json",
           "openapi": doc["openapi"], "info_version": doc["info"]["version"], "roots": ROOTS,
           "components": {"schemas": {k: strip(schemas[k]) for k in closure(schemas, ROOTS)}}}
    Path(__file__).with_name("responses_embeddings.json").write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
