"""Grammar-forced tokens (jump-forward) on a JSON-schema extraction task: tokens per forward and
time per request, with and without, plain and with n-gram speculation.

Each request asks the default model to extract a record from a short text into a fixed schema,
greedy, one request at a time. The output is checked identical across configurations (the
forced tokens are verified like drafts, so the text cannot change) and valid against the schema.

    python benchmarks/bench_jump_forward.py [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "birth_year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "country": {"type": "string", "maxLength": 30},
        "occupation": {"enum": ["scientist", "writer", "artist", "politician", "engineer", "other"]},
        "known_for": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 2},
    },
    "required": ["name", "birth_year", "country", "occupation", "known_for"],
    "additionalProperties": False,
}
TEXTS = [
    "Marie Curie (born 1867 in Poland) was a physicist and chemist known for radioactivity and polonium.",
    "Ada Lovelace, born in 1815 in England, was a mathematician known for the first computer program.",
    "Leonardo da Vinci was an Italian painter born in 1452, known for the Mona Lisa and The Last Supper.",
    "Nelson Mandela (born 1918, South Africa) was a politician known for ending apartheid.",
    "Isambard Kingdom Brunel, an English engineer born in 1806, built the Great Western Railway.",
    "Jane Austen was an English writer born in 1775, known for Pride and Prejudice and Emma.",
]
CONFIGS = {
    "plain, no jump-forward": ("autoregressive", {}, False),
    "plain + jump-forward": ("autoregressive", {}, True),
    "ngram speculative, no jump-forward": ("speculative", {"method": "ngram", "depth": 4}, False),
    "ngram speculative + jump-forward": ("speculative", {"method": "ngram", "depth": 4}, True),
}


def engine(llm: LLM, decoding: str, options: dict, jump_forward: bool) -> LLMEngine:
    cfg = EngineConfig(dtype="float32", decoding=decoding, decoding_options=options, jump_forward=jump_forward,
                       kv_cache_blocks=256, progress=False)
    return LLMEngine(cfg, llm.engine.model, llm.model_config, tokenizer=llm.tokenizer)


def run_one(eng: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], int, float]:
    f0 = eng.runner.num_forwards
    t0 = time.perf_counter()
    sid = eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    seq = eng.release(sid)
    assert seq is not None
    return seq.output_ids, eng.runner.num_forwards - f0, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(progress=False, dtype="float32")
    prompts = [llm.tokenize(llm.apply_chat_template([{"role": "user", "content": (
        "Extract name, birth_year, country, occupation and known_for (at most two items) as JSON.\n" + t)}]))
        for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=120, structured=StructuredOutputsParams(json=SCHEMA))
    engines = {name: engine(llm, *cfg) for name, cfg in CONFIGS.items()}
    for eng in engines.values():  # warm-up: grammar compile, token trie, kernels
        run_one(eng, prompts[0], params)
    print(f"load before: {os.getloadavg()[0]:.2f}; torch threads {args.threads}; {len(prompts)} requests, "
          f"{args.repeats} rounds, configurations interleaved")
    times: dict[str, list[float]] = {n: [] for n in CONFIGS}
    tokens: dict[str, int] = dict.fromkeys(CONFIGS, 0)
    forwards: dict[str, int] = dict.fromkeys(CONFIGS, 0)
    outputs: dict[str, list[list[int]]] = {n: [] for n in CONFIGS}
    for r in range(args.repeats):
        for p in prompts:
            for name, eng in engines.items():
                out, fwd, dt = run_one(eng, p, params)
                times[name].append(dt)
                if r == 0:
                    tokens[name] += len(out)
                    forwards[name] += fwd
                    outputs[name].append(out)
    ref = outputs["plain, no jump-forward"]
    for o in ref:
        json.loads(llm.tokenizer.decode(o, skip_special_tokens=True))
    base = statistics.median(times["plain, no jump-forward"])
    print("| configuration | output tokens | forwards | tokens / forward | median time / request (ms) | speed-up |"
          " same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        med = statistics.median(times[name])
        print(f"| {name} | {tokens[name]} | {forwards[name]} | {tokens[name] / forwards[name]:.2f} | {1000 * med:.0f} |"
              f" {base / med:.2f}x | {outputs[name] == ref} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
