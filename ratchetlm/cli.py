"""The ``ratchet`` command. Engine flags map 1:1 onto :class:`EngineConfig` fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ratchetlm.engine.config import NUMERICS, EngineConfig

_ENGINE_HELP = {
    "model": "local .gguf file or HF model folder (default: bundled SmolLM2-135M-Instruct)",
    "device": "cpu or cuda[:N]",
    "dtype": "auto (GGUF on CPU with block kernels: fp32; else bf16 where native) | float32 | bfloat16 | float16",
    "max_model_len": "max prompt + generated tokens per request",
    "kv_cache_blocks": "number of KV blocks (llama-family paged cache; default ~1 GiB)",
    "kv_cache_bytes": "cache budget in bytes, any model's cache layout (default ~1 GiB)",
    "block_size": "tokens per KV block",
    "max_num_seqs": "max sequences decoded together",
    "max_num_batched_tokens": "max tokens in one forward",
    "max_waiting": "max queued requests before new ones are refused",
    "staging_capacity": "max tentative K/V rows staged per forward (speculative, wedlm); more fall back to recompute",
    "enable_prefix_caching": "reuse cached KV blocks of shared prompt prefixes (true/false)",
    "decoding": "decoding strategy: autoregressive | speculative | wedlm",
    "decoding_options": "JSON object of strategy options",
    "gguf_kernels": "CPU fp32: GGUF (and 16-bit HF) weights stay in stored form, matmuls read them (true/false)",
    "numerics": "CPU block kernels: exact (fp32 activations, HF-identical) | int8 | int16 (integer activations, "
                "VNNI dot products)",
    "seed": "global RNG seed for unseeded sampling",
    "jump_forward": "structured outputs: commit grammar-forced tokens in the same forward as the next one (true/false)",
    "progress": "show progress bars (true/false)",
    "tensor_parallel_size": "split the model over N ranks (processes; one GPU each on CUDA) started by this one",
}


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name == "decoding_options":
            p.add_argument(flag, type=json.loads, default=None, help=_ENGINE_HELP[f.name])
        elif f.type in ("bool",):
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=default,
                           help=_ENGINE_HELP[f.name])
        elif f.type in ("int", "int | None"):
            p.add_argument(flag, type=int, default=default, help=_ENGINE_HELP[f.name])
        elif f.name == "numerics":
            p.add_argument(flag, type=str, default=default, choices=NUMERICS, help=_ENGINE_HELP[f.name])
        else:
            p.add_argument(flag, type=str, default=default, help=_ENGINE_HELP[f.name])
    p.add_argument("--speculative", type=json.loads, default=None,
                   help='speculative decoding options as JSON, e.g. \'{"method": "ngram", "depth": 4}\'')
    p.add_argument("--wedlm", type=json.loads, default=None,
                   help='WeDLM options as JSON, e.g. \'{"window_size": 16, "tau": 0.4}\'')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    if kw["decoding_options"] is None:
        kw.pop("decoding_options")
    # ``--speculative {...}`` / ``--wedlm {...}`` select their strategy (the ``--decoding`` default,
    # "autoregressive", must not silently win over them)
    for name in ("speculative", "wedlm"):
        if getattr(args, name) is not None:
            if kw.get("decoding") not in (None, "autoregressive", name):
                raise SystemExit(f"--{name} conflicts with --decoding {kw['decoding']}")
            kw["decoding"] = name
            kw[name] = getattr(args, name)
    return kw


def cmd_generate(args: argparse.Namespace) -> int:
    from ratchetlm import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    kw = engine_kwargs(args)
    kw.pop("seed", None)
    if args.seed is not None:
        kw["seed"] = args.seed
    llm = LLM(kw.pop("model"), **kw)
    try:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        if not args.chat:
            sys.stdout.write(prompt)
        for ev in llm.stream(prompt, params):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finished:
                sys.stdout.write("\n")
                print(f"[finish_reason={ev.finish_reason}]", file=sys.stderr)
    finally:
        llm.close()  # tensor-parallel workers, if any
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ratchet",
        description="ratchetlm: LLM inference that proposes many tokens per step and commits only accepted ones.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt and stream it to the terminal")
    g.add_argument("prompt", help="prompt text (with --chat: the user message)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible sampling)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(g, skip=("seed",))
    g.set_defaults(func=cmd_generate)
    for name, module, help_ in (
        ("serve", "ratchetlm.server.cli", "run the OpenAI-compatible HTTP server"),
        ("bench", "ratchetlm.bench", "decode throughput vs HF transformers (and llama-cpp-python)"),
        ("train-wedlm", "ratchetlm.training.wedlm_train", "train a small WeDLM model on a generated corpus"),
        ("train-eagle", "ratchetlm.training.eagle_train", "train an EAGLE draft head on the target's own answers"),
    ):
        s = sub.add_parser(name, help=help_, add_help=False)
        s.set_defaults(module=module)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv and argv[0] in ("serve", "bench", "train-wedlm", "train-eagle"):
        import importlib

        ns, _ = parser.parse_known_args(argv[:1])
        return int(importlib.import_module(ns.module).main(argv[1:]) or 0)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # bad input: one clear line, no stack trace
        print(f"ratchet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
