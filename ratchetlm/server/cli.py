"""``ratchet serve``: the OpenAI-compatible HTTP server on uvicorn (one worker, one engine thread)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any

from ratchetlm.cli import EXIT_INTERRUPTED, HelpFormatter, add_engine_args, engine_kwargs, setup_logging
from ratchetlm.server.config import ServerConfig

_log = logging.getLogger("ratchetlm.serve")

_SERVER_HELP = {
    "api_key": "require 'Authorization: Bearer KEY' on /v1/* (default: $RATCHET_API_KEY, else no auth)",
    "shutdown_timeout": "on SIGTERM, seconds running requests may finish before they are ended with an error",
    "idle_timeout": "seconds a connection may wait without a complete request head, body chunk or next request",
    "body_timeout": "seconds a whole request body may take to arrive, however steadily it trickles (408 beyond)",
    "prep_workers": "threads that parse, template, tokenize and compile grammars for requests (default: the "
                    "machine's cores, at least 2); bodies over 1 MiB share all but one of them",
    "prep_timeout": "seconds one request's preparation (parsing, chat template, tokenization, grammar) may take "
                    "(400 beyond)",
    "max_body_bytes": "largest request body (413 beyond)",
    "max_choices": "most choices (prompts x n) in one request",
    "max_stop_strings": "most stop strings in one request",
    "max_stop_string_length": "longest stop string, in characters",
    "allowed_origins": "CORS: origins browsers may call from, as a JSON list or comma-separated ('*' = any); "
                       "default: none (no CORS headers)",
    "data_parallel_size": "engine replicas (processes, each with the model and its own KV cache) behind this "
                          "server, which keeps only the tokenizer; requests go to the least loaded",
    "responses_store_size": "/v1/responses kept in memory for previous_response_id and GET /v1/responses/{id} "
                            "(least recently used dropped first; 0 = none kept)",
    "tool_call_parser": "tool-call format of the model family: auto (from the chat template) | smollm2 | "
                        "hermes (qwen) | llama3_json (llama3)",
    "reasoning_parser": "split <think>...</think> from the answer into message.reasoning (and reasoning_content), "
                        "as vLLM's parser of the name does: deepseek_r1 | qwen3 (default: none, the thinking "
                        "stays in the content)",
    "response_role": "role of the generated chat message (vLLM's flag)",
    "chat_template_content_format": "message content reaches the chat template as a string | openai (a list of "
                                    "text parts) | auto (parts when the template loops over a message's content)",
}

# vLLM serve flags that change nothing here: accepted, and the log says so
_NO_OP_FLAGS = {
    "enable_auto_tool_choice": "tool calls are always parsed when a request has tools (tool_choice auto)",
    "disable_log_requests": "request contents are never logged here",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ratchet serve", description="Run the OpenAI-compatible server.",
                                formatter_class=HelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model path (vLLM's `vllm serve MODEL` habit; the same as --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback only by default)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model id(s) clients may send; responses name the first (default: the model file/folder name)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template text) replacing the model's own")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 helps on a busy shared CPU)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server and engine log level (stderr)")
    for f in dataclasses.fields(ServerConfig):
        kind = {"float": float, "int": int, "int | None": int}.get(str(f.type), str)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=_SERVER_HELP[f.name])
    add_engine_args(p)
    add_vllm_serve_flags(p)
    p.set_defaults(progress=False)  # no tqdm bars in server logs unless --progress true
    return p


def add_vllm_serve_flags(p: argparse.ArgumentParser) -> None:
    """``vllm serve`` flags without a field of their own (docs/vllm_compat.md#command-line)."""
    g = p.add_argument_group("vLLM serve compatibility")
    for name, why in _NO_OP_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), action="store_true", help=f"accepted; no-op: {why}")
    g.add_argument("--uvicorn-log-level", default=None,
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level)")


def check_vllm_serve_flags(args: argparse.Namespace) -> str | None:
    """Why the vLLM serve flags cannot be honoured (would change results), or None; logs the no-ops."""
    import logging

    log = logging.getLogger("ratchetlm")
    for name, why in _NO_OP_FLAGS.items():
        if getattr(args, name):
            log.info("--%s: accepted; %s", name.replace("_", "-"), why)
    return None


def read_chat_template(arg: str) -> str:
    """A template file's text, or ``arg`` itself when it is template text (contains ``{{`` / ``{%``)."""
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            text = f.read()
    elif "{{" in arg or "{%" in arg:
        text = arg
    else:
        raise ValueError(f"no such file: {arg!r}")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the template does not parse: {e}") from None
    return text


@dataclasses.dataclass(frozen=True)
class ModelLoader:
    """Loads the served model; picklable, so data-parallel replica processes load the same."""

    model: str | None
    kwargs: dict
    chat_template: str | None = None
    torch_threads: int | None = None  # --torch-threads, applied in every process that loads (replicas too)

    def __call__(self):
        from ratchetlm import LLM

        if self.torch_threads is not None:
            import torch

            torch.set_num_threads(max(1, self.torch_threads))
        llm = LLM(self.model, **self.kwargs)
        if self.chat_template is not None:
            llm.tokenizer.chat_template = self.chat_template
        return llm

    def front(self, facts: Any) -> Any:
        """What a data-parallel front process serves from: the tokenizer and chat template with the
        replicas' :class:`~ratchetlm.server.front.EngineFacts`, no weights (server/front.py); the
        whole model for the pooling runner only, whose embeddings are computed in the front."""
        if facts.config.runner == "pooling":
            return self()
        from ratchetlm.server.front import FrontLLM  # (as in __call__: `ratchet serve --help` imports no torch)

        return FrontLLM(self.model, self.kwargs, facts, self.chat_template)


def check_engine_flags(model: str | None, kw: dict) -> str | None:
    """Why the engine flags cannot make an engine (before the server starts), or None. The model
    loads later, in the background; the ignored-flags warning is left to that load."""
    import warnings

    from ratchetlm.engine.config import EngineConfig
    from ratchetlm.engine.engine_args import split_engine_args

    rest = {k: v for k, v in kw.items() if k not in ("speculative", "wedlm")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fields, _ = split_engine_args(rest)
        EngineConfig(model=model, **fields)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def default_model_name(model: str | None) -> str:
    if model is None:
        from ratchetlm.models.loader import default_model_path

        model = str(default_model_path())
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 after a clean shutdown, 1 when the model failed to load, 2 bad flags, 130 on
    Ctrl-C (after the same graceful drain as SIGTERM, without a traceback)."""
    served: list[Any] = []  # the server's state, once built
    try:
        code = _main(sys.argv[1:] if argv is None else argv, served)
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it drained on: the shell's 130, quietly
        code = EXIT_INTERRUPTED
    busy = [name for st in served for name in st.busy_threads()]
    if busy:
        # the model still loading, or the engine thread still inside a forward after shutdown's wait:
        # the interpreter's teardown would abort in torch's ("terminate called without an active
        # exception", 134), so leave without it
        _log.error("exiting with a thread still running: %s", ", ".join(busy))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(argv: list[str], served: list[Any]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if not 0 <= args.port <= 65535:
        print(f"ratchet serve: error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    import uvicorn

    setup_logging(args.log_level)
    problem = check_vllm_serve_flags(args)
    if problem:
        print(f"ratchet serve: error: {problem}", file=sys.stderr)
        return 2
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(max(1, args.torch_threads))

    from ratchetlm.server.app import build_app

    kw = engine_kwargs(args)
    model = kw.pop("model")

    template = None
    if args.chat_template is not None:
        try:
            template = read_chat_template(args.chat_template)
        except (OSError, ValueError) as e:
            print(f"ratchet serve: error: --chat-template: {e}", file=sys.stderr)
            return 2

    load = ModelLoader(model, kw, template, args.torch_threads)

    if "decoding_options" in kw and not isinstance(kw["decoding_options"], dict):
        print("ratchet serve: error: --decoding-options must be a JSON object", file=sys.stderr)
        return 2
    problem = check_engine_flags(model, kw)
    if problem:
        print(f"ratchet serve: error: {problem}", file=sys.stderr)
        return 2
    if args.api_key is None:
        args.api_key = os.environ.get("RATCHET_API_KEY") or None
    try:
        cfg = ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
    except ValueError as e:
        print(f"ratchet serve: error: {e}", file=sys.stderr)
        return 2
    if cfg.data_parallel_size > 1 and (kw.get("tensor_parallel_size") or 1) > 1 \
            and str(kw.get("device") or "cpu").startswith("cuda"):
        print("ratchet serve: error: --data-parallel-size with --tensor-parallel-size on CUDA is not supported: "
              "every replica's ranks would take the same GPUs", file=sys.stderr)
        return 2
    from ratchetlm.server.http import GuardedH11Protocol, RatchetServer

    app = build_app(load, args.served_model_name or [default_model_name(model)], cfg, hide=(str(model or ""),))
    state = app.state.ratchet
    served.append(state)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                            workers=1,
                            http=GuardedH11Protocol, timeout_keep_alive=max(1, round(cfg.idle_timeout)),
                            timeout_graceful_shutdown=round(cfg.shutdown_timeout) + 5)
    server = RatchetServer(config, on_shutdown_signal=state.begin_shutdown, drained=lambda: state.active == 0,
                           drain_timeout=cfg.shutdown_timeout + 5)  # (running requests end with an error by then)

    def stop_after_load_failure() -> None:  # load thread: /health reports the failure briefly, then exit
        def stop() -> None:
            server.should_exit = True

        loop = state.loop
        assert loop is not None, "the model loads only after the server started"
        loop.call_soon_threadsafe(loop.call_later, LOAD_FAILURE_GRACE_S, stop)

    state.on_load_failed = stop_after_load_failure
    server.run()
    return 1 if state.load_error else 0


LOAD_FAILURE_GRACE_S = 2.0  # /health shows a load failure this long before the process exits


if __name__ == "__main__":
    raise SystemExit(main())
