"""When a batch makes every draft too dear, stop paying for proposing: the step is a plain step.

The gain rule (gain.py for n-gram drafts, tree_select.py for the tree proposers) decides per step
and sequence whether a draft pays on the cost curve at the step's batch. On a CPU a big batch prices
nearly every draft out (at 8 decoding sequences one sequence's share of a plain forward is ~0.2
one-row forwards, one more verified row ~0.2 too), and a step in which no sequence drafts runs the
plain forward, but it still paid for the proposing: a lookup per sequence and, for the hybrid, a
tree built in Python and Token Recycling's top-k over every computed row (~3 ms a step at batch 8 on
one core, 5-8% of a decode step there: the loss measured against plain decoding at batch 8,
docs/benchmarks.md).

The gate learns, per batch size, whether proposing is idle: after ``patience`` consecutive steps at
a batch size in which the rule drafted nothing for any sequence, steps at that batch size skip the
proposer (and the successor-table update; the strategy takes the plain path for every sequence),
except every ``probe``-th step, which proposes as usual; a step that drafts resets its batch size's
count; batch sizes below ``from_batch`` are never gated (the n-gram proposer alone: a lookup costs
~0.1 ms, less than the drafts a closed gate would miss). The decision depends only on earlier steps,
so the output is unchanged (verification is lossless for any draft policy, greedy or sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IdleGate:
    patience: int = 4  # idle steps at a batch size before its steps skip the proposer
    # smaller batches always propose: where a proposal is cheap (an n-gram lookup alone, ~0.1 ms) a
    # match the gate skips costs more than the lookups it saves (see NgramProposer)
    from_batch: int = 1
    probe: int = 8  # of the skipped batch size's steps, every probe-th proposes anyway
    idle: dict[int, int] = field(default_factory=dict)  # batch size -> consecutive idle steps
    skipped: int = 0  # steps the gate took the plain path for (a metric)

    def __post_init__(self) -> None:
        assert self.patience >= 1 and self.probe >= 1 and self.from_batch >= 1, (self.patience, self.probe,
                                                                                  self.from_batch)

    def open(self, batch: int) -> bool:
        """Whether a step of ``batch`` decoding sequences should propose."""
        n = self.idle.get(batch, 0)
        if batch < self.from_batch or n < self.patience or (n - self.patience) % self.probe == self.probe - 1:
            return True
        self.idle[batch] = n + 1  # a skipped step counts as idle (its position in the probe cycle)
        self.skipped += 1
        return False

    def observe(self, batch: int, drafted: bool) -> None:
        """A step of ``batch`` sequences that proposed: whether any sequence drafted."""
        self.idle[batch] = 0 if drafted else self.idle.get(batch, 0) + 1
