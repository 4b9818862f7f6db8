"""The successor table's top-k (kernels/argmax.c's one-pass selection, recycling.top_k_rows) against an
independent reference: a stable descending sort (ties: the lower index first), on random logits,
logits with many ties, -inf, and chosen rows; rows holding a NaN take torch's order."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import kernels
from ratchetlm.decoding.speculative.recycling import top_k_indices, top_k_rows

needs_kernels = pytest.mark.skipif(kernels.load() is None, reason="C kernels unavailable")


def reference(x: torch.Tensor, k: int) -> torch.Tensor:  # [R, V] -> [R, k]
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def cases() -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(60):
        v = int(torch.randint(1, 3000, (), generator=g))
        k = int(torch.randint(1, min(v, 64) + 1, (), generator=g))
        r = int(torch.randint(1, 6, (), generator=g))
        if i % 3 == 0:  # few distinct values: ties everywhere, also across a vector's lanes
            x = torch.randint(-4, 4, (r, v), generator=g).float()
        elif i % 3 == 1:
            x = torch.randn(r, v, generator=g)
        else:  # ascending rows: every entry beats the k-th best so far (the most insertions)
            x = torch.arange(v, dtype=torch.float32).repeat(r, 1) + torch.rand(r, v, generator=g)
        if i % 5 == 0:
            x[:, ::7] = float("-inf")
        out.append((x, k))
    out.append((torch.full((2, 40), float("-inf")), 8))  # only -inf: the first k indices
    out.append((torch.zeros(3, 49152), 8))  # all tied: 0..k-1
    big = torch.randn(4, 49152, generator=g)
    big[1, -1] = big[2, 16] = 99.0  # the best in the tail past the last whole vector, and in the second
    out.append((big, 8))
    return out


@needs_kernels
@pytest.mark.parametrize("i", range(len(cases())))
def test_top_k_rows_equals_a_stable_sort(i):
    x, k = cases()[i]
    assert torch.equal(top_k_rows(x, k), reference(x, k))


@needs_kernels
def test_top_k_rows_of_chosen_rows_and_strided_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 1000, generator=g)
    rows = torch.tensor([4, 0, 4])
    assert torch.equal(top_k_rows(x, 8, rows), reference(x[rows], 8))
    wide = torch.randn(3, 1200, generator=g)[:, :1000]  # rows evenly strided, not contiguous
    assert torch.equal(top_k_rows(wide, 5), reference(wide, 5))


def test_top_k_rows_falls_back_to_torch_order():
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(2))
    x[1, 17] = float("nan")  # torch ranks NaN highest
    assert torch.equal(top_k_rows(x, 4)[1], top_k_indices(x, 4)[1])
    assert top_k_rows(x, 4)[1, 0] == 17
    assert torch.equal(top_k_rows(x, 100), top_k_indices(x, 100))  # past the kernel's largest k
    assert torch.equal(top_k_rows(x.double(), 4), top_k_indices(x.double(), 4))


@needs_kernels
def test_the_table_hands_back_each_rows_argmax():
    """SuccessorTable.observe's returned top-1 per row (what the greedy tree verify reads in place of
    reducing the rows again) is layers.sampler.argmax's index on every case above, +inf included
    (ties: the lower index); a row holding a NaN hands back nothing (argmax's NaN rule is its own)."""
    from ratchetlm.decoding.speculative.recycling import SuccessorTable
    from ratchetlm.layers.sampler import argmax

    for x, k in cases() + [(torch.tensor([[1.0, float("inf"), 3.0, float("inf")]]), 2)]:
        table = SuccessorTable(min(k, x.shape[1]))
        got = table.observe(list(range(x.shape[0])), x)
        assert got == argmax(x).tolist()
        assert [table.successors(t)[0] for t in range(x.shape[0])] == got
    table = SuccessorTable(4)
    x = torch.randn(3, 50)
    x[1, 7] = float("nan")
    assert table.observe([5, 6, 5], x) is None
    assert table.successors(5) == top_k_rows(x, 4)[2].tolist()  # a token's last row is the one kept
