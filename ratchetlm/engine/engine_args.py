"""vLLM's engine arguments, as ``LLM(...)`` and ``ratchet serve`` receive them from vLLM habits.

Every keyword ``LLM`` takes is either an :class:`EngineConfig` field or a vLLM ``EngineArgs`` name,
sorted here into three kinds (the mapping table is in docs/vllm_compat.md#engine-arguments):

* **mapped**: the same meaning under our name (``kv_cache_memory_bytes`` -> ``kv_cache_bytes``,
  ``speculative_config`` -> ``speculative``, ``tokenizer``, ...; ``tensor_parallel_size`` is a field);
* **refused unless neutral**: a value that would change what the model computes and that this
  engine cannot honour (``quantization="awq"``, ``kv_cache_dtype="fp8"``, LoRA, RoPE overrides)
  is a ``ValueError`` naming it; the neutral value (``"auto"``, ``None``, ``False``) is accepted;
* **ignored**: settings of vLLM's own machinery (hub downloads, remote code, swap space, CUDA-graph
  capture sizes, logging) that do not change results here: accepted, and ONE warning lists them.

A name in none of these lists (nor a field) is a ``TypeError``, as for any unknown keyword.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from ratchetlm.engine.config import EngineConfig

# vLLM name -> our field (same meaning)
RENAMED = {"kv_cache_memory_bytes": "kv_cache_bytes", "num_gpu_blocks_override": "kv_cache_blocks"}

# vLLM name -> the values we can honour (anything else changes results: refused)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "quantization": (None, "gguf"),  # GGUF block formats are read as stored; AWQ/GPTQ/fp8 are not
    "load_format": ("auto", "gguf", "safetensors"),
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),  # offline LLM: one engine (``ratchet serve --data-parallel-size``)
    "enable_lora": (False, None),
    "skip_tokenizer_init": (False,),
    "disable_sliding_window": (False,),
    "rope_scaling": (None,),
    "rope_theta": (None,),
    "hf_overrides": (None,),
    "task": ("auto", "generate"),  # "embed": runner="pooling" (below)
    "convert": ("auto", "none", "embed"),  # "embed" on the pooling runner: what it does to a causal LM here
    "logprobs_mode": ("raw_logprobs",),  # our logprobs are the model's raw distribution
}

# vLLM names that configure vLLM's own machinery and change no result here
IGNORED = frozenset({
    "trust_remote_code", "revision", "code_revision", "tokenizer_revision", "download_dir", "hf_token",
    "tokenizer_mode", "config_format", "served_model_name", "swap_space", "cpu_offload_gb",
    "max_seq_len_to_capture", "disable_custom_all_reduce", "disable_log_stats", "disable_log_requests",
    "max_logprobs", "compilation_config", "max_parallel_loading_workers", "distributed_executor_backend",
    "enable_chunked_prefill", "max_num_partial_prefills", "max_long_partial_prefills", "scheduling_policy",
    "worker_cls", "worker_extension_cls", "enable_sleep_mode", "model_impl",
    "async_scheduling", "limit_mm_per_prompt", "mm_processor_kwargs", "allowed_local_media_path",
    "preemption_mode", "calculate_kv_scales", "kv_transfer_config", "kv_events_config",
    "structured_outputs_config", "guided_decoding_backend", "disable_async_output_proc",
    "use_tqdm_on_load", "pt_load_map_location", "enable_expert_parallel", "reasoning_parser",
    "tokenizer_pool_size", "num_scheduler_steps", "block_allocator", "ray_workers_use_nsight",
    "otlp_traces_endpoint", "collect_detailed_traces", "max_cpu_loras",
    "max_loras", "max_lora_rank", "seed_everything", "stream_interval", "enable_return_routed_experts",
})


def decoding_shorthands(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``speculative={...}`` / ``wedlm={...}`` -> ``decoding`` + ``decoding_options`` (a copy of ``kwargs``)."""
    kwargs = dict(kwargs)
    for name in ("speculative", "wedlm"):
        options = kwargs.pop(name, None)
        if options is None:
            continue
        if kwargs.get("decoding_options") and kwargs.get("decoding") == name:
            other = "speculative_config (vLLM's name)" if name == "speculative" else "decoding_options"
            raise ValueError(f"give {name}={{...}} or {other}, not both")
        kwargs.setdefault("decoding", name)
        kwargs["decoding_options"] = dict(options)
    return kwargs


def split_engine_args(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``LLM(**kwargs)`` -> (EngineConfig fields, extras the facade handles itself: ``tokenizer``).
    Raises ``ValueError`` for a vLLM value that would change results, ``TypeError`` for unknown names;
    warns once, listing every ignored vLLM argument."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    ignored: list[str] = []
    unknown: list[str] = []
    for name, value in kwargs.items():
        if name in fields:
            out[name] = value
        elif name in RENAMED:
            if value is not None:
                out[RENAMED[name]] = value
        elif name == "tokenizer":
            extras["tokenizer"] = value
        elif name == "task" and value == "embed":  # vLLM's older spelling of the pooling runner
            out.setdefault("runner", "pooling")
        elif name in ("pooler_config", "override_pooler_config"):
            out.update(pooler_options(value))
        elif name == "speculative_config":
            if value is not None:
                out["decoding"] = "speculative"
                out["decoding_options"] = speculative_options(value)
        elif name in NEUTRAL:
            if value not in NEUTRAL[name] and not (value == {} and None in NEUTRAL[name]):
                raise ValueError(f"{name}={value!r} is not supported here (it would change the results); "
                                 f"accepted: {', '.join(repr(v) for v in NEUTRAL[name])}")
        elif name in IGNORED:
            ignored.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
    if ignored:
        warnings.warn(f"ratchetlm ignores these vLLM engine arguments (they change nothing here): "
                      f"{', '.join(sorted(ignored))}", UserWarning, stacklevel=3)
    return out, extras


def pooler_options(cfg: Any) -> dict[str, Any]:
    """vLLM's ``pooler_config`` (a ``PoolerConfig`` or a dict: ``pooling_type``, ``normalize``) ->
    our ``pooling_type`` / ``pooling_normalize``; any other option set is refused."""
    if cfg is None:
        return {}
    items = dict(cfg) if isinstance(cfg, Mapping) else {k: v for k, v in vars(cfg).items() if v is not None}
    out: dict[str, Any] = {}
    for k, v in items.items():
        if v is None:
            continue
        if k == "pooling_type":
            out["pooling_type"] = str(v).lower()
        elif k == "normalize":
            out["pooling_normalize"] = v
        else:
            raise ValueError(f"pooler_config.{k} is not supported here (pooling_type and normalize are)")
    return out


def speculative_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``speculative_config`` -> our ``speculative`` options (docs/speculative.md)."""
    if not isinstance(cfg, Mapping):
        raise ValueError("speculative_config must be a dict")
    names = {"num_speculative_tokens": "depth", "prompt_lookup_max": "max_n", "prompt_lookup_min": "min_n",
             "disable_by_batch_size": "disable_by_batch_size"}
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if k == "model":
            if cfg.get("method") in (None, "draft_model"):
                out["draft_model"] = v
                out.setdefault("method", "draft_model")
            elif v is not None:
                raise ValueError(f"speculative_config: a 'model' for method {cfg.get('method')!r} is not "
                                 "supported here")
        elif k == "method":
            out["method"] = v
        else:
            out[names.get(k, k)] = v  # our own option names pass through; unknown ones are refused there
    return out
