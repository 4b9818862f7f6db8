"""WeDLM's fill selection in the running engine against an independent oracle (issue 40's seed
audit): the engine-vs-reference tests share ``select_fills`` / ``fill`` with the engine, so a wrong
rule there changes both sides alike. Here every fill decision the engine makes is re-derived from
the paper's rule (Eq. 11, docs/wedlm.md; /work/shared/reference/wedlm.md §2), written out below with
``torch.distributions.Categorical`` entropies and nothing from ``wedlm_window``:

* adjusted entropy ``H̃ᵢ = Hᵢ + λ·(idxᵢ − idx_first)``, ``idx`` the window indices of the masks that
  remain after pruning (so the leftmost mask is never penalised, and a gap of filled slots counts);
* parallel: fill every mask with ``H̃ < τ``, else only ``argmin H̃``;
* in order (controls that read the tokens before a slot): the first mask, then each next mask while
  its ``H̃ < τ``, each judged after the fills before it.

λ is raised to 0.3 so that the penalty decides fills; the test checks it did (some step's fills
differ from what λ = 0 would choose) and that windows had gaps (a mask's index is not its rank)."""

from __future__ import annotations

import pytest
import torch

import ratchetlm.decoding.wedlm as wedlm_strategy
from ratchetlm.sampling_params import SamplingParams

from .conftest import run

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100, 7], [9, 10, 11, 12, 13, 14]]
LAMBDA, TAU = 0.3, 0.8


def oracle_entropy(x: torch.Tensor) -> torch.Tensor:  # [m, V] -> [m] nats
    return torch.distributions.Categorical(logits=x.double()).entropy()


def oracle_parallel(x: torch.Tensor, slots: list[int], tau: float, lam: float) -> set[int]:
    adjusted = [float(h) + lam * (s - slots[0]) for h, s in zip(oracle_entropy(x), slots, strict=True)]
    under = {s for s, a in zip(slots, adjusted, strict=True) if a < tau}
    return under or {slots[min(range(len(slots)), key=adjusted.__getitem__)]}


class Spy:
    """Wraps the strategy's ``fill``: checks each call's fills against the oracle and keeps what
    disagreed (an assertion inside a step would be caught by the engine's fault isolation)."""

    def __init__(self, monkeypatch) -> None:
        self.mismatches: list[str] = []
        self.calls = 0
        self.penalty_decided = 0  # calls whose fills differ from the λ = 0 choice
        self.gaps = 0  # calls where some mask's window index is not its rank among the masks
        real = wedlm_strategy.fill

        def spy(w, slots, logits, cfg, params, generator, judge=None, in_order=False):
            n = real(w, slots, logits, cfg, params, generator, judge, in_order)
            filled = {k for k in slots if not w.is_mask[k]}
            self.calls += 1
            self.gaps += slots != list(range(slots[0], slots[0] + len(slots)))
            try:
                assert len(filled) == n
                if in_order:
                    self.check_in_order(w, slots, logits, cfg, judge, filled)
                else:
                    x = judge(logits, slots) if judge is not None else logits
                    want = oracle_parallel(x, slots, cfg.entropy_threshold, cfg.position_penalty)
                    assert filled == want, (slots, filled, want)
                    self.penalty_decided += want != oracle_parallel(x, slots, cfg.entropy_threshold, 0.0)
            except AssertionError as e:
                self.mismatches.append(repr(e))
            return n

        monkeypatch.setattr(wedlm_strategy, "fill", spy)

    def check_in_order(self, w, slots, logits, cfg, judge, filled) -> None:
        # a judge reads only the window before a slot, which the fills after it do not change:
        # judging after the call sees what the engine's judge saw during it
        f = len(filled)
        assert f >= 1 and filled == set(slots[:f]), (slots, filled)
        tau, lam = cfg.entropy_threshold, cfg.position_penalty
        stop_free = None
        for j, k in enumerate(slots[: f + 1]):
            if j == 0 or any(w.is_mask[:k]):
                continue
            x = judge(logits[j : j + 1], [k]) if judge is not None else logits[j : j + 1]
            h = float(oracle_entropy(x)[0])
            assert (h + lam * (k - slots[0]) < tau) == (j < f), (slots, j, h)
            if j == f:
                stop_free = h < tau
        self.penalty_decided += bool(stop_free)  # without the penalty this mask would have been filled


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("params, in_order", [
    (GREEDY, False),
    # a repetition penalty reads the tokens before a slot: the window fills in order
    (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3), True),
])
def test_every_fill_follows_the_distance_adjusted_entropy_rule(tiny, monkeypatch, params, in_order):
    spy = Spy(monkeypatch)
    eng = tiny.engine(window_size=8, entropy_threshold=TAU, position_penalty=LAMBDA)
    _, reasons, _ = run(eng, PROMPTS, params)
    assert not spy.mismatches, spy.mismatches[:3]
    assert reasons == ["length"] * len(PROMPTS) and spy.calls > 20
    assert spy.penalty_decided > 0, "λ never changed a decision: the test would not see a wrong penalty"
    if not in_order:
        assert spy.gaps > 0, "no window had a gap: index and rank of the masks always agreed"
