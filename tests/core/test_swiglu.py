"""The integer modes' SwiGLU activation (layers/swiglu.py, kernels/chain.c ratchet_silu_mul): silu(gate) *
up within a few ulp of torch's, and the same bits for a row whatever rows share the call and whether
the build vectorises it (the decode chain and the layer path both call it: tests/core/test_decode_chain.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ratchetlm import kernels
from ratchetlm.layers.swiglu import silu_mul


def _gate_up(rows: int, ffn: int, seed: int = 0) -> torch.Tensor:  # [rows, 2 * ffn]
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * ffn, generator=g) * 4
    gu[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 300.0, -300.0])  # zeros, tiny, exp's clamps
    return gu


def _silu_mul_lib(lib, gu: torch.Tensor) -> torch.Tensor:
    out = torch.empty(gu.shape[0], gu.shape[1] // 2)
    lib.ratchet_silu_mul(gu.data_ptr(), gu.shape[0], gu.shape[1] // 2, out.data_ptr(), 2)
    return out


def test_silu_mul_is_torchs_silu_times_up_within_rounding():
    gu = _gate_up(16, 4096)
    gate, up = gu.chunk(2, dim=-1)
    ref = (F.silu(gate.double()) * up.double())
    got = silu_mul(gu).double()
    # exp within ~1 ulp, then 1 + e, a division and a product: relative error under 3.5 * 2^-24 (torch's own
    # float SiLU reaches 3.0 on these values); near 0 (below exp's clamp) an absolute 1e-35
    err = (got - ref).abs() - 3.5 * 2.0**-24 * ref.abs()
    assert (err <= 1e-35).all(), float(err.max())
    torch.testing.assert_close(silu_mul(gu), F.silu(gate) * up, rtol=5e-7, atol=1e-35)
    assert torch.equal(silu_mul(gu)[0, :2], torch.zeros(2))
    assert silu_mul(gu)[0, 6] == 300.0 * up[0, 6] and silu_mul(gu)[0, 7].abs() < 1e-30


def test_silu_mul_of_a_row_never_depends_on_the_rows_beside_it():
    gu = _gate_up(64, 1536)  # 64 x 1536 >= 65536 elements: the threaded path
    every = silu_mul(gu)
    for r in (0, 17, 63):
        alone = silu_mul(gu[r : r + 1].clone())
        assert np.array_equal(alone.numpy().view(np.uint32), every[r : r + 1].numpy().view(np.uint32)), r


def test_silu_mul_bits_are_the_same_in_the_portable_build():
    native, portable = kernels.load(), kernels.compile_library([])
    if native is None or portable is None:
        pytest.skip("no C compiler")
    gu = _gate_up(3, 4099, seed=1)  # a row length with a scalar tail after the vectors
    a, b = _silu_mul_lib(native, gu), _silu_mul_lib(portable, gu)
    assert np.array_equal(a.numpy().view(np.uint32), b.numpy().view(np.uint32))


def test_integer_mode_layers_take_the_kernel_and_exact_mode_keeps_torch(llm_fp32):
    model = llm_fp32.engine.model
    assert not any(ly.kernel_silu for ly in model.layers)  # exact: torch's SiLU (HF-identical)
    try:
        model.set_numerics("int16")
        assert all(ly.kernel_silu for ly in model.layers)
    finally:
        model.set_numerics("exact")
    assert not any(ly.kernel_silu for ly in model.layers)
