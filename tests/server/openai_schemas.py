"""Validation against OpenAI's published OpenAPI document (the subset vendored under
tests/data/openai_openapi/, MIT-licensed, with the commit it came from): ``violations(name, obj)``
lists every way ``obj`` breaks the component schema ``name`` (JSON Schema 2020-12, as OpenAPI 3.1
writes it). A ``oneOf`` with a ``discriminator`` is read as ``anyOf``: the discriminator picks the
branch, so branches that overlap (a user message is both an ``EasyInputMessage`` and an ``Item``)
are not an error, as they are not for OpenAI's own SDKs."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

DOC = Path(__file__).parent.parent / "data" / "openai_openapi" / "responses_embeddings.json"


def _discriminated(node: Any) -> Any:
    if isinstance(node, list):
        return [_discriminated(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _discriminated(v) for k, v in node.items()}
    if "discriminator" in out and "oneOf" in out:
        out["anyOf"] = out.pop("oneOf")
    return out


@cache
def _components() -> dict[str, Any]:
    return _discriminated(json.loads(DOC.read_text())["components"])


@cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": _components()})


def violations(name: str, obj: Any) -> list[str]:
    return [f"{'/'.join(str(p) for p in e.absolute_path)}: {e.message[:300]}"
            for e in validator(name).iter_errors(obj)]
