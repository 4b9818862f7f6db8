"""benchmarks/bench_numerics.py's simulated formats: each ``sim:`` rule rounds a block matmul's
operands as its format would (the docs' table of AMX-friendly formats rests on these)."""

from __future__ import annotations

import pytest
import torch

from ratchetlm.layers import block_quant
from ratchetlm.layers.block_quant import BlockWeight

from .bench_script import load_benchmark


def _weight(n: int = 8, k: int = 64) -> tuple[BlockWeight, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    w[:, :32] *= 0.01  # one block of each row far smaller than the other: what a per-row scale loses
    bw = BlockWeight.quantize_q8_0(w)
    return bw, bw.dequantize()


def _x(m: int = 3, k: int = 64) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    x[:, 5] = 40.0  # an outlier: a row-wide scale coarsens every other element
    return x


def _grid(t: float, step: float) -> float:  # round half to even, as torch.round
    return float(torch.round(torch.tensor(t / step))) * step


def _product(rule: str, x: torch.Tensor, bw: BlockWeight) -> torch.Tensor:
    undo = load_benchmark("bench_numerics").simulate(rule)
    try:
        return block_quant.block_matmul(x, bw)
    finally:
        undo()


def test_int8_row_rounds_each_activation_row_on_one_scale() -> None:
    bw, w = _weight()
    x = _x()
    ref = torch.empty_like(x)
    for r in range(x.shape[0]):  # element by element: step = the row's max |x| / 127
        step = float(x[r].abs().max()) / 127.0
        for c in range(x.shape[1]):
            ref[r, c] = _grid(float(x[r, c]), step)
    got = _product("int8-row", x, bw)
    torch.testing.assert_close(got, ref @ w.t(), rtol=1e-5, atol=1e-4)
    # and it is not the int8 mode's blocks of 32, whose second block holds no outlier
    assert not torch.allclose(got, _product("int8", x, bw), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rule", ["w8row", "a16row", "w8row+a16row"])
def test_row_scaled_weights_and_int16_rows(rule: str) -> None:
    bw, w = _weight()
    x = _x()
    wref = torch.empty_like(w)
    for r in range(w.shape[0]):
        step = float(w[r].abs().max()) / 127.0
        for c in range(w.shape[1]):
            wref[r, c] = _grid(float(w[r, c]), step) if rule.startswith("w8row") else float(w[r, c])
    xref = torch.empty_like(x)
    for r in range(x.shape[0]):
        step = float(x[r].abs().max()) / 32767.0
        for c in range(x.shape[1]):
            xref[r, c] = _grid(float(x[r, c]), step) if rule.endswith("a16row") else float(x[r, c])
    got = _product(rule, x, bw)
    torch.testing.assert_close(got, xref @ wref.t(), rtol=1e-5, atol=1e-4)
    if rule.startswith("w8row"):  # the small block's weights collapse onto a few steps of the row's scale
        assert (wref[:, :32] != w[:, :32]).any()


def test_an_unknown_row_rule_is_refused() -> None:
    with pytest.raises(AssertionError):
        load_benchmark("bench_numerics").simulate("w8col")
