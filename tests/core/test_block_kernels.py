"""GGUF block kernels: every format dequantizes exactly like gguf-py in every instruction-set build,
the matmul multiplies exactly those weights at any row count (and a row's result does not depend on
the other rows of the call), and the model holds its GGUF weights only in block form."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ratchetlm import LLM, SamplingParams, kernels
from ratchetlm.layers import norm_rope
from ratchetlm.layers.block_quant import SUPPORTED_TYPES, BlockWeight, Linear, block_matmul, type_sizes
from ratchetlm.models import tokenizer

from ..conftest import KERNEL_VARIANTS

VARIANTS = KERNEL_VARIANTS  # the builds compared (tests/conftest.py builds them once, in parallel)
# byte offsets of the fp16 scales in each block (the rest of a block may be any bytes)
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
                 "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# K not a multiple of 256 (or of the vector width) where the format allows it
ODD_K = {"F32": 37, "F16": 37, "BF16": 53, "Q4_0": 96, "Q4_1": 96, "Q5_0": 96, "Q5_1": 96, "Q8_0": 96}


def random_raw(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF bytes ``[n, row_bytes]`` with valid (finite, varied) fp16 scales."""
    rng = np.random.default_rng(seed)
    if type_name == "F32":
        return rng.standard_normal((n, k)).astype(np.float32).view(np.uint8)
    if type_name == "F16":
        return rng.standard_normal((n, k)).astype(np.float16).view(np.uint8)
    if type_name == "BF16":
        bits = (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return bits.view(np.uint8)
    blck, nbytes = type_sizes(type_name)
    raw = rng.integers(0, 256, (n, k // blck, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[type_name]:
        scale = rng.uniform(1e-3, 3e-2, (n, k // blck)) * rng.choice([-1, 1], (n, k // blck))
        raw[..., off:off + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def gguf_py(type_name: str, raw: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return np.asarray(dequantize(raw, GGMLQuantizationType[type_name]), dtype=np.float32)


def same_bits(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def assert_fp32_close(got: torch.Tensor, x: torch.Tensor, w: BlockWeight) -> None:
    """Within fp32 summation-order noise of an fp64 reference: a tiny fraction of sum |terms|."""
    dense = w.dequantize().double()
    err = (got.double() - F.linear(x.double(), dense)).abs()
    assert (err <= 1e-5 * F.linear(x.double().abs(), dense.abs())).all(), float(err.max())


@pytest.fixture(scope="module", params=list(VARIANTS))
def lib(request, kernel_builds):
    built = kernel_builds[request.param]
    assert built is not None, f"kernel build {request.param} failed (is a C compiler installed?)"
    return built


def test_best_build_is_available():
    # the fresh-machine setup has gcc: a broken kernel build must fail here, not silently go dense
    assert kernels.load() is not None and kernels.isa() in ("avx512", "avx2", "scalar")


def test_one_type_table_in_c_and_python():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    lib = kernels.load()
    names = tuple(lib.ratchet_type_name(i).decode() for i in range(lib.ratchet_num_types()))
    assert names == SUPPORTED_TYPES
    for i, name in enumerate(names):
        q = GGMLQuantizationType[name]
        assert lib.ratchet_type_ggml_id(i) == q.value
        assert (lib.ratchet_type_blck(i), lib.ratchet_type_bytes(i)) == GGML_QUANT_SIZES[q]


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_is_bit_identical_to_gguf_py(lib, type_name):
    blck, _ = type_sizes(type_name)
    k = 512 if blck == 256 else ODD_K[type_name] * 3
    raw = random_raw(type_name, 7, k, seed=len(type_name))
    out = np.empty((7, k), dtype=np.float32)
    lib.ratchet_to_float(SUPPORTED_TYPES.index(type_name), raw.ctypes.data, out.ctypes.data, 7 * k // blck)
    assert same_bits(out, gguf_py(type_name, raw))


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_identity_input_returns_the_weights_exactly(lib, type_name):
    """x = I picks single weights (one nonzero product, the rest exact zeros), so x @ w.T must be
    gguf-py's dequantized weights — at 1, 3, 8 (few-token path) and 9+ rows (chunked-K path)."""
    blck, _ = type_sizes(type_name)
    k = 512 if blck == 256 else ODD_K[type_name] * 3
    n = 37  # not a multiple of the register tile's rows
    raw = random_raw(type_name, n, k, seed=3)
    bw = BlockWeight.from_gguf(type_name, raw, k)
    eye = torch.eye(k)
    cuts = [0, 1, 4, 12, 21, k]
    got = torch.cat([block_matmul(eye[a:b], bw, lib=lib, path="kernel") for a, b in zip(cuts, cuts[1:], strict=False)])
    assert torch.equal(got, torch.from_numpy(gguf_py(type_name, raw)).T)
    assert torch.equal(block_matmul(eye, bw, lib=lib, path="blas"), got)  # the dequantized-tile path too


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "F16"])
def test_row_map_and_parts(lib, type_name):
    """A fused weight of parts in different formats, one with a row map (the Q/K un-permutation),
    multiplies the concatenation of the mapped rows."""
    k = 256
    raw_a, raw_b = random_raw(type_name, 10, k, seed=1), random_raw("Q5_0", 6, k, seed=2)
    order = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int32)
    w = BlockWeight.cat([BlockWeight.from_gguf(type_name, raw_a, k, order), BlockWeight.from_gguf("Q5_0", raw_b, k)])
    assert w.shape == (14, k)
    dense = np.concatenate([gguf_py(type_name, raw_a)[order], gguf_py("Q5_0", raw_b)])
    assert torch.equal(w.dequantize(), torch.from_numpy(dense))
    eye = torch.eye(k)
    assert torch.equal(torch.cat([block_matmul(eye[:5], w, lib=lib), block_matmul(eye[5:], w, lib=lib, path="kernel")]),
                       torch.from_numpy(dense).T)
    assert torch.equal(block_matmul(eye, w, lib=lib, path="blas"), torch.from_numpy(dense).T)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16"])
def test_matmul_matches_fp64_and_is_batch_invariant(lib, type_name):
    """Random activations: close to an fp64 reference, and each row's result is bit-identical
    whether it is computed alone, among 7 rows or among 301 (another tiling and K chunking), with
    1 or 2 threads: the per-output reduction order never depends on the batch (301 rows of K = 2048
    also span several of the kernel's token blocks)."""
    k, n = 2048, 75
    bw = BlockWeight.from_gguf(type_name, random_raw(type_name, n, k, seed=5), k)
    x = torch.randn(301, k, generator=torch.Generator().manual_seed(0))
    big = block_matmul(x, bw, threads=2, lib=lib, path="kernel")
    assert_fp32_close(big, x, bw)
    for rows in (slice(0, 1), slice(5, 12), slice(290, 301)):
        assert same_bits(block_matmul(x[rows], bw, threads=1, lib=lib, path="kernel"), big[rows])
    assert_fp32_close(block_matmul(x, bw, lib=lib, path="blas"), x, bw)  # sgemm on dequantized tiles


def test_blas_path_tiles_the_weight(monkeypatch):
    """The BLAS path dequantizes a bounded tile at a time (never the whole matrix), across parts."""
    from ratchetlm.layers import block_quant

    k = 256
    w = BlockWeight.cat([BlockWeight.from_gguf("Q6_K", random_raw("Q6_K", 70, k, seed=1), k,
                                               np.arange(70, dtype=np.int32)[::-1].copy()),
                         BlockWeight.from_gguf("Q4_0", random_raw("Q4_0", 33, k, seed=2), k)])
    monkeypatch.setattr(block_quant, "TILE_BYTES", 4 * k * 16)  # 16 rows per tile: 7 tiles, one spans both parts
    monkeypatch.setattr(block_quant, "_tile", [])
    x = torch.randn(40, k)
    got = block_matmul(x, w, path="blas")
    assert got.shape == (40, 103) and block_quant._tile[0].numel() == 16 * k
    assert_fp32_close(got, x, w)


def test_blas_rows_is_measured_once_and_can_be_pinned():
    from ratchetlm.layers.block_quant import BLAS_PROBE_ROWS, blas_rows, set_blas_rows

    measured = blas_rows()
    assert measured in BLAS_PROBE_ROWS or measured == float("inf")
    try:
        set_blas_rows(0)
        assert blas_rows() == float("inf")
        set_blas_rows(64)
        assert blas_rows() == 64
    finally:
        set_blas_rows(None if measured == float("inf") else int(measured))


def test_quantize_q8_0_round_trips():
    w = torch.randn(8, 64)
    bw = BlockWeight.quantize_q8_0(w)
    assert same_bits(bw.dequantize(), gguf_py("Q8_0", bw.parts[0].data))
    assert (bw.dequantize() - w).abs().max() <= w.abs().max() / 127


def test_linear_without_kernels_path_dequantizes(monkeypatch):
    """Autograd (or another dtype) cannot use the kernels: the layer multiplies the dequantized
    weights instead, with the same result."""
    bw = BlockWeight.from_gguf("Q4_K", random_raw("Q4_K", 16, 256), 256)
    lin = Linear(256, 16, bias=False)
    lin.use_blocks(bw)
    assert lin.weight is None
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fast = lin(x)
    slow = lin(x.clone().requires_grad_(True))
    assert slow.requires_grad
    # the two sum in different orders: the error bound scales with sum |x| |w|, not with |y|
    scale = (x.abs() @ bw.dequantize().abs().T).max().item()
    torch.testing.assert_close(fast, slow.detach(), atol=1e-6 * scale, rtol=0)


def test_default_model_holds_only_blocks_of_the_file(llm_fp32, hf_smollm):
    """No dense copy: every linear layer and the embedding hold views of the mmapped GGUF (norms
    are the only dense parameters), and the blocks dequantize exactly to the weights HF
    transformers' own GGUF loader builds (Q/K permutation undone by row maps)."""
    model = llm_fp32.engine.model
    dense = sum(p.numel() for p in model.parameters())
    assert dense == sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert model.embed.weight is None and model.embed.blocks is not None
    for layer in model.layers:
        for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert lin.weight is None and lin.blocks is not None
            assert all(not p.data.flags.owndata and not p.data.flags.writeable for p in lin.blocks.parts)
    hf = hf_smollm.model
    for i in (0, len(model.layers) - 1):
        ours, theirs = model.layers[i], hf.layers[i]
        att = theirs.self_attn
        assert torch.equal(ours.qkv.blocks.dequantize(),
                           torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]))
        assert torch.equal(ours.down.blocks.dequantize(), theirs.mlp.down_proj.weight)
    assert torch.equal(model.embed(torch.tensor([0, 7, 49151])), hf.embed_tokens.weight[[0, 7, 49151]])


def test_switch_off_and_compiler_missing_fall_back_to_dense(monkeypatch, tmp_path, caplog):
    with monkeypatch.context() as m:  # a load without block weights never asks which integer kernels exist
        m.setattr(kernels, "int8_isa", lambda: pytest.fail("int8_isa() on a load without block weights"))
        off = LLM(progress=False, numerics="exact", dtype="float32", gguf_kernels=False, kv_cache_blocks=32)
    assert all(layer.qkv.blocks is None and layer.qkv.weight is not None for layer in off.engine.model.layers)
    # an empty kernel cache (no library to find); the converted tokenizer still read from its own cache (an
    # empty one converts the GGUF vocabulary again: ~15 s of CPU that has nothing to do with the kernels)
    monkeypatch.setenv("RATCHETLM_CACHE", str(tokenizer.cache_root()))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels.build, "_compiler", lambda: None)
    monkeypatch.setattr(norm_rope, "_lanes", [])  # found without a library here: not kept for later tests
    kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            llm = LLM(progress=False, numerics="exact", dtype="float32", kv_cache_blocks=32)
        assert "no C compiler" in caplog.text
        assert llm.engine.model.embed.blocks is None
        p = SamplingParams(max_tokens=8, temperature=0)
        assert llm.generate("The capital of France is", p)[0].token_ids == \
            off.generate("The capital of France is", p)[0].token_ids
    finally:
        kernels.load.cache_clear()


def test_failed_build_returns_none(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels.build, "_compiler", lambda: "false")  # a "compiler" that always fails
    assert kernels.compile_library(["-march=native"]) is None
    assert not list((tmp_path / "ratchetlm" / "kernels").glob("*.so"))


def test_auto_dtype_picks_fp32_for_gguf_on_cpu_when_kernels_are_built():
    from ratchetlm.engine.config import EngineConfig

    assert EngineConfig().torch_dtype() == torch.float32  # bundled GGUF, kernels built
    assert EngineConfig(model="some/model.gguf").torch_dtype() == torch.float32
    no_kernels = EngineConfig(gguf_kernels=False).torch_dtype()
    folder = EngineConfig(model="some/hf_folder").torch_dtype()
    assert no_kernels == folder == torch.float32  # CPU default: fp32 everywhere (engine/dtype.py)


def test_unwritable_cache_falls_back_to_temp_dir(monkeypatch, tmp_path):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # cache_dir() lies under a file: mkdir fails
    monkeypatch.setattr(kernels.build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    # unoptimised (a fresh build either way, where it lands is under test): ~11 s of CPU at -O3, a few at -O0
    monkeypatch.setattr(kernels.build, "_CFLAGS", [*kernels.build._CFLAGS, "-O0"])
    lib = kernels.compile_library([])
    assert lib is not None
    assert list((tmp_path / "tmp").glob("ratchetlm-kernels-*/ratchet_kernels-*.so"))


def test_get_rows_bounds_are_checked():
    from ratchetlm.layers.block_quant import Embedding

    emb = Embedding(4, 32)
    emb.use_blocks(BlockWeight.from_gguf("Q8_0", random_raw("Q8_0", 4, 32), 32))
    assert emb(torch.tensor([[3, 0]])).shape == (1, 2, 32)
    with pytest.raises(IndexError):
        emb(torch.tensor([4]))


def test_building_a_model_on_the_meta_device_initialises_nothing():
    """A model is built on the meta device and then loaded: no initialiser runs there. (torch's
    normal_ on a meta tensor imports torch._dynamo: a second of load time, ten on a busy machine.)"""
    import subprocess
    import sys

    from ratchetlm.layers.block_quant import Embedding

    code = ("import sys, torch\n"
            "from ratchetlm.layers.block_quant import Embedding\n"
            "with torch.device('meta'):\n"
            "    e = Embedding(49152, 64)\n"
            "assert e.weight.is_meta\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    emb = Embedding(3, 4)  # off the meta device it is still an initialised nn.Embedding
    assert emb.weight.abs().sum() > 0
