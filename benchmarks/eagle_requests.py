"""Build a JSONL of chat requests for ``ratchet train-eagle --requests`` from public instruction sets.

The head is self-distilled: only the *requests* come from these files; the answers it learns from are
the target model's own greedy answers (``eagle_train.build_data``). Sources (local git mirrors, passed as
paths; nothing is downloaded here):

* ``--t0``: yizhongw/self-instruct ``data/finetuning/t0_train_50k/data_per_template`` (P3 / T0 training
  prompts, Apache-2.0 repository): reading-comprehension QA, summarization, closed-book QA, commonsense.
* ``--gsm8k``: openai/grade-school-math ``grade_school_math/data/train.jsonl`` (MIT): the *train* split.
* ``--self-instruct``: the same repository's ``data/seed_tasks.jsonl`` and
  ``human_eval/user_oriented_instructions.jsonl`` (instructions with their inputs).

Spec-Bench's sources are kept out so that the benchmark stays held out: no CNN/DailyMail templates (its
summarization group), no KILT templates (KILT holds Natural Questions, its QA and RAG groups), no WMT
(translation), and GSM8K's train split only (Spec-Bench's math group is GSM8K test).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

EXCLUDED_TEMPLATES = ("cnn_dailymail", "kilt_tasks", "wmt", "natural_questions", "nq_")


def t0_requests(folder: Path, n: int, per_template: int, max_chars: int, rng: random.Random) -> list[str]:
    files = sorted(p for p in folder.glob("*.jsonl") if not any(x in p.name for x in EXCLUDED_TEMPLATES))
    pool: list[str] = []
    for p in files:
        lines = p.read_text().splitlines()
        rng.shuffle(lines)
        kept = [json.loads(x)["prompt"].strip() for x in lines[: 4 * per_template]]
        pool += [x for x in kept if 20 <= len(x) <= max_chars][:per_template]
    rng.shuffle(pool)
    return pool[:n]


def gsm8k_requests(path: Path, n: int, rng: random.Random) -> list[str]:
    qs = [json.loads(x)["question"] for x in path.read_text().splitlines() if x.strip()]
    rng.shuffle(qs)
    return qs[:n]


def self_instruct_requests(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        for line in p.read_text().splitlines():
            task = json.loads(line)
            for inst in task.get("instances", [])[:1]:
                text = task["instruction"].strip()
                if inst.get("input"):
                    text += "\n\n" + inst["input"].strip()
                out.append(text)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--t0", type=Path, required=True, help="folder of T0 template JSONL files")
    ap.add_argument("--gsm8k", type=Path, required=True, help="GSM8K train.jsonl")
    ap.add_argument("--self-instruct", type=Path, nargs="*", default=[], help="seed/user-oriented task files")
    ap.add_argument("--t0-requests", type=int, default=3000)
    ap.add_argument("--per-template", type=int, default=20)
    ap.add_argument("--max-chars", type=int, default=2500, help="longest T0 prompt kept")
    ap.add_argument("--gsm8k-requests", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    reqs = (t0_requests(a.t0, a.t0_requests, a.per_template, a.max_chars, rng)
            + gsm8k_requests(a.gsm8k, a.gsm8k_requests, rng) + self_instruct_requests(a.self_instruct))
    reqs = [re.sub(r"\n{3,}", "\n\n", r) for r in reqs]
    with open(a.out, "w") as f:
        for r in reqs:
            f.write(json.dumps({"prompt": r}) + "\n")
    print(f"{len(reqs)} requests -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
