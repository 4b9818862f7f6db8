"""The user-facing facade: ``LLM(...).generate(prompts, params)``, ``chat``, ``stream``."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, fields
from typing import Any

from tqdm import tqdm

from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.models.registry import load_model
from ratchetlm.parallel.launch import start_tensor_parallel
from ratchetlm.sampling_params import SamplingParams
from ratchetlm.text.stream import TextStream

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamEvent:
    """Committed tokens of one request in one engine step, with the text they release."""

    index: int  # position of the request in the submitted list
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None


class LLM:
    """Offline inference. Keyword arguments are :class:`EngineConfig` fields, plus
    ``speculative={...}`` / ``wedlm={...}`` shorthands for ``decoding``/``decoding_options``."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        spec = kwargs.pop("speculative", None)
        wedlm = kwargs.pop("wedlm", None)
        mask_token_id = kwargs.pop("mask_token_id", None)
        if spec is not None:
            kwargs.setdefault("decoding", "speculative")
            kwargs["decoding_options"] = dict(spec)
        if wedlm is not None or kwargs.get("decoding") == "wedlm":
            kwargs.setdefault("decoding", "wedlm")
            kwargs["decoding_options"] = dict(wedlm or {})
        names = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=model, **kwargs)
        # tensor parallelism: this process is rank 0; the other ranks load their shards meanwhile
        parallel = start_tensor_parallel(self.config, mask_token_id)
        try:
            loaded = load_model(model, _dev(self.config), self.config.torch_dtype(),
                                self.config.progress, mask_token_id=mask_token_id,
                                gguf_kernels=self.config.gguf_kernels, numerics=self.config.numerics,
                                **({} if parallel is None else parallel.load_args()))
            if parallel is not None:
                parallel.wait_ready()
            self.tokenizer = loaded.tokenizer
            self.model_config = loaded.config
            self.engine = LLMEngine(self.config, loaded.model, loaded.config, tokenizer=loaded.tokenizer,
                                    parallel=parallel)
        except BaseException:
            if parallel is not None:
                parallel.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when this object is collected or at exit)."""
        close = getattr(self.engine.runner, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ prompts

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: at least one token is required")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, list | tuple):
            return [int(t) if not isinstance(t, bool) else -1 for t in prompt]
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            tool_parser: str | None = None, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (OpenAI shape: assistant ``tool_calls`` and ``role: "tool"``
        results allowed). ``tools`` (OpenAI function tools) reach a template that handles them, or are
        described in the system message in the ``tool_parser`` family's format (structured/tool_calls.py)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        template = getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise ValueError("this model has no chat template")
        if tools is None and not any(m.get("tool_calls") for m in messages):
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        from ratchetlm.structured.tool_calls import chat_messages, functions_from, template_handles_tools, tool_format

        funcs = functions_from(tools or [])
        native = template_handles_tools(template)
        msgs = chat_messages(messages, funcs, tool_format(tool_parser, template), native)
        kw: dict[str, Any] = {"tools": [f.as_openai() for f in funcs]} if native and funcs else {}
        return self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kw)

    # ------------------------------------------------------------------ generation

    def stream(
        self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> Iterator[StreamEvent]:
        """Run requests to completion, yielding each step's committed tokens per request."""
        plist = _as_list(prompts)
        params_list = _params_list(params, len(plist))
        encoded = [self.encode(p) for p in plist]  # validate everything before queuing anything
        ids: dict[int, int] = {}
        texts: dict[int, TextStream] = {}
        try:
            for i, (ids_i, sp) in enumerate(zip(encoded, params_list, strict=True)):
                sid = self.engine.add_request(ids_i, sp)
                ids[sid] = i
                texts[sid] = TextStream(self.tokenizer, ids_i, sp.stop, sp.include_stop_str_in_output)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.seq_id not in ids:
                        continue
                    ts = texts[out.seq_id]
                    visible = out.new_token_ids
                    if out.finish_reason == "stop" and visible and self.engine.is_stop_token(out.seq_id, visible[-1]):
                        visible = visible[:-1]  # EOS / stop token ids end the request but are not text
                    delta = ts.feed(visible)
                    finished, reason = out.finished, out.finish_reason
                    if delta.stopped and not finished:
                        self.engine.abort(out.seq_id, "stop")
                        finished, reason = True, "stop"
                    text = delta.text + (ts.finish() if finished else "")
                    yield StreamEvent(ids[out.seq_id], out.new_token_ids, text, finished, reason)
        finally:
            for sid in ids:
                self.engine.abort(sid)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        plist = _as_list(prompts)
        params_list = _params_list(params, len(plist))
        n = len(plist)
        token_ids: list[list[int]] = [[] for _ in range(n)]
        text = [""] * n
        reasons: list[str | None] = [None] * n
        show = self.config.progress if use_tqdm is None else use_tqdm
        bar = tqdm(total=n, desc="generating", disable=not show or n < 2)
        sids_before = set(self.engine.seqs)
        for ev in self.stream(plist, params_list):
            token_ids[ev.index] += ev.token_ids
            text[ev.index] += ev.text
            if ev.finished:
                reasons[ev.index] = ev.finish_reason
                bar.update(1)
        bar.close()
        outs = []
        new_sids = sorted(set(self.engine.seqs) - sids_before)
        for i, sid in enumerate(new_sids):
            seq = self.engine.release(sid)
            assert seq is not None
            ids_i = seq.output_ids if reasons[i] != "stop" or not token_ids[i] else token_ids[i]
            outs.append(RequestOutput(
                request_id=sid,
                prompt=p_i if isinstance(p_i := plist[i], str) else None,
                prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
                text=text[i],
                token_ids=ids_i,
                finish_reason=reasons[i],
                logprobs=seq.logprobs or None,
                prompt_logprobs=seq.prompt_logprobs or None,
                metrics=dict(seq.stats, num_preemptions=seq.num_preemptions),
            ))
        return outs

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        convs: list[Any] = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in convs], params)


def _dev(cfg: EngineConfig) -> Any:
    import torch

    return torch.device(cfg.device)


def _as_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        return [[int(t) for t in prompts]]
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or list of those")
    return list(prompts)


def _params_list(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
