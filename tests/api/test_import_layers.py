"""Imports point down the layers (docs/architecture.md, "Layers"): every ``import`` in ``ratchetlm/``,
at module level or inside a function (or under ``TYPE_CHECKING``), read with ``ast`` without importing
anything. No two modules import each other, directly or round a longer loop; no module imports a
higher layer; ``engine/`` and ``layers/`` reach no model package and not ``parallel/``.

``from pkg import name`` counts as an import of ``pkg.name`` where that is a module, else of ``pkg``
(its ``__init__.py``, also when ``pkg`` holds the importing module); the package ``__init__.py`` files
Python runs before a module without its asking are not counted."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ratchetlm"

# Top first; a module may import its own layer and any layer below it. Names are the first part of a
# module's path inside ratchetlm/ ("__init__" is the package's own, the public API).
LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(layer) for layer in (
    {"__init__", "__main__", "cli", "bench", "server", "training"},  # entry points
    {"parallel"},  # tensor parallelism: wraps the engine's runner from outside
    {"engine"},  # LLM, LLMEngine, scheduler, the llama family's runner
    {"decoding", "models"},  # strategies (propose / verify / commit) and the models they run
    {"layers"},  # attention, block-quantized matmuls, norms, sampling
    {"kv", "structured", "text"},  # paged KV cache and staging; grammars and tool calls; detokenizing
    {"kernels", "memory", "errors", "outputs", "runners", "sampling_params", "sequence"},  # leaves
))
# What a model family is made of (its decoder, cache layout, runner, sharding): the engine builds a
# model's runner through runners.py and models/registry.py, never by naming one of these.
MODEL_PACKAGES = ("ratchetlm.models.llama", "ratchetlm.models.decode_chain", "ratchetlm.models.deepseek_v4",
                  "ratchetlm.models.families", "ratchetlm.models.shard")


def sources() -> dict[str, tuple[str, bool]]:
    """module name -> (its source, whether it is a package's __init__.py), for every file of ratchetlm/."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("ratchetlm", *path.relative_to(PACKAGE).with_suffix("").parts)
        is_init = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_init else parts)] = (path.read_text(), is_init)
    return out


def imports(srcs: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {imported ratchetlm module: first line}, every import statement anywhere in its file."""
    graph: dict[str, dict[str, int]] = {}
    for name, (text, is_init) in srcs.items():
        package = name if is_init else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in srcs else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in srcs:  # `import ratchetlm.x.y` of a name inside x.y
                    t = t.rpartition(".")[0]
                if t.startswith("ratchetlm") and t != name:
                    edges.setdefault(t, node.lineno)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    scc.append(x)
                    if x == v:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return found


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: ratchetlm/{top} is in no layer of LAYERS (add it where it belongs)")


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return imports(sources())


def test_the_reader_sees_every_kind_of_import():
    # a function-level import, a TYPE_CHECKING one and a relative one are arrows like any other
    a = ("from typing import TYPE_CHECKING\n\ndef f():\n    from ratchetlm import b\nif TYPE_CHECKING:\n"
         "    import ratchetlm.c.d\nfrom .e import thing\n")
    srcs = {"ratchetlm.a": (a, False), "ratchetlm.b": ("", False), "ratchetlm.c.d": ("", False),
            "ratchetlm.e": ("thing = 1", False)}
    assert imports(srcs)["ratchetlm.a"] == {"ratchetlm.b": 4, "ratchetlm.c.d": 6, "ratchetlm.e": 7}
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_no_import_circles(graph):
    found = circles(graph)
    detail = "\n".join(
        " <-> ".join(scc) + "\n" + "\n".join(f"    {a} -> {b} (line {graph[a][b]})"
                                             for a in scc for b in graph[a] if b in scc)
        for scc in found)
    assert not found, f"import circles in ratchetlm/:\n{detail}"


def test_imports_point_down_the_layers(graph):
    upward = [f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)}), line {line}"
              for a, edges in graph.items() for b, line in edges.items() if layer_of(b) < layer_of(a)]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_engine_and_layers_reach_no_model_package_and_not_parallel(graph):
    bad = [f"{a} -> {b}, line {line}" for a, edges in graph.items()
           if a.startswith(("ratchetlm.engine", "ratchetlm.layers"))
           for b, line in edges.items()
           if b.startswith(("ratchetlm.parallel", *MODEL_PACKAGES))]
    assert not bad, "\n".join(bad)
