"""The Markdown page of benchmarks/gpu_check.py's JSON: one table per section, every number under a
line naming the GPU, torch, CUDA and transformers versions, the commit and the date."""

from __future__ import annotations

from typing import Any

SECTIONS = ("cuda_tests", "parity", "decode", "cost_curve", "spec_bench")


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, int | float):
        return fmt.format(x)
    return "—" if x is None else str(x)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(report: dict[str, Any]) -> str:
    e = report["env"]
    where = e["gpu"] or f"CPU ({e['cpu'] or 'unknown'}, {e['cpu_count']} cores, load {e['load']:.1f})"
    lines = [f"# gpu_check{' (dry run: tiny random models, plumbing only)' if report['dry_run'] else ''}", "",
             f"{where}; torch {e['torch']}, CUDA {e['cuda']}, transformers {e['transformers']}, Python {e['python']}; "
             f"commit {e['commit']}; {e['date']}; run budget {report['budget_s']:.0f} s"
             + (f", took {report['total_s']:.0f} s" if "total_s" in report else ""), ""]
    lines += [f"- {n}" for n in report.get("notes", [])]
    if "kernels" in report:
        k = report["kernels"]
        lines.append(f"- CPU kernels ({k['isa']}) loaded or compiled in {k['seconds']:.0f} s"
                     + (f"; models written and loaded in {report['setup_s']:.0f} s" if "setup_s" in report else ""))
    for name, m in report.get("models", {}).items():
        lines.append(f"- model `{name}`: {'real weights' if m['real'] else 'random weights'}"
                     + (f" ({m['gguf']})" if m.get("gguf") else ""))
    for name in SECTIONS:
        s = report["sections"].get(name)
        if s is None:
            continue
        lines += ["", f"## {name}: {s['status']} ({s.get('seconds', 0):.0f} s)", ""]
        lines += [f"- {x}" for x in ([s["note"]] if "note" in s else []) + s.get("over_budget", [])]
        lines += [f"- error in {k}: {v}" for k, v in s.get("errors", {}).items()]
        if "error" in s:
            lines.append(f"- error: {s['error']}")
        lines += _SECTION[name](s) if s["status"] != "skipped" and "error" not in s else []
    return "\n".join(lines) + "\n"


def _tests(s: dict[str, Any]) -> list[str]:
    out = _table(["command", "passed", "failed", "skipped", "errors"],
                 [[f"`{s['command']}`", str(s["passed"]), str(s["failed"]), str(s["skipped"]), str(s["test_errors"])]])
    notes = [s["summary"]] + s.get("failures", []) + ([s["status_note"]] if "status_note" in s else [])
    return out + ["", *(f"- {n}" for n in notes if n)]


def _parity(s: dict[str, Any]) -> list[str]:
    return _table(["model", "dtype", "new tokens", "batched == alone", "greedy == HF (per prompt)",
                   "tokens compared (to our first EOS)", "first divergence"],
                  [[s["model"], s["dtype"], str(s["new_tokens"]), _f(s.get("batched_equals_alone")),
                    " ".join(_f(x) for x in s.get("greedy_equals_hf", [])) or "—",
                    " ".join(_f(x, "{}") for x in s.get("compared_tokens", [])) or "—",
                    " ".join(_f(x, "{}") for x in s.get("first_divergence", [])) or "—"]])


def _decode(s: dict[str, Any]) -> list[str]:
    head = ["model", "batch", "ours tok/s", "HF eager tok/s", "ours / HF eager", "HF static+compile tok/s",
            "ours / compiled"]
    rows = []
    for r in s["rows"]:
        for b in s["batches"]:
            compiled = r.get(f"hf static+compile compiled b{b}")
            static = _f(r.get(f"hf static+compile b{b}")) + {True: "", False: " (not compiled)", None: ""}[compiled]
            rows.append([r["model"], str(b), _f(r.get(f"ours b{b}")), _f(r.get(f"hf eager b{b}")),
                         _f(r.get(f"vs hf eager b{b}"), "{:.2f}x"), static,
                         _f(r.get(f"vs hf static+compile b{b}"), "{:.2f}x")])
    note = (f"{s['dtype']}, greedy, {s['prompt_tokens']}-token prompts, {s['new_tokens']} new tokens; decode tok/s "
            "after each sequence's first token (HF: time of n tokens less that of 1)")
    return [note, ""] + _table(head, rows)


def _cost(s: dict[str, Any]) -> list[str]:
    head = ["model"] + [f"k={k}" for k in s["rows"]]
    rows = [[c["model"]] + [f"{t:.2f} ms ({r:.2f}x)" for t, r in zip(c["ms"], c["ratio"], strict=True)]
            for c in s["curves"]]
    return [f"{s['dtype']}: a forward over k new rows plus their logits, no context; median of 5", ""] + _table(
        head, rows)


def _spec(s: dict[str, Any]) -> list[str]:
    head = ["config", "tok/s", "vs AR", "Spec-Bench speed-up", "decode tok/s", "decode vs AR", "MAL", "greedy == AR"]
    rows = [[k, _f(c["tok_s"]), _f(c["vs_ar"], "{:.2f}x"), _f(c["specbench_speedup"], "{:.2f}x"), _f(c["decode_tok_s"]),
             _f(c["decode_vs_ar"], "{:.2f}x"), _f(c["mal"], "{:.2f}"), c["identical_to_ar"]]
            for k, c in s["configs"].items()]
    note = (f"{s['model']}, {s['dtype']}, batch {s['batch']}, {s['num_prompts']} prompts ({s['prompts']}), "
            f"up to {s['new_tokens']} new tokens, EOS respected")
    out = [note, ""] + _table(head, rows)
    groups = s.get("groups", {})
    names = [k for k in s["configs"] if k in groups and k != "plain AR"]
    if names:  # per group, as Spec-Bench's leaderboard: MAL and speed-up of each speculative config
        order = list(dict.fromkeys(g for k in names for g in groups[k]))
        out += ["", "Per group (MAL / Spec-Bench speed-up vs plain AR):", ""]
        out += _table(["group"] + names, [[g] + [f"{_f(groups[k][g]['mal'], '{:.2f}')} / "
                                               f"{_f(groups[k][g]['specbench_speedup'], '{:.2f}x')}"
                                               if g in groups[k] else "" for k in names] for g in order])
    return out


_SECTION = {"cuda_tests": _tests, "parity": _parity, "decode": _decode, "cost_curve": _cost, "spec_bench": _spec}
