"""The front process of a data-parallel server (``ratchet serve --data-parallel-size N``): it
validates, templates and tokenizes requests and sends them to the replicas (server/replicas.py),
so it needs the model's tokenizer, chat template and a few facts about the engines, not their
weights or KV cache. A replica reports the facts (:class:`EngineFacts`) once it has loaded; the front
loads the tokenizer alone (:class:`FrontLLM`) and answers exactly as one engine's server would.

One exception: the pooling runner computes embeddings in the process that serves the request
(server/serving_embedding.py), so a pooling front loads the whole model as before.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.engine_args import decoding_shorthands, split_engine_args
from ratchetlm.engine.prompt_side import PromptSide
from ratchetlm.layers.logits_processors import ControlsFactory
from ratchetlm.layers.mapped_pages import trim_heap
from ratchetlm.models.loader import resolve
from ratchetlm.models.tokenizer import load_tokenizer
from ratchetlm.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class EngineFacts:
    """What requests are checked against, as a replica's loaded engine has it (picklable: it comes
    over the replica's pipe)."""

    config: EngineConfig  # the LLM's: runner, override_generation_config
    engine_cfg: EngineConfig  # the engine's, sized to the KV cache: max_waiting, jump_forward
    model_config: Any  # ModelConfig / DeepseekV4Config: vocab_size, eos_token_ids, hidden_size
    max_model_len: int  # the engine's (its runner may hold less than the model's positions)
    default_sampling: dict[str, Any]  # the model's generation_config (engine/generation_config.py)
    # why the decoding strategy refuses a structured-output request (WeDLM), or None: the one
    # per-request check the front asks the strategy for (server/structured.py:compile_constraint)
    structured_refusal: str | None

    @classmethod
    def of(cls, llm: Any) -> EngineFacts:
        eng = llm.engine
        try:
            eng.strategy.check_request(SamplingParams(structured=StructuredOutputsParams(json_object=True)))
            refusal = None
        except ValueError as e:
            refusal = str(e)
        return cls(llm.config, eng.cfg, eng.model_config, int(eng.max_model_len), dict(llm.default_sampling),
                   refusal)


class _StructuredCheck:
    """The replicas' strategy, as far as the front asks it (``check_request`` of a structured request)."""

    def __init__(self, refusal: str | None) -> None:
        self.refusal = refusal

    def check_request(self, params: SamplingParams) -> None:
        if self.refusal is not None and params.structured is not None:
            raise ValueError(self.refusal)


class FrontEngine:
    """The engine attributes the serving code reads (``max_model_len``, ``cfg``, ``model_config``,
    ``controls`` for grammar compilation, ``strategy``), without a model, a runner or a KV cache."""

    def __init__(self, facts: EngineFacts, tokenizer: Any) -> None:
        self.max_model_len = facts.max_model_len
        self.cfg = facts.engine_cfg
        self.model_config = facts.model_config
        self.controls = ControlsFactory(tokenizer, facts.model_config.vocab_size, facts.model_config.eos_token_ids,
                                        jump_forward=facts.engine_cfg.jump_forward)
        self.strategy = _StructuredCheck(facts.structured_refusal)


class FrontLLM(PromptSide):
    """An ``LLM`` as the serving code uses it (``tokenizer``, ``tokenize``, ``apply_chat_template``,
    ``config``, ``model_config``, ``default_sampling``, ``engine``), from the tokenizer and ``facts``."""

    def __init__(self, model: str | None, kwargs: dict[str, Any], facts: EngineFacts,
                 chat_template: str | None = None) -> None:
        kw = {k: v for k, v in kwargs.items() if k != "mask_token_id"}
        with warnings.catch_warnings():  # the replicas already warned about ignored flags
            warnings.simplefilter("ignore")
            _, extras = split_engine_args(decoding_shorthands(kw))
        self.config = facts.config
        self.model_config = facts.model_config
        self.default_sampling = dict(facts.default_sampling)
        source = resolve(model)
        self._set_tokenizer(load_tokenizer(source), source, extras.get("tokenizer"), facts.model_config.vocab_size)
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.engine = FrontEngine(facts, self.tokenizer)
        trim_heap()  # what the tokenizer's load parsed and dropped (~30 MB) back to the OS, as LLM does
