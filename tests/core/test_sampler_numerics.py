"""The sampler is numerically safe for every valid parameter value (issue 12, defect 1a).

``filtered_probs`` is the target distribution of plain sampling and of speculative rejection
sampling alike, so these properties hold for both.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ratchetlm import SamplingParams
from ratchetlm.layers.sampler import filtered_probs, sample

EXTREMES = [
    dict(temperature=1e-38),
    dict(temperature=5e-324),  # below fp32's range: rounds to 0 in an fp32 division
    dict(top_p=1e-46),  # below fp32's range: the mass comparison would drop every token
    dict(temperature=1e-38, top_p=1e-46, top_k=1, min_p=1.0),
    dict(temperature=1e308),
    dict(temperature=1e-6, top_k=3, top_p=0.5, min_p=0.9),
]


def _valid_dist(p: torch.Tensor, logits: torch.Tensor, temperature: float = 1.0) -> None:
    assert torch.isfinite(p).all() and (p >= 0).all()
    assert torch.allclose(p.sum(-1), torch.ones(p.shape[0]), atol=1e-5)
    # the most likely token(s) at this temperature (ties: any of them may be the one kept)
    base = filtered_probs(logits, SamplingParams(temperature=temperature))
    top = base == base.max(-1, keepdim=True).values
    assert ((p * top).sum(-1) > 0).all(), "a top token always keeps mass"


@pytest.mark.parametrize("kw", EXTREMES, ids=[str(k) for k in EXTREMES])
def test_extreme_parameters_give_a_distribution(kw):
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 12
    _valid_dist(filtered_probs(logits, SamplingParams(**kw)), logits, kw.get("temperature", 1.0))


@pytest.mark.parametrize("temperature", [1e-38, 5e-324, 1e-12])
def test_tiny_temperature_is_the_greedy_limit(temperature):
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(1)) * 3
    p = filtered_probs(logits, SamplingParams(temperature=temperature))
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 500).float())
    for seed in range(5):
        got = sample(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(seed))
        assert torch.equal(got, logits.argmax(-1))


def test_tiny_temperature_splits_ties_evenly():
    logits = torch.tensor([[2.0, 5.0, 5.0, -1.0]])
    p = filtered_probs(logits, SamplingParams(temperature=1e-30))
    assert torch.equal(p, torch.tensor([[0.0, 0.5, 0.5, 0.0]]))


@pytest.mark.parametrize("top_p", [1e-46, 1e-9, 0.01])
def test_top_p_below_the_largest_probability_keeps_only_the_top_token(top_p):
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    assert torch.equal(filtered_probs(logits, SamplingParams(top_p=top_p)), torch.tensor([[0.0, 1.0, 0.0]]))


def test_logits_at_the_edges_of_fp32():
    big = torch.finfo(torch.float32).max
    logits = torch.tensor([[big, -big, 0.0, big / 2], [-big, -big, -big + 1e32, -big]])
    for kw in EXTREMES + [dict()]:
        _valid_dist(filtered_probs(logits, SamplingParams(**kw)), logits, kw.get("temperature", 1.0))


finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(finite32, min_size=2, max_size=40),
    temperature=st.one_of(st.floats(min_value=5e-324, max_value=1e308), st.sampled_from([1e-45, 1e-38, 1.0])),
    top_p=st.one_of(st.floats(min_value=5e-324, max_value=1.0), st.just(1.0)),
    top_k=st.integers(min_value=-1, max_value=50),
    min_p=st.floats(min_value=0.0, max_value=1.0),
)
def test_no_nan_from_any_finite_logits(values, temperature, top_p, top_k, min_p):
    logits = torch.tensor([values], dtype=torch.float32)
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    probs = filtered_probs(logits, p)
    _valid_dist(probs, logits, temperature)
    sample(logits, p, torch.Generator().manual_seed(0))  # multinomial accepts it


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_parameters_are_refused(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


def _argmax_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    vocab = torch.randn(5, 49152, generator=g)
    ties = torch.zeros(3, 37)
    ties[0, [4, 9, 30]] = 2.0  # ties: the first wins
    ties[1, [0, 36]] = float("inf")
    ties[2] = -float("inf")  # all -inf: index 0
    zeros = torch.tensor([[-0.0, 0.0, -0.0], [-1.0, -0.0, 0.0]])  # -0.0 == 0.0: the first of them
    nan = torch.randn(4, 100, generator=g)
    nan[0, 7] = nan[0, 50] = float("nan")  # the first NaN
    nan[1, 99] = float("nan")  # in the scalar tail
    nan[2, 3] = float("nan")
    nan[2, 10] = float("inf")
    odd = [torch.randn(2, n, generator=g) for n in (1, 15, 16, 17, 33)]
    strided = torch.randn(6, 64, generator=g)[::2, :40]  # rows evenly strided, not contiguous
    return [vocab, ties, zeros, nan, strided, torch.randn(2, 3, 71, generator=g), *odd]


@pytest.mark.parametrize("arch", [None, []], ids=["native", "portable"])
def test_argmax_kernel_equals_torch(arch):
    """kernels/argmax.c gives torch.argmax's indices: first of the maximum, the first NaN, any shape."""
    from ratchetlm import kernels
    from ratchetlm.layers import sampler

    lib = kernels.load() if arch is None else kernels.compile_library(arch)
    if lib is None:
        pytest.skip("no C compiler")
    for x in _argmax_cases():
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], dtype=torch.long)
        lib.ratchet_argmax_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr())
        assert torch.equal(out, rows.argmax(dim=-1)), x.shape
        if arch is None:
            assert torch.equal(sampler.argmax(x), x.argmax(dim=-1)), x.shape
    # greedy sampling goes through it
    x = _argmax_cases()[0]
    assert torch.equal(sample(x, SamplingParams(temperature=0), None), x.argmax(dim=-1))
