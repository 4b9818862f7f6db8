"""The pooling runner (vLLM's ``runner="pooling"``): ``LLM.embed`` / ``LLM.encode`` and
``/v1/embeddings`` on the model's final hidden states.

A prompt's vector is its final hidden states (after the model's last norm, the rows the LM head
reads) pooled by the engine's declared ``pooling_type``: ``last`` (the last token's row: what a
causal model has seen the whole prompt by) or ``mean`` (the average over the prompt's rows), then
L2-normalised unless ``pooling_normalize`` (or the request's ``normalize``) says otherwise.

Where the hidden states come from: a dedicated **write-free forward** through the model runner
(:meth:`ModelRunner.forward` with ``write=False``, the layer-skip draft's kind of forward): every
prompt is its own causal sequence with no cached context, its K/V go to a null sink, so no KV block
is taken and nothing is ever left in the cache or the prefix cache. Several prompts share one
forward up to ``max_num_batched_tokens`` rows (a longer prompt runs alone, up to
``max_model_len``); the numerics modes are batch-invariant, so packing does not change a vector.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ratchetlm.engine.model_runner import ForwardPlan, ModelRunner

POOLING_TASKS = ("embed", "token_embed")  # vLLM's names: one vector per prompt / one per token


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's per-request pooling options. ``normalize`` None: the engine's ``pooling_normalize``.
    ``dimensions`` (a Matryoshka truncation) is refused unless it is the model's hidden size: this
    engine serves no model trained for shorter vectors."""

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or None, got {self.normalize!r}")
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d <= 0):
            raise ValueError(f"dimensions must be a positive integer, got {d!r}")


@dataclass
class PoolingOutput:
    data: torch.Tensor  # [hidden] (task "embed") or [num_tokens, hidden] ("token_embed"), fp32 CPU


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """vLLM's shape: ``outputs.data`` (``LLM.encode``) or ``outputs.embedding`` (``LLM.embed``)."""

    request_id: str
    outputs: Any  # PoolingOutput | EmbeddingOutput
    prompt_token_ids: list[int] = field(default_factory=list)
    finished: bool = True


def prompt_token_ids(llm: Any, prompt: Any) -> list[int]:
    """One prompt (text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``)
    -> token ids, exactly as generation feeds it: ``LLM.tokenize`` (the tokenizer's own special
    tokens, as vLLM's embeddings add them)."""
    return list(llm.tokenize(prompt))


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of them (a flat list of ints is one prompt of token ids)."""
    if isinstance(prompts, str | Mapping):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or list of those")
    return list(prompts)


def pooling_runner(llm: Any) -> ModelRunner:
    runner = llm.engine.runner
    if not isinstance(runner, ModelRunner):
        raise ValueError(f"pooling is not supported for this model's cache layout ({type(runner).__name__})")
    return runner


@torch.inference_mode()
def final_hidden_states(runner: ModelRunner, prompts: Sequence[list[int]], step_tokens: int,
                        max_model_len: int) -> list[torch.Tensor]:
    """Per prompt its final hidden states ``[len(prompt), hidden]`` (fp32, CPU), from write-free
    forwards of at most ``step_tokens`` rows each (a longer prompt alone)."""
    for i, ids in enumerate(prompts):
        if len(ids) > max_model_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; this model's context is {max_model_len}")
    out: list[torch.Tensor] = []
    batch: list[list[int]] = []

    def run() -> None:
        if not batch:
            return
        lens = [len(b) for b in batch]
        total = sum(lens)
        groups = len(runner.cache.slot_groups)
        none = torch.full((total,) if groups == 1 else (groups, total), -1, dtype=torch.long)
        plan = ForwardPlan(torch.tensor([t for b in batch for t in b], dtype=torch.long),
                           torch.tensor([p for n in lens for p in range(n)], dtype=torch.long), lens,
                           [torch.empty(0, dtype=torch.long)] * len(batch), [0] * len(batch), [None] * len(batch),
                           none, None, [], write=False)
        hidden, _ = runner.forward(plan)  # [total, hidden]
        out.extend(h.float().cpu() for h in hidden.split(lens))
        batch.clear()

    for ids in prompts:
        if batch and sum(len(b) for b in batch) + len(ids) > step_tokens:
            run()
        batch.append(ids)
    run()
    return out


def pool(hidden: torch.Tensor, pooling_type: str, normalize: bool) -> torch.Tensor:
    """``[n, hidden]`` -> ``[hidden]``: the last row or the mean, L2-normalised if asked."""
    assert hidden.dim() == 2 and hidden.shape[0] >= 1
    v = hidden[-1] if pooling_type == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(v, p=2, dim=-1) if normalize else v


def encode(llm: Any, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
           pooling_task: str = "embed") -> list[PoolingRequestOutput]:
    """vLLM's ``LLM.encode``: per prompt a :class:`PoolingOutput` (``embed``: the pooled vector;
    ``token_embed``: every token's final hidden state, normalised per row if asked)."""
    if pooling_task not in POOLING_TASKS:
        raise ValueError(f"pooling_task must be one of {', '.join(POOLING_TASKS)}, got {pooling_task!r}")
    cfg = llm.config
    if cfg.runner != "pooling":
        raise ValueError("pooling needs the pooling runner: LLM(..., runner='pooling') (ratchet serve --runner "
                         "pooling)")
    plist = as_prompt_list(prompts)
    params = list(pooling_params) if isinstance(pooling_params, Sequence) else [pooling_params or PoolingParams()]
    if len(params) == 1:
        params = params * len(plist)
    if len(params) != len(plist):
        raise ValueError(f"got {len(params)} PoolingParams for {len(plist)} prompts")
    runner = pooling_runner(llm)
    hidden_size = int(llm.model_config.hidden_size)
    for p in params:
        if p.dimensions is not None and p.dimensions != hidden_size:
            raise ValueError(f"dimensions={p.dimensions} is not supported: this model's vectors have {hidden_size} "
                             "dimensions and it was not trained for shorter ones")
    ids = [prompt_token_ids(llm, p) for p in plist]
    with llm.forward_lock:  # one forward at a time: the server's preparation pool runs requests in parallel
        hidden = final_hidden_states(runner, ids, llm.engine.cfg.max_num_batched_tokens, llm.engine.max_model_len)
    outs = []
    for i, (h, p, tok) in enumerate(zip(hidden, params, ids, strict=True)):
        norm = cfg.pooling_normalize if p.normalize is None else p.normalize
        if pooling_task == "embed":
            data = pool(h, cfg.pooling_type, norm)
        else:
            data = torch.nn.functional.normalize(h, p=2, dim=-1) if norm else h
        outs.append(PoolingRequestOutput(str(i), PoolingOutput(data), tok))
    return outs


def embed(llm: Any, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None
          ) -> list[PoolingRequestOutput]:
    """vLLM's ``LLM.embed``: per prompt ``outputs.embedding`` (a list of floats)."""
    return [PoolingRequestOutput(o.request_id, EmbeddingOutput(o.outputs.data.tolist()), o.prompt_token_ids)
            for o in encode(llm, prompts, pooling_params, "embed")]
