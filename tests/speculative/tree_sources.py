"""Stand-in tree sources for the tree-selection tests (test_tree_proposers.py, test_tree_price.py)."""

from __future__ import annotations

from ratchetlm.decoding.speculative.tree_select import Calibration


class FixedSource:
    """Children from a dict token -> [child tokens] (rank keys), every child expandable."""

    def __init__(self, kids: dict[int, list[int]]) -> None:
        self.kids = kids

    def expand(self, state, token):
        return [(t, ("fixed", r), True) for r, t in enumerate(self.kids.get(token, []))]


def calibrated(rates: list[float]) -> Calibration:
    c = Calibration()
    for r, p in enumerate(rates):  # 1000 judged tries per rank: the prior no longer matters
        for i in range(1000):
            c.add(("fixed", r), i < p * 1000)
    return c
