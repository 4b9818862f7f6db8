"""Prompt lookup (proposers.ngram_candidates) finds what a window-by-window search finds, in its order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchetlm.decoding.speculative.proposers import ngram_candidates


def reference(tokens: list[int], min_n: int, max_n: int, m: int, c: int) -> list[tuple[int, list[int]]]:
    """The definition: for n from the longest down, every window of the sequence (but its last
    token) equal to the n-token suffix, the most recent first; the distinct continuations."""
    arr = np.asarray(tokens, dtype=np.int64)
    t = arr.shape[0]
    out: list[tuple[int, list[int]]] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(min(max_n, t - 1), min_n - 1, -1):
        win = np.lib.stride_tricks.sliding_window_view(arr[: t - 1], n)  # [t - n, n]
        for s in np.flatnonzero((win == arr[t - n:]).all(axis=1))[::-1]:
            cont = arr[s + n : s + n + c].tolist()
            if tuple(cont) not in seen:
                seen.add(tuple(cont))
                out.append((n, cont))
                if len(out) == m:
                    return out
    return out


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), min_n=st.integers(1, 3),
       extra=st.integers(0, 3), m=st.integers(1, 4), c=st.integers(1, 6))
def test_lookup_equals_the_window_search(tokens, min_n, extra, m, c):
    assert ngram_candidates(tokens, min_n, min_n + extra, m, c) == reference(tokens, min_n, min_n + extra, m, c)


def test_longest_match_first_then_most_recent():
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 5, 2, 3]
    # suffix (2, 3): occurrences at 5-6 (-> 8) and 1-2 (-> 9); suffix (3,): the same ends
    assert ngram_candidates(tokens, 1, 4, 3, 2) == [(2, [8, 5]), (2, [9, 7])]
    assert ngram_candidates([4, 1, 2, 3, 6, 1, 2, 3], 1, 4, 1, 3) == [(3, [6, 1, 2])]
    assert ngram_candidates([5], 1, 4, 2, 3) == []
