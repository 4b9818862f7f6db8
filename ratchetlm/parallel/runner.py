"""Rank 0's runner under tensor parallelism: the llama family's runner, mirrored on every rank.

It plans each forward exactly as :class:`~ratchetlm.engine.model_runner.ModelRunner` does (slots
from the block tables, staging rows, logits rows, masks), hands the plan to the workers, and runs
it on its own shard; the ranks meet in the model's all-reduces and the logits gather, and only
rank 0 receives logits. A staging commit is applied here first and, if it succeeded, queued for the
workers (they apply it before the next forward, so every rank's cache holds the same rows). The
scheduler, the strategies and sampling never see the difference: every strategy runs unchanged.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ratchetlm.engine.model_runner import ForwardPlan, ModelRunner


class TPModelRunner(ModelRunner):
    """Several engines may share one group's model (tests build one per strategy): each runner has
    an id, and its own cache on every rank, dropped when the runner is collected. Built by
    :meth:`~ratchetlm.parallel.group.TPGroup.make_runner`, which the engine's ``build_runner`` calls."""

    def __init__(self, *args: Any, group: Any, **kwargs: Any) -> None:  # group: parallel/group.py's TPGroup
        super().__init__(*args, **kwargs)
        self.group = group
        self.rid = group.runners
        group.runners += 1
        group.post("cache", (self.rid, self.blocks.num_blocks, self.max_model_len))
        weakref.finalize(self, group.post, "drop", self.rid)

    def forward(self, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor]:
        return self.group.run("forward", (self.rid, plan), lambda: ModelRunner.forward(self, plan))

    def commit_rows(self, rows: torch.Tensor | list[int]) -> bool:
        if self.group.broken is not None:  # no worker would follow: refuse before changing anything
            return False
        ok = super().commit_rows(rows)
        if ok:  # every rank staged the same rows with the same slots (the plan's): rows say it all
            self.group.post("commit", (self.rid, torch.tensor(rows, dtype=torch.long) if isinstance(rows, list)
                                       else rows.cpu()))
        return ok

    def close(self) -> None:
        self.group.close()
