"""A request's output constraint and tools -> the engine's :class:`StructuredOutputsParams`.

Spellings accepted (at most one per request; a ``tool_choice`` that forces calls is one more):
OpenAI's ``response_format`` (``text`` / ``json_object`` / ``json_schema``), vLLM's
``structured_outputs`` object (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and
its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields. The
constraint is compiled here, in the request-preparation pool, so an invalid or too-complex one
is a 400 before anything is queued (the engine then finds it in the compiler's cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ratchetlm.sampling_params import StructuredOutputsParams
from ratchetlm.server.errors import APIError
from ratchetlm.structured.tool_calls import Function, ToolFormat, functions_from, tool_format


def _spec(param: str, **kw: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise APIError(f"{param}: {e}", 400, param) from None


def requested_constraint(req: Any) -> tuple[str, StructuredOutputsParams] | None:
    """(the field that asked, the constraint) or None; 400 when several fields ask."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", _spec("response_format", json_object=True)))
        else:
            js = rf.json_schema
            if js is None or js.schema_ is None:
                raise APIError("response_format.json_schema.schema is required for type json_schema", 400,
                               "response_format")
            schema = closed_objects(js.schema_) if js.strict else js.schema_
            found.append(("response_format", _spec("response_format", json=schema)))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        found.append(("structured_outputs", _spec("structured_outputs", json=so.json_, regex=so.regex,
                                                  choice=so.choice, grammar=so.grammar,
                                                  json_object=so.json_object or None,
                                                  whitespace_flexible=not so.disable_any_whitespace
                                                  if so.disable_any_whitespace is not None else False)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        v = getattr(req, name, None)
        if v is not None:
            found.append((name, _spec(name, **{key: v})))
    if len(found) > 1:
        raise APIError(f"only one output constraint per request; got {', '.join(n for n, _ in found)}", 400,
                       found[1][0])
    return found[0] if found else None


def closed_objects(schema: Any) -> Any:
    """OpenAI's strict mode: every object schema that does not say otherwise gets
    ``additionalProperties: false`` (OpenAI requires it; without it a model may add keys forever)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's ``tools`` / ``tool_choice`` ask for."""

    fmt: ToolFormat
    functions: list[Function]
    choice: str  # "auto" | "none" | "required" | "named"
    parallel: bool
    forced: StructuredOutputsParams | None  # the grammar forcing calls (required / named)

    @property
    def parses(self) -> bool:
        """Whether the output is searched for calls."""
        return self.choice != "none" and bool(self.functions)


def tool_plan(req: Any, chat_template: str | None, parser: str | None) -> ToolPlan | None:
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools", 400, "tool_choice")
        return None
    try:
        funcs = functions_from([t.model_dump(exclude_none=True) for t in tools])
        fmt = tool_format(parser, chat_template)
    except ValueError as e:
        raise APIError(str(e), 400, "tools") from None
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    if choice is None:
        choice = "auto"
    named = None
    if not isinstance(choice, str):
        named = choice.function.name
        match = [f for f in funcs if f.name == named]
        if not match:
            raise APIError(f"tool_choice names the function {named!r}, which is not in tools", 400, "tool_choice")
        forced = _spec("tool_choice", grammar=fmt.grammar(match, many=False))
        return ToolPlan(fmt, funcs, "named", False, forced)
    if choice == "required":
        return ToolPlan(fmt, funcs, "required", parallel, _spec("tool_choice", grammar=fmt.grammar(funcs, parallel)))
    return ToolPlan(fmt, funcs, choice, parallel, None)


def compile_constraint(llm: Any, spec: StructuredOutputsParams, param: str) -> None:
    """Compile now (cached for the engine); an invalid or too-complex constraint is a 400."""
    engine = getattr(llm, "engine", None)
    factory = getattr(engine, "controls", None)
    if factory is None:
        return  # an engine without a grammar compiler refuses the request when it is queued
    from ratchetlm.sampling_params import SamplingParams
    from ratchetlm.structured.grammar import GrammarError

    strategy = getattr(engine, "strategy", None)
    try:
        if strategy is not None:  # a strategy that cannot honour a grammar says so first (WeDLM)
            strategy.check_request(SamplingParams(structured=spec))
        factory.compiler.compile(spec)
    except (GrammarError, ValueError) as e:
        raise APIError(f"{param}: {e}", 400, param) from None
