"""The integer modes' SwiGLU activation (layers/swiglu.py, kernels/chain.c ratchet_silu_mul): silu(gate) *
up within a few ulp of torch's, and the same bits for a row whatever rows share the call and whether
the build vectorises it (the decode chain and the layer path both call it: tests/core/test_decode_chain.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ratchetlm import kernels
from ratchetlm.layers.block_quant import BlockWeight
from ratchetlm.layers.swiglu import silu_mul

from ..conftest import KERNEL_VARIANTS
from .test_block_kernels import random_raw


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


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
def test_fused_down_projections_activation_has_silu_muls_bits(variant, kernel_builds):
    """The activation the fused down projection quantizes (16 elements a vector on AVX-512, then a scalar
    tail) is ratchet_silu_mul's, bit for bit, in every build."""
    lib = kernel_builds[variant]
    if lib is None:
        pytest.skip("no C compiler")
    gu = _gate_up(5, 4099, seed=3)  # a row length with a scalar tail after the vectors
    gu[1, :4099] = torch.linspace(-120.0, 120.0, 4099)  # both of exp's clamps and everything between
    act = torch.empty(5, 4099)
    lib.ratchet_swiglu_act.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.ratchet_swiglu_act(gu.data_ptr(), 5, 4099, act.data_ptr())
    assert np.array_equal(act.numpy().view(np.uint32), _silu_mul_lib(lib, gu).numpy().view(np.uint32))


@pytest.mark.parametrize("variant", list(KERNEL_VARIANTS))
@pytest.mark.parametrize("bits", [8, 16])
def test_fused_down_projection_is_silu_mul_then_the_matmul_bit_for_bit(variant, bits, kernel_builds):
    """ratchet_mm_q8w_swiglu (the decode chain's MLP: silu(g) * u made as the down projection quantizes its
    input, 16 elements a vector on AVX-512) gives the bits of ratchet_silu_mul then ratchet_mm_q8w, in every
    build, for any number of rows."""
    lib = kernel_builds[variant]
    if lib is None:
        pytest.skip("no C compiler")
    lib.ratchet_mm_q8w_swiglu.argtypes = lib.ratchet_mm_q8w.argtypes
    ffn, n = 1536, 40
    w = BlockWeight.from_gguf("Q4_1", random_raw("Q4_1", n, ffn, seed=4), ffn)
    _, handle, _ = w.q8_call(lib, bits)
    gu = _gate_up(11, ffn, seed=2)
    gu[1, :ffn] = torch.linspace(-120.0, 120.0, ffn)  # both of exp's clamps and everything between
    act = _silu_mul_lib(lib, gu)
    for rows in (1, 3, 11):
        fused, ref = torch.empty(rows, n), torch.empty(rows, n)
        lib.ratchet_mm_q8w_swiglu(gu.data_ptr(), rows, handle, fused.data_ptr(), 1)
        lib.ratchet_mm_q8w(act.data_ptr(), rows, handle, ref.data_ptr(), 1)
        assert np.array_equal(fused.numpy().view(np.uint32), ref.numpy().view(np.uint32)), rows
