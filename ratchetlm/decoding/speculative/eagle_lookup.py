"""``method="eagle_ngram"``: prompt lookup where a match is expected to pay, the EAGLE head elsewhere.

The two drafts are right in different places. A lookup copies the request's own text (an edit, a
summary quoting its article, a translation keeping names): when its match agrees, it agrees for many
tokens, and it costs nothing to find. The head predicts what the target says in its own words (an
answer, a step of arithmetic), a token at a time, for ~0.2 of a target step per token on a CPU.
Per step and sequence the lookup's draft is taken when its gain schedule drafts at all (its earlier
continuations of the same match length kept agreeing, gain.py); otherwise the head drafts a chain cut
by its own confidence (eagle.py). The head is fed the target's features of every committed position
either way: a sequence the lookup served catches up in one head forward when the head is next asked.
"""

from __future__ import annotations

from typing import Any

from ratchetlm.decoding.speculative.eagle import EagleProposer
from ratchetlm.decoding.speculative.proposers import DraftBeam, NgramProposer, register_proposer
from ratchetlm.sequence import Sequence

_DECLINES = "spec_head_declines"  # strategy_state key: the head's proposals in a row that drafted nothing
_WAIT = "spec_head_wait"  # strategy_state key: steps before the head is asked again
BACKOFF_MAX = 8


@register_proposer("eagle_ngram")
class EagleNgramProposer(EagleProposer):
    def __init__(self, cfg: Any, ctx: Any) -> None:
        super().__init__(cfg, ctx)
        self.lookup = NgramProposer(cfg, ctx)
        self.looked_up = 0  # drafts the lookup served
        self.headed = 0  # drafts the head served
        self.head_skipped = 0  # steps a sequence's head was not asked (backing off after declines)
        self._head_drafted = False  # the last proposal held a head draft

    def propose(self, seqs: list[Sequence], depths: list[int]) -> list[DraftBeam | None]:
        out = self.lookup.propose(seqs, depths)
        self._head_drafted = False
        rest = [i for i, beam in enumerate(out) if beam is None]
        self.looked_up += len(seqs) - len(rest)
        rest = [i for i in rest if self._asks_head(seqs[i])]
        if rest:
            for i, beam in zip(rest, super().propose([seqs[i] for i in rest], [depths[i] for i in rest]), strict=True):
                out[i] = beam
                self.headed += beam is not None
                self._head_drafted |= beam is not None
                self._heard(seqs[i], beam is not None)
        return out

    # A head forward costs ~0.2 of a step whether or not its confidence then pays for a draft. After a
    # sequence's head declined ``n`` times in a row it is asked again only after ``2**n - 1`` steps
    # (at most BACKOFF_MAX): a run of answers it cannot predict costs a few catch-ups, not one a step.
    def _asks_head(self, seq: Sequence) -> bool:
        wait = seq.strategy_state.get(_WAIT, 0)
        if wait > 0:
            seq.strategy_state[_WAIT] = wait - 1
            self.head_skipped += 1
            return False
        return True

    def _heard(self, seq: Sequence, drafted: bool) -> None:
        declines = 0 if drafted else seq.strategy_state.get(_DECLINES, 0) + 1
        seq.strategy_state[_DECLINES] = declines
        seq.strategy_state[_WAIT] = min(2**declines - 1, BACKOFF_MAX) if declines else 0

    def observe_step(self, batch: int, tokens: int, seconds: float) -> None:
        # the lookup's ledger prices its own drafts against plain steps: a step that verified a head's draft
        # is neither, and would teach it that plain steps cost what the head's verify did
        if not self._head_drafted:
            self.lookup.observe_step(batch, tokens, seconds)

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), **self.lookup.metrics(), "spec_lookup_drafts": self.looked_up,
                "spec_head_drafts": self.headed, "spec_head_skipped": self.head_skipped}
