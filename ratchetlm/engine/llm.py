"""The user-facing facade, in vLLM's offline shape: ``LLM(model=..., **engine args)``,
``generate(prompts, sampling_params)`` / ``chat(messages, sampling_params)`` returning
:class:`~ratchetlm.outputs.RequestOutput` (one ``CompletionOutput`` per choice), and ``stream``."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from ratchetlm.engine.choices import StreamEvent, choice_events, completion, request_output, submit_choices
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.engine_args import decoding_shorthands, split_engine_args
from ratchetlm.engine.generation_config import model_sampling_defaults
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.engine.pooling import PoolingParams, PoolingRequestOutput, embed, encode
from ratchetlm.engine.prompt_side import PromptSide
from ratchetlm.engine.prompts import Prompt, as_prompt_list, prompt_text
from ratchetlm.layers.mapped_pages import trim_heap
from ratchetlm.models.registry import load_model
from ratchetlm.outputs import RequestOutput
from ratchetlm.runners import start_tensor_parallel
from ratchetlm.sampling_params import SamplingParams

log = logging.getLogger("ratchetlm")

__all__ = ["LLM", "RequestOutput", "StreamEvent"]


class LLM(PromptSide):
    """Offline inference. Keyword arguments are :class:`EngineConfig` fields and vLLM engine
    arguments (engine/engine_args.py: honoured where they mean something here, else ignored with
    one warning), plus ``speculative={...}`` / ``wedlm={...}`` shorthands for
    ``decoding``/``decoding_options``. ``tokenize`` / ``apply_chat_template`` / the default sampling
    parameters come from :class:`PromptSide`."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        mask_token_id = kwargs.pop("mask_token_id", None)
        kwargs, extras = split_engine_args(decoding_shorthands(kwargs))
        self.config = EngineConfig(model=model, **kwargs)
        dtype = self.config.dtype_choice()
        log.info("%s", dtype.describe())  # once per engine: what runs, and why (engine/dtype.py)
        self.dtype_description = dtype.describe()
        # tensor parallelism: this process is rank 0; the other ranks load their shards meanwhile
        parallel = start_tensor_parallel(self.config, mask_token_id)
        try:
            loaded = load_model(model, _dev(self.config), dtype.dtype,
                                self.config.progress, mask_token_id=mask_token_id,
                                gguf_kernels=self.config.gguf_kernels, numerics=self.config.numerics,
                                **({} if parallel is None else parallel.load_args()))
            if parallel is not None:
                parallel.wait_ready()
            self.config = self.config.with_model_numerics(loaded.model)
            log.info("%s", loaded.numerics.describe())  # once per engine: which numerics, and why
            self.numerics_description = loaded.numerics.describe()
            self._set_tokenizer(loaded.tokenizer, loaded.source, extras.get("tokenizer"), loaded.config.vocab_size)
            self.model_config = loaded.config
            # vLLM's generation_config: the model's recommended sampling, for requests that give none
            self.default_sampling = model_sampling_defaults(self.config.generation_config, loaded.source,
                                                            self.config.override_generation_config)
            if self.default_sampling:
                log.info("default sampling parameters (generation_config=%s%s): %s; a request's own values win "
                         "(generation_config='vllm' ignores the model's)", self.config.generation_config,
                         " + override" if self.config.override_generation_config else "",
                         ", ".join(f"{k}={v}" for k, v in self.default_sampling.items()))
            self.forward_lock = threading.Lock()  # write-free pooling forwards from several threads (engine/pooling.py)
            self.engine = LLMEngine(self.config, loaded.model, loaded.config, tokenizer=self.tokenizer,
                                    parallel=parallel)
            trim_heap()  # what loading parsed and dropped (the tokenizer's ~30 MB) back to the OS
        except BaseException:
            if parallel is not None:
                parallel.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when this object is collected or at exit)."""
        close = getattr(self.engine.runner, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ pooling (engine/pooling.py)

    def encode(self, prompt: Any, pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
               use_tqdm: bool | None = None, pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's pooling call (engine/pooling.py): a :class:`PoolingRequestOutput` per prompt. The tokenizer
        helper that used this name is :meth:`tokenize`."""
        return encode(self, prompt, pooling_params, pooling_task or "embed")

    def embed(self, prompts: Any, pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              use_tqdm: bool | None = None) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.embed`` (pooling runner): per prompt ``outputs.embedding``, its final hidden
        states pooled as ``pooling_type`` says (engine/pooling.py)."""
        return embed(self, prompts, pooling_params)

    # ------------------------------------------------------------------ generation

    def _submit(self, encoded: list[list[int]],
                sampling_params: SamplingParams | Seq[SamplingParams] | None) -> dict[int, Any]:
        if self.config.runner == "pooling":
            raise ValueError("this LLM runs the pooling runner (runner='pooling'): use embed / encode; generation "
                             "needs runner='generate'")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return submit_choices(self.engine, self.tokenizer, encoded, sampling_params, self.special_ids)

    def stream(
        self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *, params: Any = None,
    ) -> Iterator[StreamEvent]:
        """Run requests to completion, yielding each step's committed tokens per request and choice."""
        runs = self._submit([self.tokenize(p) for p in as_prompt_list(prompts)], _renamed(sampling_params, params))
        try:
            yield from choice_events(self.engine, runs)
        finally:
            for sid in runs:
                self.engine.abort(sid)
                self.engine.release(sid)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        *, params: Any = None,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in order, each with ``n`` choices in ``outputs``."""
        plist = as_prompt_list(prompts)
        return self._generate([prompt_text(p) for p in plist], [self.tokenize(p) for p in plist],
                              _renamed(sampling_params, params), use_tqdm)

    def _generate(self, texts: list[str | None], encoded: list[list[int]],
                  sampling_params: SamplingParams | Seq[SamplingParams] | None,
                  use_tqdm: bool | None) -> list[RequestOutput]:
        runs = self._submit(encoded, sampling_params)
        plist = texts
        show = self.config.progress if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(plist), desc="generating", disable=not show or len(plist) < 2)
        left = [0] * len(plist)
        for run, _ in runs.values():
            left[run.index] += 1
        try:
            for ev in choice_events(self.engine, runs):
                if ev.finished:
                    left[ev.index] -= 1
                    bar.update(int(left[ev.index] == 0))
        finally:
            bar.close()
            for sid in runs:
                self.engine.abort(sid)
        decode = self._decode_token
        groups: dict[int, list[Any]] = {}
        for sid, (run, _) in runs.items():
            seq = self.engine.release(sid)
            assert seq is not None
            groups.setdefault(run.index, []).append((sid, seq, run))
        outs = []
        for i, text in enumerate(plist):
            sid0, leader, run0 = groups[i][0]
            choices = [completion(run, seq, decode) for _, seq, run in groups[i]]
            outs.append(request_output(str(sid0), text, leader, run0.params, choices, decode))
        return outs

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_special_tokens: bool = False,
        chat_template_content_format: str = "auto",
        *, params: Any = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages) or a list of them. The rendered
        text is tokenized without added special tokens (the template writes its own BOS)."""
        sampling_params = _renamed(sampling_params, params)
        convs: list[Any] = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts: list[str | None] = [self.apply_chat_template(c, tools, None, add_generation_prompt, chat_template,
                                                            continue_final_message, chat_template_kwargs,
                                                            chat_template_content_format)
                                   for c in convs]
        encoded = [self.tokenize(t, add_special_tokens) for t in texts if t is not None]
        return self._generate(texts, encoded, sampling_params, use_tqdm)


def _renamed(sampling_params: Any, params: Any) -> Any:
    """``params=`` (ratchetlm < 0.2) is a deprecated alias of vLLM's ``sampling_params=``."""
    if params is None:
        return sampling_params
    if sampling_params is not None:
        raise TypeError("give sampling_params or params (its deprecated name), not both")
    warnings.warn("the params= keyword is deprecated: use sampling_params= (vLLM's name)", DeprecationWarning,
                  stacklevel=3)
    return params


def _dev(cfg: EngineConfig) -> Any:
    import torch

    return torch.device(cfg.device)

