"""What the engine needs to get a model's runner, declared below the engine and the models so that the
engine names neither a model package nor ``parallel/`` (docs/architecture.md, "Layers").

* :class:`StepResult`: what every runner's ``execute`` returns.
* Cache layouts: a model family with a layout of its own (DeepSeek-V4) registers its runner factory
  for its model class (:func:`register_layout`, done by models/deepseek_v4/runner.py);
  ``engine/model_runner.build_runner`` asks :func:`layout_of` and otherwise builds the llama family's
  paged per-token K/V runner.
* Tensor parallelism wraps that runner from outside: ``LLM(tensor_parallel_size=N)`` starts the ranks
  through :func:`start_tensor_parallel` (parallel/launch.py registers itself) and the engine receives
  rank 0's group, whose ``make_runner`` builds the runner that mirrors itself on the workers.

Importing ``ratchetlm`` imports the modules that register (ratchetlm/__init__.py), as importing
``ratchetlm.decoding`` registers the built-in strategies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepResult:
    logits: list[torch.Tensor]  # per sequence [len(logit_rows), vocab] fp32
    stage_base: list[int]  # per sequence: staging row of its proposal row 0 (-1 if direct)


# (cfg: EngineConfig, model, run dtype, device, max_model_len) -> the runner of the model's cache layout
RunnerFactory = Callable[[Any, Any, torch.dtype, torch.device, int], Any]
# (cfg: EngineConfig, mask_token_id) -> rank 0's tensor-parallel group (parallel/group.py's TPGroup)
TensorParallelStart = Callable[[Any, "int | None"], Any]

_LAYOUTS: dict[type, RunnerFactory] = {}
_TENSOR_PARALLEL: list[TensorParallelStart] = []


def register_layout(model_type: type, factory: RunnerFactory) -> None:
    """Models of ``model_type`` (and its subclasses) run on the runner ``factory`` builds."""
    _LAYOUTS[model_type] = factory


def layout_of(model: Any) -> RunnerFactory | None:
    """The runner factory ``model``'s class registered, or None (the llama family's paged K/V)."""
    for cls in type(model).__mro__:
        if cls in _LAYOUTS:
            return _LAYOUTS[cls]
    return None


def register_tensor_parallel(start: TensorParallelStart) -> None:
    _TENSOR_PARALLEL[:] = [start]


def start_tensor_parallel(cfg: Any, mask_token_id: int | None) -> Any:
    """None when ``cfg.tensor_parallel_size`` is 1; else rank 0's group, its workers loading their shards."""
    if cfg.tensor_parallel_size == 1:
        return None
    if not _TENSOR_PARALLEL:
        raise RuntimeError("tensor parallelism is not registered: import ratchetlm (ratchetlm/__init__.py imports "
                           "ratchetlm.parallel.launch, which registers it)")
    return _TENSOR_PARALLEL[0](cfg, mask_token_id)
