"""``LLM(tensor_parallel_size=N)``'s entry: check the model splits, then start (or join) the ranks."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ratchetlm.decoding.speculative.config import EAGLE_METHODS
from ratchetlm.runners import register_tensor_parallel

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def start_tensor_parallel(cfg: Any, mask_token_id: int | None) -> Any:
    """None when ``cfg.tensor_parallel_size`` is 1; else rank 0's
    :class:`~ratchetlm.parallel.group.TPGroup`, its workers loading their shards. The model is
    checked first (heads, KV heads and MLP width divisible, not DeepSeek-V4, no EAGLE head), so a
    model that cannot be split starts no process; every rank runs in the dtype rank 0 resolved."""
    if cfg.tensor_parallel_size == 1:
        return None
    from ratchetlm.models.registry import check_tensor_parallel
    from ratchetlm.parallel.group import TPGroup

    method = cfg.decoding_options.get("method") if cfg.decoding == "speculative" else None
    if method in EAGLE_METHODS:
        raise ValueError(f"speculative method={method!r} does not run with tensor_parallel_size > 1 (the head reads "
                         "the target's embedding and LM head rows, which are split over the ranks); use 'ngram', "
                         "'draft' (layer-skip) or 'draft_model'")
    check_tensor_parallel(cfg.model, cfg.tensor_parallel_size)
    return TPGroup.start(replace(cfg, dtype=_DTYPE_NAMES[cfg.torch_dtype()]), mask_token_id)


register_tensor_parallel(start_tensor_parallel)  # LLM(tensor_parallel_size=N) starts the ranks here
