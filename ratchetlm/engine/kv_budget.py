"""KV cache size from ``gpu_memory_utilization`` (vLLM's meaning: the share of the GPU this engine
may fill with weights, activations and KV cache).

Measured after the model is loaded: ``budget = utilization x total - (total - free) - reserve``.
``total - free`` is everything already resident on the device (our weights and anyone else's
memory), ``reserve`` the activations of the largest forward (``max_num_batched_tokens`` rows through
the widest layer, plus fp32 logits of every running sequence). On CPU the option is accepted and
ignored with a warning: host memory is shared with everything else on the machine, so the cache is
sized by ``kv_cache_bytes`` (default ~1 GiB), as vLLM's CPU backend sizes it by its own setting.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ratchetlm.engine.config import EngineConfig

log = logging.getLogger("ratchetlm")


def activation_reserve(cfg: EngineConfig, model_config: Any, dtype: torch.dtype) -> int:
    """Bytes the largest forward's activations may need (an upper estimate, see module doc)."""
    hidden = int(getattr(model_config, "hidden_size", 4096))
    inter = int(getattr(model_config, "intermediate_size", 4 * hidden) or 4 * hidden)
    vocab = int(getattr(model_config, "vocab_size", 32000))
    per_row = (4 * hidden + 3 * inter) * torch.tensor([], dtype=dtype).element_size()
    return cfg.max_num_batched_tokens * per_row + cfg.max_num_seqs * vocab * 4


def kv_budget_bytes(utilization: float, free: int, total: int, reserve: int) -> int:
    """The KV cache bytes ``utilization`` leaves; ``ValueError`` when that is nothing."""
    budget = int(utilization * total) - (total - free) - reserve
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} allows {utilization * total / 2**30:.2f} GiB of the device's "
            f"{total / 2**30:.2f} GiB, but {(total - free) / 2**30:.2f} GiB are in use (weights, other "
            f"processes) and activations need {reserve / 2**30:.2f} GiB: no room for a KV cache "
            "(raise it, or lower max_num_batched_tokens / max_num_seqs)")
    return budget


def sized_config(cfg: EngineConfig, model_config: Any, dtype: torch.dtype) -> EngineConfig:
    """``cfg`` with ``kv_cache_bytes`` set from ``gpu_memory_utilization`` where that applies (CUDA,
    no explicit ``kv_cache_bytes`` / ``kv_cache_blocks``)."""
    u = cfg.gpu_memory_utilization
    if u is None or cfg.kv_cache_bytes is not None or cfg.kv_cache_blocks is not None:
        return cfg
    if not cfg.device.startswith("cuda"):
        log.warning("gpu_memory_utilization=%s is ignored on %s: the KV cache is sized by kv_cache_bytes "
                    "(default ~1 GiB)", u, cfg.device)
        return cfg
    device = torch.device(cfg.device)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(u, free, total, activation_reserve(cfg, model_config, dtype))
    log.info("KV cache: %.2f GiB from gpu_memory_utilization=%s", budget / 2**30, u)
    return dataclasses.replace(cfg, kv_cache_bytes=budget)
