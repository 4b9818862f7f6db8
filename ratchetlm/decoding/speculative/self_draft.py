"""Layer-skip self-draft: the target's first N layers + final norm + head as the draft model.

Because the draft's layers *are* the target's first N layers, the target's committed K/V for
layers ``< N`` are exactly the draft's K/V for the committed tokens: the draft attends the
engine's own paged cache and needs no KV of its own. Draft forwards (``runner.draft_forward``,
which tensor parallelism mirrors on every rank) write nothing: attention only sees committed cache + the forward's
own tokens, so every draft step re-feeds the root and the current beams, packed as a prefix
tree (for a chain of depth C that is 1 + 2 + ... + C token rows over C forwards — cheap next
to the weight reads a CPU forward is bound by, and it avoids a draft-KV side cache).
Greedy chain for ``num_candidates == 1``, beam search of width M otherwise.
"""

from __future__ import annotations

import torch

from ratchetlm.decoding.speculative.beam_search import beam_search, tree_feed
from ratchetlm.decoding.speculative.proposers import DraftBeam, Proposer, register_proposer
from ratchetlm.sequence import Sequence


@register_proposer("draft")
class SelfDraftProposer(Proposer):
    """Beam search (greedy chain when M == 1) with the first ``draft_layers`` target layers."""

    def __init__(self, cfg: object, ctx: object) -> None:
        super().__init__(cfg, ctx)
        n_layers = ctx.model_config.num_layers  # type: ignore[attr-defined]
        self.num_layers = cfg.draft_layers  # type: ignore[attr-defined]
        if self.num_layers >= n_layers:
            raise ValueError(f"draft_layers must be < the model's {n_layers} layers, got {self.num_layers}")
        self.num_forwards = 0

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        runner = self.ctx.runner

        def step(k: int, live: list[int], beams: list[torch.Tensor]) -> list[torch.Tensor]:
            feeds = [tree_feed(seqs[i].token_ids[-1], b) for i, b in zip(live, beams, strict=True)]
            positions = [[seqs[i].num_cached + o for o in f.offsets] for i, f in zip(live, feeds, strict=True)]
            self.num_forwards += 1
            return runner.draft_forward([seqs[i] for i in live], [f.tokens for f in feeds], positions,
                                        [f.mask for f in feeds], [f.rows for f in feeds], self.num_layers)

        return list(beam_search(step, depths, self.cfg.num_candidates))

    def metrics(self) -> dict[str, float]:
        return {"spec_draft_forwards": self.num_forwards}
