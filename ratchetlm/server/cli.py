"""``ratchet serve``: the OpenAI-compatible HTTP server on uvicorn (one worker, one engine thread)."""

from __future__ import annotations

import argparse
import os
import sys

from ratchetlm.cli import add_engine_args, engine_kwargs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ratchet serve", description="Run the OpenAI-compatible server.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: the model file/folder name)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 helps on a busy shared CPU)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(progress=False)  # no tqdm bars in server logs unless --progress true
    return p


def default_model_name(model: str | None) -> str:
    if model is None:
        from ratchetlm.models.loader import default_model_path

        model = str(default_model_path())
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not 0 <= args.port <= 65535:
        print(f"ratchet serve: error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    import uvicorn

    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(max(1, args.torch_threads))

    from ratchetlm.server.app import build_app

    kw = engine_kwargs(args)
    model = kw.pop("model")

    def load():
        from ratchetlm import LLM

        return LLM(model, **kw)

    if "decoding_options" in kw and not isinstance(kw["decoding_options"], dict):
        print("ratchet serve: error: --decoding-options must be a JSON object", file=sys.stderr)
        return 2
    app = build_app(load, args.served_model_name or default_model_name(model))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, workers=1,
                timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
