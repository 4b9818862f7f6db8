"""The int8 numerics mode's kernels: activations are quantized exactly like a simple torch reference
(llama.cpp's Q8_0 activation blocks), every integer-valued format multiplies like the reference
``sum_b dx_b * (xq_b . w_b)`` on gguf-py's dequantized weights, in every instruction-set build, and a
row's result is bit-identical alone or among any number of rows."""

from __future__ import annotations

import ctypes
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ratchetlm import kernels
from ratchetlm.layers.block_quant import SUPPORTED_TYPES, BlockWeight, Linear, block_matmul, set_numerics

from ..conftest import KERNEL_VARIANTS
from .test_block_kernels import gguf_py, random_raw, same_bits

INT_TYPES = tuple(t for t in SUPPORTED_TYPES if t not in ("F32", "F16", "BF16"))
VARIANTS = KERNEL_VARIANTS  # the builds compared (tests/conftest.py builds them once, in parallel)


@pytest.fixture(scope="module", params=list(VARIANTS))
def lib(request, kernel_builds):
    built = kernel_builds[request.param]
    if built is None:
        pytest.skip("no C compiler")
    return built


BITS = {"int8": 8, "int16": 16}


def quantize_ref(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference activation blocks: x [M, K] -> xq [M, K] int (in [-A, A], A = 127 or 32639), dx [M, K/32]."""
    m, k = x.shape
    a = 127.0 if bits == 8 else 32639.0
    xb = x.reshape(m, k // 32, 32)
    dx = xb.abs().amax(dim=-1) / a  # fp32, like the kernel
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    xq = torch.round(xb * inv[..., None]).clamp(-a, a)
    return xq.reshape(m, k), dx


def int8_ref(x: torch.Tensor, w: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """y [M, N] = sum over blocks b of dx_b * (xq_b . w_b), in fp64 (w: dequantized weights [N, K])."""
    xq, dx = quantize_ref(x, bits)
    deq = (xq.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape)
    return F.linear(deq, w.double())


def c_quantize(lib, x: torch.Tensor, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    m, k = x.shape
    xh, xl = np.empty((m, k), np.int8), np.zeros((m, k), np.int8)
    d32 = np.empty((m, k // 32), np.float32)
    sum16 = np.empty((m, k // 16), np.int32)
    lib.ratchet_quantize_q8(x.data_ptr(), m, k, bits, xh.ctypes.data, xl.ctypes.data, d32.ctypes.data,
                            sum16.ctypes.data)
    return xh, xl, d32, sum16


@pytest.mark.parametrize("k", [320, 1056])  # 10 blocks; 33: two runs of the AVX-512 build's 16-block path and one more
@pytest.mark.parametrize("bits", [8, 16])
def test_activation_blocks_match_the_reference_bit_for_bit(lib, bits, k):
    torch.manual_seed(0)
    x = torch.randn(5, k) * torch.logspace(-3, 2, k)  # varied scales; one all-zero block below
    x[2, 64:96] = 0.0
    x[3, 5] = 1e4  # an outlier: its block's other values round to 0
    x[4, 256:288] = torch.linspace(-1, 1, 32)  # the block's extremes: +-A exactly
    xh, xl, d32, sum16 = c_quantize(lib, x, bits)
    xq, dx = quantize_ref(x, bits)
    xq_c = xh.astype(np.int64)
    if bits == 16:  # xq = 256 * hi + lo, both signed bytes
        xq_c = xq_c * 256 + xl
    assert np.array_equal(xq_c, xq.long().numpy())
    assert same_bits(d32, dx)
    assert np.array_equal(sum16, xq.reshape(5, -1, 16).sum(-1).long().numpy())


@pytest.mark.parametrize("type_name", INT_TYPES)
def test_integer_form_rebuilds_gguf_py_weights(lib, type_name):
    """to_q8w's (q, d, dm, c, c_m) are the format's own numbers: d * c * q + dm * c_m is gguf-py's
    weight (to fp32 rounding), with d and dm fp16 values (the packed layout stores them as fp16)."""
    t = SUPPORTED_TYPES.index(type_name)
    assert lib.ratchet_type_has_q8(t)
    k = 512
    raw = random_raw(type_name, 3, k, seed=1)
    blck = {"Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}.get(type_name, 32)
    q = np.zeros((3, k), np.int8)
    d, dm = np.zeros((3, k // blck), np.float32), np.zeros((3, k // blck), np.float32)
    c16, cm16 = np.zeros((3, k // 16), np.int8), np.zeros((3, k // 16), np.int8)
    for r in range(3):
        lib.ratchet_to_q8w(t, raw[r].ctypes.data, q[r].ctypes.data, d[r].ctypes.data, dm[r].ctypes.data,
                           c16[r].ctypes.data, cm16[r].ctypes.data, k // blck)
    for f in (d, dm):
        assert np.array_equal(f.astype(np.float16).astype(np.float32), f)
    s = np.repeat(d, blck, axis=1) * np.repeat(c16, 16, axis=1).astype(np.float32)  # fp32, as the kernel
    m = np.repeat(dm, blck, axis=1) * np.repeat(cm16, 16, axis=1).astype(np.float32)
    rebuilt = s.astype(np.float64) * q + m
    ref = gguf_py(type_name, raw).reshape(3, k)
    np.testing.assert_allclose(rebuilt, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def assert_int8_close(got: torch.Tensor, x: torch.Tensor, w: BlockWeight, bits: int = 8) -> None:
    """Within fp32 rounding of the fp64 integer reference: a tiny fraction of sum |dx xq w|."""
    dense = w.dequantize()
    ref = int8_ref(x, dense, bits)
    xq, dx = quantize_ref(x, bits)
    mag = F.linear((xq.double().reshape(x.shape[0], -1, 32) * dx.double()[..., None]).reshape(x.shape).abs(),
                   dense.double().abs())
    err = (got.double() - ref).abs()
    assert (err <= 2e-5 * mag + 1e-30).all(), float((err / mag).max())


@pytest.mark.parametrize("mode", list(BITS))
@pytest.mark.parametrize("type_name", INT_TYPES)
def test_matmul_matches_the_integer_reference_and_is_batch_invariant(lib, type_name, mode):
    k = 96 if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") else 512  # 96: not a multiple of 64
    n = 37  # two full panels of 16 output rows and a partial one
    w = BlockWeight.from_gguf(type_name, random_raw(type_name, n, k, seed=2), k)
    torch.manual_seed(3)
    x = torch.randn(33, k)
    x[4] *= 100.0
    full = block_matmul(x, w, lib=lib, numerics=mode)
    assert_int8_close(full, x, w, BITS[mode])
    for rows in range(1, 34):  # row 0 alone, then among 1..33 rows: bitwise the same
        part = block_matmul(x[:rows], w, lib=lib, numerics=mode)
        assert same_bits(part, full[:rows]), rows
    for i in (0, 7, 32):  # and any row alone equals itself in the batch
        assert same_bits(block_matmul(x[i:i + 1], w, lib=lib, numerics=mode), full[i:i + 1])
    for threads in (1, 2):
        assert same_bits(block_matmul(x, w, lib=lib, numerics=mode, threads=threads), full)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q3_K"])
def test_tiles_of_nine_to_sixteen_rows_keep_every_rows_bits(type_name, kernel_builds):
    """The AVX-512 build joins the rest of a call's rows past its last full tile of 8 to that tile, one tile of
    9-15 tokens streamed through a group's weights (panel_stream), where (8 + rest) x K <= 12 x 1536: every rest at
    K = 512 (17 rows: 8 + 9), rests of 1-4 at K = 1536 (13 rows: 8 + 5 in registers): every row keeps the bits it
    has alone, at every row count around those switches, and the portable build's (tiles of 8 at every size)."""
    native, portable = kernel_builds["native"], kernel_builds["portable"]
    assert native is not None and portable is not None
    torch.manual_seed(21)
    for k in (512, 1536):
        w = BlockWeight.from_gguf(type_name, random_raw(type_name, 37, k, seed=22), k)
        x = torch.randn(34, k)
        x[10] *= 60.0
        for mode in BITS:
            alone = torch.cat([block_matmul(x[i:i + 1], w, lib=native, numerics=mode) for i in range(34)])
            for rows in range(2, 35):
                assert same_bits(block_matmul(x[:rows], w, lib=native, numerics=mode), alone[:rows]), (k, mode, rows)
            assert same_bits(block_matmul(x[:17], w, lib=native, numerics=mode, threads=2), alone[:17]), (k, mode)
            assert same_bits(block_matmul(x, w, lib=portable, numerics=mode), alone), (k, mode)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_prefill_sized_calls_of_five_and_six_bit_weights_keep_every_rows_bits(lib, type_name):
    """A call of 4+ tiles of 8 rows unpacks 5- and 6-bit panels to bytes once per block of panels (about
    512 KB of bytes: 4 panels at K = 8192) and runs every tile through the block: the same integer sums
    and float steps as the packed kernels, so each row keeps the bits it has alone, in a short call and
    at any thread count (here 6 panels, the last one partial: a block of 4 and one of 2 on one thread)."""
    k, n = 8192, 85
    w = BlockWeight.from_gguf(type_name, random_raw(type_name, n, k, seed=7), k)
    torch.manual_seed(8)
    x = torch.randn(35, k)  # 5 tiles, the last one of 3 rows
    x[9] *= 50.0
    for mode in BITS:
        full = block_matmul(x, w, lib=lib, numerics=mode, threads=1)
        assert_int8_close(full, x, w, BITS[mode])
        assert same_bits(block_matmul(x[:8], w, lib=lib, numerics=mode), full[:8])  # one tile: the packed kernels
        for i in (0, 9, 34):
            assert same_bits(block_matmul(x[i:i + 1], w, lib=lib, numerics=mode), full[i:i + 1])
        assert same_bits(block_matmul(x, w, lib=lib, numerics=mode, threads=2), full)


@pytest.mark.parametrize("variant", ["avx2", "portable"])
@pytest.mark.parametrize("type_name", INT_TYPES)
def test_avx2_and_portable_builds_give_the_avx512_builds_bits(type_name, variant, kernel_builds):
    """The AVX2 kernel (vpmaddubsw + vpmaddwd, bytes split into nibbles; a paired panel's multipliers
    in the vpmaddwd) and the portable C form the same exact int32 sums and the same float steps per lane
    as the VNNI one: a model gives the same tokens on an AVX2 CPU or without vector code as on an
    AVX-512 one."""
    # asked here, not in a skipif: a skipif is evaluated at collection, where it would build the kernels
    if kernels.int8_isa() != "avx512vnni":
        pytest.skip("compares with the AVX512-VNNI build")
    other, native = kernel_builds[variant], kernel_builds["native"]
    assert other is not None and native is not None
    assert other.ratchet_int8_isa() == (b"avx2" if variant == "avx2" else b"scalar")
    k = 96 if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") else 512
    w = BlockWeight.from_gguf(type_name, random_raw(type_name, 37, k, seed=5), k)
    torch.manual_seed(6)
    x = torch.randn(35, k)  # 11 rows: the packed kernels; 35 (5 tiles): 5- and 6-bit panels unpacked first
    x[2] *= 300.0
    for mode in BITS:
        for rows in (1, 11, 35):
            assert same_bits(block_matmul(x[:rows], w, lib=other, numerics=mode),
                             block_matmul(x[:rows], w, lib=native, numerics=mode)), (mode, rows)


def fma32(a: float, b: float, c: float) -> np.float32:
    """fmaf: a * b + c rounded once to the nearest fp32 (ties to even), from the exact rational value."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))  # within one fp32 step of the answer (two roundings)
    best = min((np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))),
               key=lambda f: (abs(Fraction(float(f)) - exact), int(np.array(f).view(np.uint32)) & 1))
    return np.float32(best)


def paired_ref(x: torch.Tensor, raw: np.ndarray, type_name: str, k: int) -> np.ndarray:
    """The int8 mode's result for 16-weight groups without offsets (Q6_K, Q3_K), bit for bit: per row and
    32-activation block b, J = c[2b] * (q . xq)[2b] + c[2b + 1] * (q . xq)[2b + 1] in integers, one float
    step as = fma(float(J), dx[b], as), and per 256 weights (one d) acc = fma(as, d, acc)."""
    lib = kernels.load()
    t = SUPPORTED_TYPES.index(type_name)
    n = raw.shape[0]
    q, c16 = np.zeros((n, k), np.int8), np.zeros((n, k // 16), np.int8)
    d, dm, cm16 = np.zeros((n, k // 256), np.float32), np.zeros((n, k // 256), np.float32), np.zeros_like(c16)
    for r in range(n):
        lib.ratchet_to_q8w(t, raw[r].ctypes.data, q[r].ctypes.data, d[r].ctypes.data, dm[r].ctypes.data,
                           c16[r].ctypes.data, cm16[r].ctypes.data, k // 256)
    assert not dm.any()
    xq, dx = quantize_ref(x)
    xq16 = xq.long().numpy().reshape(x.shape[0], k // 16, 16)
    sums = np.einsum("ngi,tgi->tng", q.astype(np.int64).reshape(n, k // 16, 16), xq16)  # [t, n, group]
    j = (sums * c16.astype(np.int64)).reshape(x.shape[0], n, k // 32, 2).sum(-1)  # [t, n, block]
    out = np.zeros((x.shape[0], n), np.float32)
    for ti in range(x.shape[0]):
        for r in range(n):
            acc = np.float32(0)
            for s in range(k // 256):
                acc_s = np.float32(0)
                for b in range(8 * s, 8 * s + 8):
                    acc_s = fma32(np.float32(j[ti, r, b]), dx[ti, b].item(), acc_s)
                acc = fma32(acc_s, d[r, s], acc)
            out[ti, r] = acc
    return out


@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K"])
def test_paired_sub_scales_apply_in_integers_with_one_float_step_per_block(lib, type_name):
    """Q6_K's and Q3_K's int8 sub-scales (one per 16 weights, beside activations quantized per 32) are
    applied in integers, so each 32-activation block takes one convert-and-fma: the exact bits of the
    scalar reference above in every build, for a decode-sized call, a few-token tile and a prefill-sized
    call (4+ tiles: 6-bit panels unpacked first), both panels of 16 rows and a partial one."""
    k, n = 512, 20
    raw = random_raw(type_name, n, k, seed=12)
    w = BlockWeight.from_gguf(type_name, raw, k)
    torch.manual_seed(13)
    x = torch.randn(33, k)
    x[5] *= 40.0
    rows = [0, 5, 32]
    ref = paired_ref(x[rows], raw, type_name, k)
    for m in (1, 3, 33):  # one token, a tile of 3, 5 tiles (the unpacked path for Q6_K)
        got = block_matmul(x[:m], w, lib=lib, numerics="int8")
        picked = [i for i, r in enumerate(rows) if r < m]
        assert same_bits(got[[rows[i] for i in picked]], ref[picked]), m


@pytest.mark.parametrize("zero_point", [0, 16, 32])
def test_unpacked_q6_k_panels_give_the_paired_bits_at_every_zero_point(lib, zero_point):
    """A prefill-sized call unpacks Q6_K panels once per block of panels; the AVX2 kernel then holds the values
    as u - 32 and takes the activations as xq + 128, the zero point a constant per row and block made at
    unpacking, plus a term of each token's sums where the weight's zero point is not 32 (values all >= -16:
    z = 16; all >= 0: z = 0). Every build gives the scalar reference's bits at each zero point, in the
    prefill-sized call and in one of a single token (the packed kernels)."""
    k, n = 512, 20
    raw = random_raw("Q6_K", n, k, seed=14)
    qh = raw.reshape(n, k // 256, 210)[..., 128:192]  # the high 2 bits of every value (bits 2j..2j+1 of a byte)
    qh |= {0: 0xAA, 16: 0x55, 32: 0x00}[zero_point]  # values >= 32 (q >= 0), >= 16 (q >= -16), or as drawn
    w = BlockWeight.from_gguf("Q6_K", raw, k)
    assert w.pack_q8(lib)[3] == zero_point
    torch.manual_seed(15)
    x = torch.randn(33, k)
    x[7] *= 60.0
    rows = [0, 7, 31, 32]
    ref = paired_ref(x[rows], raw, "Q6_K", k)
    assert same_bits(block_matmul(x, w, lib=lib, numerics="int8")[rows], ref)  # 5 tiles: the unpacked panels
    assert same_bits(block_matmul(x[7:8], w, lib=lib, numerics="int8"), ref[1:2])


# per format: (bits per stored value, G, zero point) that the packer must read off the values
LAYOUT = {"Q4_0": (4, 32, 8), "Q4_1": (4, 32, 0), "Q5_0": (5, 32, 16), "Q5_1": (5, 32, 0), "Q8_0": (8, 32, 128),
          "Q2_K": (4, 16, 0), "Q3_K": (4, 16, 4), "Q4_K": (4, 32, 0), "Q5_K": (5, 32, 0), "Q6_K": (6, 16, 32)}
SUPER = {"Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}  # the others: one d per 32 weights


@pytest.mark.parametrize("type_name", INT_TYPES)
def test_packing_reads_each_panels_layout_from_its_values(type_name):
    """4-bit values are kept two per byte (the weight bytes are half of N * K), 5- and 6-bit ones as
    nibbles plus a plane of their high bits (5/8 or 6/8 of N * K), bytes beyond; scales that change
    within 32 weights give groups of 16, negative values a power-of-two zero point, offsets their
    own factors; one fp16 D per row and super-group (the K-quants' 256 weights), an int8 multiplier
    per row and group; the integer form still rebuilds the weights (the matmul tests)."""
    k, n = 512, 40
    w = BlockWeight.from_gguf(type_name, random_raw(type_name, n, k, seed=7), k)
    panels, q, sm, zw = w.pack_q8(kernels.load())
    vb, g, z = LAYOUT[type_name]
    assert panels.shape == (3, 5)
    flags = panels[:, :3].view(np.int32)  # [vb, G, z, has_m, SB, unit] per panel
    sb = SUPER.get(type_name, 32)
    assert (flags[:, 0] == vb).all() and (flags[:, 1] == g).all() and zw == z
    assert (flags[:, 2] == z).all() and (flags[:, 4] == sb).all()
    assert (flags[:, 3] == (type_name in ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"))).all()
    assert q.nbytes == 3 * 16 * k * vb // 8
    # per row: 2 bytes of D per super-group, 1 byte of c per group; twice that with offsets
    # (the 32-weight formats' multipliers are all 1: not stored, "unit" panels)
    unit = type_name not in SUPER
    assert (flags[:, 5] == unit).all()
    assert sm.nbytes == 3 * 16 * (2 * (k // sb) + (0 if unit else k // g)) * (1 + int(flags[0, 3]))


def test_panels_of_one_weight_choose_their_own_layout(lib):
    """A fused weight of 4-bit rows (Q4_K) and 6-bit rows (Q6_K): the Q4_K panels stay nibbles with
    G = 32, the Q6_K panels 6 bits (nibbles and a 2-bit plane) with G = 16; the result still matches
    the reference and a row's bits do not depend on the rows beside it."""
    k = 256
    fused = BlockWeight.cat([BlockWeight.from_gguf("Q4_K", random_raw("Q4_K", 32, k, seed=8), k),
                             BlockWeight.from_gguf("Q6_K", random_raw("Q6_K", 20, k, seed=9), k)])
    panels = fused.pack_q8(lib)[0][:, :2].view(np.int32)
    assert panels[:, 0].tolist() == [4, 4, 6, 6] and panels[:, 1].tolist() == [32, 32, 16, 16]
    torch.manual_seed(4)
    x = torch.randn(11, k)
    for mode in BITS:
        full = block_matmul(x, fused, lib=lib, numerics=mode)
        assert_int8_close(full, x, fused, BITS[mode])
        assert same_bits(block_matmul(x[3:4], fused, lib=lib, numerics=mode), full[3:4])


def test_sixteen_bit_activations_are_near_exact():
    """int16: the error against the exact product is ~256x smaller than int8's."""
    k = 512
    w = BlockWeight.from_gguf("Q4_K", random_raw("Q4_K", 16, k, seed=6), k)
    x = torch.randn(8, k)
    exact = F.linear(x.double(), w.dequantize().double())
    err8 = (block_matmul(x, w, numerics="int8").double() - exact).abs().max()
    err16 = (block_matmul(x, w, numerics="int16").double() - exact).abs().max()
    assert err16 < err8 / 50


def test_parts_of_mixed_formats_and_row_maps(lib):
    k = 256
    q = BlockWeight.from_gguf("Q4_K", random_raw("Q4_K", 6, k, seed=4), k)
    v = BlockWeight.from_gguf("Q6_K", random_raw("Q6_K", 5, k, seed=5), k)
    fused = BlockWeight.cat([q.take_rows(np.array([5, 0, 3, 1, 2, 4])), v])
    x = torch.randn(9, k)
    assert_int8_close(block_matmul(x, fused, lib=lib, numerics="int8"), x, fused)


def test_float_formats_stay_exact_in_int8_mode():
    k = 64
    w = BlockWeight.from_gguf("F16", random_raw("F16", 4, k), k)
    assert not w.int8_capable
    x = torch.randn(3, k)
    assert same_bits(block_matmul(x, w, numerics="int8"), block_matmul(x, w, numerics="exact"))


def test_best_build_uses_vnni_where_the_cpu_has_it():
    flags = kernels.build._cpu_flags()
    want = "avx512vnni" if "avx512_vnni" in flags and "avx512bw" in flags else (
        "avx2" if all(f in flags.split() for f in ("avx2", "fma", "f16c")) else "scalar")
    assert kernels.int8_isa() == want
    assert ctypes.sizeof(kernels.Part) == 32


def test_fixed_order_attention_matches_sdpa_and_is_shape_invariant():
    """The int8 mode's attention: SDPA's values (to fp32 rounding), and a query row's bits depend only
    on its visible keys — not on how many queries share the call nor on masked padding keys."""
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch, paged_attention

    torch.manual_seed(0)
    h, hkv, d, n = 6, 2, 32, 11

    def attend(q, k, v, fixed, ctx_mask=None):
        t = q.shape[0]
        masks = [None] if ctx_mask is None else [ctx_mask]
        batch = build_attention_batch(torch.arange(t), [t], [torch.empty(0, dtype=torch.long)], masks, NullSink(), None)
        return paged_attention(0, q, k, v, batch, 0.125, fixed_order=fixed)

    q, k, v = torch.randn(n, h, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    full = attend(q, k, v, True)
    torch.testing.assert_close(full, attend(q, k, v, False), rtol=1e-5, atol=1e-6)
    for rows in (1, 4, 7):  # a causal prefix of the rows: bit for bit
        assert same_bits(attend(q[:rows], k[:rows], v[:rows], True), full[:rows])
    tree = torch.ones(n, n, dtype=torch.bool).tril()
    tree[5, 3:5] = False  # a tree mask: row 5 does not see keys 3, 4
    got = attend(q, k, v, True, tree)
    torch.testing.assert_close(got, attend(q, k, v, False, tree), rtol=1e-5, atol=1e-6)
    assert same_bits(got[:5], full[:5]) and not same_bits(got[5], full[5])


def test_fixed_order_attention_of_a_long_prefill_split_across_threads():
    """A prefill long enough that each head's query tiles are split into runs (each transposing the
    keys up to its own last row): SDPA's values, and every row bit for bit the row of a shorter
    prefill (the runs fall elsewhere there)."""
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch, paged_attention

    torch.manual_seed(3)
    h, hkv, d, n = 6, 2, 64, 160

    def attend(rows, fixed=True):
        batch = build_attention_batch(torch.arange(rows), [rows], [torch.empty(0, dtype=torch.long)], [None],
                                      NullSink(), None)
        return paged_attention(0, q[:rows], k[:rows], v[:rows], batch, 0.125, fixed_order=fixed)

    q, k, v = torch.randn(n, h, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    full = attend(n)  # (2 KV heads: with any thread count each head's 120 tiles are split into runs)
    torch.testing.assert_close(full, attend(n, fixed=False), rtol=1e-5, atol=1e-6)
    assert same_bits(attend(97), full[:97])


def test_fixed_order_attention_row_depends_only_on_its_visible_keys():
    """Bitwise: a query reading context keys from scattered cache slots (a decode / verify step)
    equals the same query at the end of a prefill of those keys, and a tree row that skips its
    siblings' keys equals a chain over its own ancestors only (the key sums must not depend on
    where the invisible keys sat)."""
    from ratchetlm.kv.cache import KVCache
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch, paged_attention

    torch.manual_seed(1)
    h, hkv, d, n = 6, 2, 64, 40
    q, k, v = torch.randn(n, h, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)

    def prefill(rows):  # rows: indices into q/k/v, attended causally as one sequence
        batch = build_attention_batch(torch.arange(len(rows)), [len(rows)], [torch.empty(0, dtype=torch.long)],
                                      [None], NullSink(), None)
        return paged_attention(0, q[rows], k[rows], v[rows], batch, 0.125, fixed_order=True)

    full = prefill(list(range(n)))
    cache = KVCache(1, 8, 16, hkv, d, torch.float32, "cpu")
    slots = torch.randperm(128)[: n - 3]  # context rows 0..36 at scattered slots
    cache.k[0, slots], cache.v[0, slots] = k[: n - 3], v[: n - 3]
    batch = build_attention_batch(torch.arange(n - 3, n), [3], [slots], [None], NullSink(), cache)
    step = paged_attention(0, q[n - 3:], k[n - 3:], v[n - 3:], batch, 0.125, fixed_order=True)
    assert same_bits(step, full[n - 3:])
    tree = torch.ones(20, 20, dtype=torch.bool).tril()
    tree[4:, 3] = False  # node 3 is a leaf: nodes 4..19 (a chain under node 2) skip it
    batch = build_attention_batch(torch.arange(20), [20], [torch.empty(0, dtype=torch.long)], [tree], NullSink(), None)
    got = paged_attention(0, q[:20], k[:20], v[:20], batch, 0.125, fixed_order=True)
    assert same_bits(got[4:], prefill([0, 1, 2, *range(4, 20)])[3:])



def test_fixed_order_attention_of_causal_batches_needs_no_mask():
    """Sequences whose new tokens are causal among themselves (decode steps of a batch, prefill chunks)
    attend through the kernel's own rule (context rows, then new keys up to the query), without a
    mask: the same bits as with the mask built, which is then never made."""
    from ratchetlm.kv.cache import KVCache
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch, paged_attention

    torch.manual_seed(2)
    h, hkv, d = 6, 2, 32
    cache = KVCache(1, 16, 16, hkv, d, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    ctx = [torch.randperm(256)[:n] for n in (37, 0, 5)]
    new_lens = [1, 4, 3]
    t = sum(new_lens)
    q, k, v = torch.randn(t, h, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)

    def attend(plain: bool) -> tuple[torch.Tensor, bool]:
        batch = build_attention_batch(torch.zeros(t, dtype=torch.long), new_lens, ctx, [None] * 3, NullSink(), cache)
        assert batch.plain_causal
        batch.plain_causal = plain
        return paged_attention(0, q, k, v, batch, 0.125, fixed_order=True), batch._mask is not None

    (plain, built), (masked, built_masked) = attend(True), attend(False)
    assert same_bits(plain, masked) and not built and built_masked


@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_fixed_order_attention_gives_the_native_builds_bits_in_every_build(variant, kernel_builds, monkeypatch):
    """The AVX2 path (8 lanes) and the portable C do the AVX-512 path's per-lane operations in its
    order, exp's polynomial included: the same bits for a prefill, a tree mask with softcap, and decode
    steps over an fp32 and a half cache at scattered slots, at head sizes that take each build's vector
    transposes (64) or not (40, 36)."""
    from ratchetlm.kv.cache import KVCache
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch, paged_attention

    builds = {name: kernel_builds[name] for name in ("native", variant)}
    if None in builds.values():
        pytest.skip("no C compiler")
    torch.manual_seed(4)
    h, hkv, n = 6, 2, 37
    tree = torch.ones(n, n, dtype=torch.bool).tril()
    tree[9:, 5:8] = False  # nodes 5-7 are leaves the rest skip

    def run(d: int) -> list[torch.Tensor]:
        q, k, v = torch.randn(n, h, d) * 3, torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        none = torch.empty(0, dtype=torch.long)

        def prefill(mask):
            return build_attention_batch(torch.arange(n), [n], [none], [mask], NullSink(), None)

        outs = [paged_attention(0, q, k, v, prefill(None), 0.125, fixed_order=True),
                paged_attention(0, q, k, v, prefill(tree), 0.125, softcap=5.0, fixed_order=True)]
        for dtype in (torch.float32, torch.float16):
            cache = KVCache(1, 8, 16, hkv, d, dtype, "cpu")
            cache.k.normal_()
            cache.v.normal_()
            ctx = [torch.randperm(128)[:c] for c in (41, 3, 100)]
            batch = build_attention_batch(torch.tensor([41, 3, 4, 100]), [1, 2, 1], ctx, [None] * 3, NullSink(), cache)
            outs.append(paged_attention(0, q[:4], k[:4], v[:4], batch, 0.125, fixed_order=True))
        return outs

    got = {}
    for name, lib in builds.items():
        monkeypatch.setattr(kernels, "load", lambda lib=lib: lib)
        torch.manual_seed(5)
        got[name] = [o for d in (64, 40, 36) for o in run(d)]
    assert all(same_bits(a, b) for a, b in zip(got[variant], got["native"], strict=True))


@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_fixed_order_verify_steps_over_a_half_cache_give_the_native_builds_bits(variant, kernel_builds, monkeypatch):
    """A speculative verify against a half cache (the default model's 9 query / 3 KV heads): a tree of 9
    rows (mask, no softcap) over 150 context keys and a chain of 5 over 37, at scattered slots, head sizes
    64 and 48 (48: the AVX-512 build's pair-transposed keys end on 8 pairs). The AVX-512 build takes its
    grouped verify path here (scores of two key blocks per tile from keys transposed as pairs of dims,
    the mask, limit and max in the scores' epilogue, values in sets of rows); the AVX2 and portable builds
    take none of it, so equal bits pin those paths to the plain per-lane order."""
    from ratchetlm.kv.cache import KVCache
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch, paged_attention

    builds = {name: kernel_builds[name] for name in ("native", variant)}
    if None in builds.values():
        pytest.skip("no C compiler")
    h, hkv = 9, 3
    parent = [-1, 0, 0, 1, 1, 2, 2, 3, 4]  # row 0 the root; rows 1-8 a tree of 8 nodes
    tree = torch.zeros(9, 9, dtype=torch.bool)
    for i in range(9):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parent[j]

    def run(d: int) -> torch.Tensor:
        cache = KVCache(1, 16, 16, hkv, d, torch.float16, "cpu")
        cache.k.normal_()
        cache.k.mul_(3)
        cache.v.normal_()
        ctx = [torch.randperm(256)[:150], torch.randperm(256)[:37]]
        q, k, v = torch.randn(14, h, d) * 2, torch.randn(14, hkv, d) * 3, torch.randn(14, hkv, d)
        positions = torch.cat([torch.arange(150, 159), torch.arange(37, 42)])
        batch = build_attention_batch(positions, [9, 5], ctx, [tree, None], NullSink(), cache)
        return paged_attention(0, q, k, v, batch, 0.125, fixed_order=True)

    got = {}
    for name, lib in builds.items():
        monkeypatch.setattr(kernels, "load", lambda lib=lib: lib)
        torch.manual_seed(6)
        got[name] = [run(d) for d in (64, 48)]
    assert all(same_bits(a, b) for a, b in zip(got[variant], got["native"], strict=True))


def test_linear_integer_fast_path_is_block_matmul_and_follows_numerics():
    """Linear keeps a one-pointer handle to its packed weight after the first integer-mode call; the
    calls through it give block_matmul's bits, and a change of numerics (set_numerics) is obeyed."""
    k, n = 256, 40
    w = BlockWeight.from_gguf("Q4_K", random_raw("Q4_K", n, k, seed=11), k)
    lin = Linear(k, n, bias=False)
    lin.use_blocks(w)
    torch.manual_seed(5)
    x = torch.randn(3, k)
    with torch.inference_mode():
        for mode in ("int16", "exact", "int8", "int16"):
            set_numerics(lin, mode)
            ref = block_matmul(x, w, numerics=mode)
            first, again = lin(x), lin(x)  # the first call builds the handle (integer modes), the second uses it
            assert same_bits(first, ref) and same_bits(again, ref), mode
            assert same_bits(lin(x.view(1, 3, k)).view(3, n), ref)  # other ranks take the general path
            assert (lin._q8_call is not None) == (mode != "exact")


@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_a_panel_mixing_q6_k_and_q8_0_rows_applies_its_sub_scales_in_integers_in_every_build(variant, kernel_builds):
    """A fused weight whose panel holds Q6_K rows beside Q8_0 rows: 8-bit values (zero point 128) in groups of
    16, no offsets, so a paired panel where J's float form would not be exact (the AVX-512 build multiplies in
    int32 there): the AVX2 and portable builds give the same bits, and the result the integer reference's."""
    if kernels.int8_isa() != "avx512vnni":
        pytest.skip("compares with the AVX512-VNNI build")
    other, native = kernel_builds[variant], kernel_builds["native"]
    assert other is not None and native is not None
    k = 512
    fused = BlockWeight.cat([BlockWeight.from_gguf("Q6_K", random_raw("Q6_K", 8, k, seed=14), k),
                             BlockWeight.from_gguf("Q8_0", random_raw("Q8_0", 12, k, seed=15), k)])
    panels = fused.pack_q8(native)[0][:, :2].view(np.int32)  # [vb, G, z, has_m]
    assert panels[0].tolist() == [8, 16, 128, 0]
    torch.manual_seed(16)
    x = torch.randn(35, k)
    x[7] *= 80.0
    for rows in (1, 11, 35):
        got = block_matmul(x[:rows], fused, lib=native, numerics="int8")
        assert_int8_close(got, x[:rows], fused)
        assert same_bits(block_matmul(x[:rows], fused, lib=other, numerics="int8"), got), rows


def test_silu_mul_gives_the_portable_builds_bits_in_every_build(kernel_builds):
    """SwiGLU's silu(g) * u, on the layer path (ratchet_silu_mul) and as the fused down projection's input
    (ratchet_swiglu_act), 16 lanes at a time on AVX-512 and 8 on AVX2 then a scalar tail: the portable
    scalar code's bits in every build, across exp's clamps, signed zeros, infinities and NaN."""
    portable = kernel_builds["portable"]
    if portable is None:
        pytest.skip("no C compiler")
    rows, ni = 3, 4099  # a row length with a scalar tail after the vectors
    g = torch.Generator().manual_seed(21)
    gu = torch.randn(rows, 2 * ni, generator=g) * 6
    gu[0, :ni] = torch.linspace(-120.0, 120.0, ni)
    gu[1, :12] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.9, -87.9, 88.5, -88.5, float("inf"), float("-inf"),
                               float("nan"), 3.0])
    gu[1, ni + 11] = float("nan")  # a NaN up

    def both(lib) -> tuple[np.ndarray, np.ndarray]:
        act, fused = torch.empty(rows, ni), torch.empty(rows, ni)
        lib.ratchet_silu_mul(gu.data_ptr(), rows, ni, act.data_ptr(), 2)
        lib.ratchet_swiglu_act.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.ratchet_swiglu_act(gu.data_ptr(), rows, ni, fused.data_ptr())
        return act.numpy().view(np.uint32), fused.numpy().view(np.uint32)

    ref, ref_fused = both(portable)
    assert np.array_equal(ref, ref_fused)
    for name in ("native", "avx2"):
        lib = kernel_builds[name]
        assert lib is not None, name
        act, fused = both(lib)
        assert np.array_equal(act, ref) and np.array_equal(fused, ref), name
