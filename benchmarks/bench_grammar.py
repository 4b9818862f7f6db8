"""xgrammar vs llguidance on the default model's tokenizer: how the grammar engine was chosen.

For each engine and each JSON schema: the one-off tokenizer setup, the compile time of the
schema (cold: a fresh compiler / matcher each repeat), and the per-token cost of walking a valid
document token by token (compute the next-token mask, then accept the token) — the work the
sampler adds to every constrained decode step. Also: forced-token support (what jump-forward
needs) and rollback. Medians over ``--repeats``.

    python benchmarks/bench_grammar.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from ratchetlm.models.loader import resolve
from ratchetlm.models.tokenizer import load_tokenizer

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person": (
        {"type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        }, "required": ["name", "age", "email", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines"]},
    ),
    "invoice": (
        {"type": "object", "properties": {
            "id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "status": {"enum": ["draft", "sent", "paid"]},
            "customer": {"type": "object", "properties": {
                "name": {"type": "string"}, "address": {"type": "object", "properties": {
                    "street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False}},
                "required": ["name", "address"], "additionalProperties": False},
            "lines": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number", "minimum": 0}},
                "required": ["sku", "qty", "price"], "additionalProperties": False}},
            "total": {"type": "number"},
        }, "required": ["id", "status", "customer", "lines", "total"], "additionalProperties": False},
        {"id": "INV-0042", "status": "paid", "customer": {"name": "Acme", "address": {
            "street": "1 Main St", "city": "Springfield", "zip": "12345"}},
         "lines": [{"sku": "A-1", "qty": 2, "price": 9.5}, {"sku": "B-7", "qty": 1, "price": 20}], "total": 39},
    ),
    "any_json": ({"type": "object"}, {"a": [1, 2, {"b": None}], "c": "text", "d": 1.5e3}),
}


def _median_ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


def bench_xgrammar(tok: Any, vocab: int, repeats: int) -> dict[str, Any]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    setup = time.perf_counter() - t0
    out: dict[str, Any] = {"setup_ms": 1000 * setup}
    for name, (schema, doc) in SCHEMAS.items():
        text = json.dumps(doc)
        ids = tok.encode(text, add_special_tokens=False)
        compiles, steps = [], []
        for _ in range(repeats):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            compiles.append(time.perf_counter() - t0)
            m = xgr.GrammarMatcher(compiled)
            bm = xgr.allocate_token_bitmask(1, vocab)
            t0 = time.perf_counter()
            for t in ids:
                m.fill_next_token_bitmask(bm)
                assert m.accept_token(t), (name, t)
            steps.append((time.perf_counter() - t0) / len(ids))
        out[name] = {"compile_ms": _median_ms(compiles), "per_token_ms": _median_ms(steps), "tokens": len(ids)}
    return out


def bench_llguidance(tok: Any, vocab: int, repeats: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    out: dict[str, Any] = {"setup_ms": 1000 * setup}
    for name, (schema, doc) in SCHEMAS.items():
        text = json.dumps(doc)
        ids = tok.encode(text, add_special_tokens=False)
        compiles, steps = [], []
        for _ in range(repeats):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
            t0 = time.perf_counter()
            m = llguidance.LLMatcher(lt, grammar, log_level=0)
            compiles.append(time.perf_counter() - t0)
            assert not m.is_error(), m.get_error()
            bm = llt.allocate_token_bitmask(1, vocab)
            t0 = time.perf_counter()
            for t in ids:
                llt.fill_next_token_bitmask(m, bm, 0)
                assert m.consume_token(t), (name, t, m.get_error())
            steps.append((time.perf_counter() - t0) / len(ids))
        out[name] = {"compile_ms": _median_ms(compiles), "per_token_ms": _median_ms(steps), "tokens": len(ids)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = load_tokenizer(resolve(None))
    vocab = len(tok)
    print(f"tokenizer: default model, vocab {vocab}; load {os.getloadavg()[0]:.2f}")
    results = {"xgrammar": bench_xgrammar(tok, vocab, args.repeats),
               "llguidance": bench_llguidance(tok, vocab, args.repeats)}
    print("| engine | tokenizer setup (ms) | schema | doc tokens | compile (ms) | mask+accept per token (ms) |")
    print("|---|---|---|---|---|---|")
    for eng, r in results.items():
        for name in SCHEMAS:
            print(f"| {eng} | {r['setup_ms']:.0f} | {name} | {r[name]['tokens']} | "
                  f"{r[name]['compile_ms']:.1f} | {r[name]['per_token_ms']:.3f} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
