"""The ``ratchet`` command. Engine flags map 1:1 onto :class:`EngineConfig` fields."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from ratchetlm.engine.config import KV_CACHE_DTYPES, NUMERICS, EngineConfig

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C'd program


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default (unless its help already says it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default" in action.help:
            return action.help
        return super()._get_help_string(action)

_ENGINE_HELP = {
    "model": "local .gguf file or HF model folder (default: bundled SmolLM2-135M-Instruct)",
    "device": "cpu or cuda[:N]",
    "dtype": "auto (CPU: float32, HF-identical; CUDA: an HF checkpoint's own dtype, bfloat16 for GGUF) | float32 "
             "(float) | bfloat16 | float16 (half)",
    "max_model_len": "max prompt + generated tokens per request",
    "kv_cache_blocks": "number of KV blocks (llama-family paged cache; default ~1 GiB)",
    "kv_cache_bytes": "cache budget in bytes, any model's cache layout (default ~1 GiB)",
    "block_size": "tokens per KV block",
    "max_num_seqs": "max sequences decoded together",
    "max_num_batched_tokens": "max tokens in one forward (an upper bound beside --max-step-ms)",
    "max_step_ms": "step-time budget while streams decode: long prompts are fed in chunks the measured cost "
                   "model keeps under this many ms, kept within 3.5-3.75x a decode step (default: 60 on CPU, 50 on "
                   "CUDA; inf = token budget only)",
    "max_waiting": "max queued requests before new ones are refused",
    "staging_capacity": "max tentative K/V rows staged per forward (speculative, wedlm); more fall back to recompute",
    "enable_prefix_caching": "reuse cached KV blocks of shared prompt prefixes (true/false)",
    "kv_prefault": "CPU: back the KV cache's pages ahead of the blocks in use in a background thread, so no step "
                   "waits for first-write page faults (true/false)",
    "decoding": "decoding strategy: autoregressive | speculative | wedlm",
    "decoding_options": "JSON object of strategy options",
    "gguf_kernels": "CPU fp32: GGUF (and 16-bit HF) weights stay in stored form, matmuls read them (true/false)",
    "numerics": "CPU block kernels: auto (a quantized GGUF on an AVX2 / AVX-512 CPU: int8 for weight formats "
                "measured llama.cpp-grade in it, else int16; exact otherwise) | exact (fp32 activations, "
                "HF-identical) | int8 (llama.cpp-grade) | int16 (closer to exact than llama.cpp)",
    "kv_cache_dtype": "KV cache element type: auto (float16 in the int8/int16 numerics, else the run dtype) | "
                      "float32 | float16 (half the KV memory and attention reads; K/V rounded to half as written)",
    "seed": "global RNG seed for unseeded sampling",
    "jump_forward": "structured outputs: commit grammar-forced tokens in the same forward as the next one (true/false)",
    "progress": "show progress bars (true/false)",
    "tensor_parallel_size": "split the model over N ranks (processes; one GPU each on CUDA) started by this one",
    "gpu_memory_utilization": "CUDA: fraction of the GPU's memory for weights + activations + KV cache (vLLM's "
                              "meaning; sizes the KV cache from free memory); ignored with a warning on CPU",
    "enforce_eager": "vLLM's flag; accepted: the engine always runs eagerly (no CUDA graphs)",
    "runner": "vLLM's runner: auto | generate (text) | pooling (embeddings of the final hidden states: LLM.embed, "
              "/v1/embeddings; no generation)",
    "pooling_type": "pooling runner: last (the last token's hidden state) | mean (over the prompt's tokens)",
    "pooling_normalize": "pooling runner: L2-normalise the pooled vectors (true/false)",
    "generation_config": "default sampling parameters of requests that omit them (vLLM's): auto (the model's: "
                         "generation_config.json, a GGUF's general.sampling.*) | vllm (none: temperature 1, ...) | "
                         "a folder holding a generation_config.json",
    "override_generation_config": "JSON object of default sampling parameters applied over --generation-config's, "
                                  "e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 256}'",
}

# vLLM CLI habits without a field of their own (engine/engine_args.py decides what they mean here)
_VLLM_FLAGS: dict[str, dict[str, Any]] = {
    "tokenizer": dict(type=str, default=None, help="tokenizer path (GGUF file or folder with tokenizer.json); "
                                                   "default: the model's own"),
    "trust_remote_code": dict(action="store_true", help="accepted for vLLM compatibility; no remote code runs here"),
    "disable_log_stats": dict(action="store_true", help="accepted for vLLM compatibility (ignored)"),
}


def _bool(text: str) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.name in ("decoding_options", "override_generation_config"):
            p.add_argument(flag, type=json.loads, default=None, help=_ENGINE_HELP[f.name])
        elif f.type in ("bool",):  # ``--flag`` alone means true (vLLM's store_true habit)
            p.add_argument(flag, type=_bool, nargs="?", const=True, default=default, metavar="BOOL",
                           help=_ENGINE_HELP[f.name])
            # vLLM's BooleanOptionalAction spelling: --no-enable-prefix-caching
            p.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=argparse.SUPPRESS)
        elif f.type == "float | None":
            p.add_argument(flag, type=float, default=default, help=_ENGINE_HELP[f.name])
        elif f.type in ("int", "int | None"):
            short = ["-tp"] if f.name == "tensor_parallel_size" else []  # vLLM's short flag
            p.add_argument(flag, *short, type=int, default=default, help=_ENGINE_HELP[f.name])
        elif f.name == "numerics":
            p.add_argument(flag, type=str, default=default, choices=("auto", *NUMERICS), help=_ENGINE_HELP[f.name])
        elif f.name == "kv_cache_dtype":
            p.add_argument(flag, type=str, default=default, choices=tuple(KV_CACHE_DTYPES), help=_ENGINE_HELP[f.name])
        else:
            p.add_argument(flag, type=str, default=default, help=_ENGINE_HELP[f.name])
    p.add_argument("--speculative", type=json.loads, default=None,
                   help='speculative decoding options as JSON, e.g. \'{"method": "ngram", "depth": 4}\'')
    p.add_argument("--wedlm", type=json.loads, default=None,
                   help='WeDLM options as JSON, e.g. \'{"window_size": 16, "tau": 0.4}\'')
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    g = p.add_argument_group("vLLM compatibility")
    for name, spec in _VLLM_FLAGS.items():
        if name not in fields:
            g.add_argument("--" + name.replace("_", "-"), **spec)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    if kw["decoding_options"] is None:
        kw.pop("decoding_options")
    for name, spec in _VLLM_FLAGS.items():  # passed on only when given (the ignored ones warn)
        if name not in kw and getattr(args, name, None) not in (None, spec.get("default"), False):
            kw[name] = getattr(args, name)
    # ``--speculative {...}`` / ``--wedlm {...}`` select their strategy (the ``--decoding`` default,
    # "autoregressive", must not silently win over them)
    for name in ("speculative", "wedlm"):
        if getattr(args, name) is not None:
            if kw.get("decoding") not in (None, "autoregressive", name):
                raise SystemExit(f"--{name} conflicts with --decoding {kw['decoding']}")
            kw["decoding"] = name
            kw[name] = getattr(args, name)
    return kw


def setup_logging(level: str = "info") -> None:
    """The engine's start-up lines (dtype and kernel path, KV sizing) on stderr, once per process."""
    log = logging.getLogger("ratchetlm")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s ratchet: %(message)s"))
        log.addHandler(h)
    log.setLevel(level.upper())
    log.propagate = False


def read_prompt(arg: str) -> str:
    """The prompt argument, or standard input for ``-`` (one trailing newline, as echo adds, dropped)."""
    if arg != "-":
        return arg
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise ValueError("the prompt read from standard input is empty")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from ratchetlm import LLM, SamplingParams

    setup_logging(args.log_level)
    prompt_text = read_prompt(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()), ignore_eos=args.ignore_eos)
    kw = engine_kwargs(args)
    kw.pop("seed", None)
    if args.seed is not None:
        kw["seed"] = args.seed
    llm = LLM(kw.pop("model"), **kw)
    try:
        prompt = llm.apply_chat_template([{"role": "user", "content": prompt_text}]) if args.chat else prompt_text
        # a chat prompt is fed as the template wrote it (its own BOS), a text prompt with the model's
        fed: str | list[int] = llm.tokenize(prompt, add_special_tokens=False) if args.chat else prompt
        if args.json:
            out = llm.generate(fed, params, use_tqdm=False)[0]
            c = out.outputs[0]
            print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": list(c.token_ids),
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                              "usage": {"prompt_tokens": len(out.prompt_token_ids),
                                        "completion_tokens": len(c.token_ids)}}, ensure_ascii=False))
            return 0
        if not args.chat:
            sys.stdout.write(prompt)
        try:
            wrote = False
            for ev in llm.stream(fed, params):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
                wrote = wrote or bool(ev.text)
                if ev.finished:
                    print(f"[finish_reason={ev.finish_reason}]", file=sys.stderr)
                    if not wrote and not args.chat and getattr(llm.tokenizer, "chat_template", None):
                        # an instruct model given a bare prompt often ends at once: the first thing users try
                        print("[the model ended at once; it has a chat template: try --chat]", file=sys.stderr)
        finally:
            sys.stdout.write("\n")
            sys.stdout.flush()
    finally:
        llm.close()  # tensor-parallel workers, if any
    return 0


def _version() -> str:
    from ratchetlm import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ratchet", formatter_class=HelpFormatter,
        description="ratchetlm: LLM inference that proposes many tokens per step and commits only accepted ones.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one prompt and stream it to the terminal",
                       formatter_class=HelpFormatter,
                       description="Generate text for one prompt; the text goes to stdout, logs to stderr.")
    g.add_argument("prompt", help="prompt text ('-': read it from standard input; with --chat: the user message)")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely (-1: all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible sampling)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, finish_reason, stop_reason, usage) at the end "
                        "instead of streaming text")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="stderr log level")
    # its sampling flags have their own defaults (greedy, 128 tokens): the model's (generation_config) never apply
    add_engine_args(g, skip=("seed", "generation_config", "override_generation_config"))
    g.set_defaults(func=cmd_generate)
    for name, module, help_ in (
        ("serve", "ratchetlm.server.cli", "run the OpenAI-compatible HTTP server (ratchet serve [MODEL])"),
        ("bench", "ratchetlm.bench", "decode throughput vs HF transformers (and llama-cpp-python)"),
        ("train-wedlm", "ratchetlm.training.wedlm_train", "train a small WeDLM model on a generated corpus"),
        ("train-eagle", "ratchetlm.training.eagle_train", "train an EAGLE draft head on the target's own answers"),
    ):
        s = sub.add_parser(name, help=help_, add_help=False)
        s.set_defaults(module=module)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad input (one line, no traceback), 130 interrupted (Ctrl-C, quietly)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
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
