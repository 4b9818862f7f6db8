"""GGUF block kernels: the fused dequantize-dot multiplies exactly the dense weights, every
instruction-set build agrees with the reference, and the model uses them only where it should."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ratchetlm import LLM, SamplingParams, kernels
from ratchetlm.layers.block_quant import (
    MAX_FUSED_ROWS,
    PROBE_ROWS,
    BlockWeight,
    fused_matmul,
    fused_rows_limit,
    set_fused_rows_limit,
    usable,
)

VARIANTS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma"], "portable": []}


def _random_raw(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF bytes ``[n, k/32 * block_bytes]`` in the on-disk layout."""
    rng = np.random.default_rng(seed)
    nb = k // 32
    if kind == "q4_1":
        d = rng.uniform(1e-3, 2e-2, (n, nb, 1)).astype(np.float16)
        m = rng.uniform(-0.1, 0.0, (n, nb, 1)).astype(np.float16)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        return np.concatenate([d.view(np.uint8), m.view(np.uint8), qs], axis=-1).reshape(n, -1)
    d = rng.uniform(1e-3, 2e-2, (n, nb, 1)).astype(np.float16)
    qs = rng.integers(-128, 128, (n, nb, 32), dtype=np.int8)
    return np.concatenate([d.view(np.uint8), qs.view(np.uint8)], axis=-1).reshape(n, -1)


def _random_blocks(kind: str, n: int, k: int, seed: int = 0) -> BlockWeight:
    bw = BlockWeight.from_gguf(kind.upper(), _random_raw(kind, n, k, seed))
    assert bw is not None
    return bw


@pytest.fixture(scope="module", params=list(VARIANTS))
def lib(request):
    built = kernels.compile_library(VARIANTS[request.param])
    assert built is not None, f"kernel build {request.param} failed (is a C compiler installed?)"
    return built


def test_best_build_is_available():
    # the fresh-machine setup has gcc: a broken kernel build must fail here, not silently go dense
    assert kernels.load() is not None and kernels.isa() in ("avx512", "avx2", "scalar")


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_block_parse_and_dequantize_match_gguf_py(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _random_raw(kind, 5, 96)
    bw = BlockWeight.from_gguf(kind.upper(), raw)
    assert bw is not None and bw.shape == (5, 96)
    qtype = GGMLQuantizationType.Q4_1 if kind == "q4_1" else GGMLQuantizationType.Q8_0
    assert torch.equal(bw.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_kernel_multiplies_exactly_the_dequantized_weights(lib, kind):
    """x = identity picks single weights (one nonzero product, the rest exact zeros), so the
    result must equal the dequantized weights bit for bit — in every instruction-set build."""
    bw = _random_blocks(kind, 37, 64)
    eye = torch.eye(64)
    got = torch.cat([fused_matmul(eye[i:i + n], bw, lib=lib) for i, n in ((0, 3), (3, 8), (11, 53))])
    assert torch.equal(got, bw.dequantize().T)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 33, 96, 301])  # row loop (<= 8), register tiles (> 8), prefill
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_dense_linear(lib, kind, rows, threads):
    bw = _random_blocks(kind, 302, 576, seed=rows)  # 302: not a multiple of the 4-row tile
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    ref = F.linear(x.double(), bw.dequantize().double()).float()
    got = fused_matmul(x, bw, threads=threads, lib=lib)
    assert got.shape == (rows, 302)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)  # |y| ~ 30: fp32 summation-order noise


def test_usable_only_for_small_fp32_cpu_inference():
    bw = _random_blocks("q4_1", 8, 64)
    limit = fused_rows_limit()
    assert limit == MAX_FUSED_ROWS or limit in PROBE_ROWS  # measured on this machine, once per process
    with torch.inference_mode():
        assert usable(torch.zeros(limit, 64), bw)
        assert not usable(torch.zeros(limit + 1, 64), bw)  # a long prefill: BLAS on the dense copy
        try:
            set_fused_rows_limit(MAX_FUSED_ROWS)  # pinned: the limit is what usable() follows
            assert not usable(torch.zeros(MAX_FUSED_ROWS + 1, 64), bw)
        finally:
            set_fused_rows_limit(limit)
        assert not usable(torch.zeros(1, 64, dtype=torch.bfloat16), bw)
        assert not usable(torch.zeros(1, 64), None)
    assert not usable(torch.zeros(1, 64), bw)  # autograd on: dense path (the kernel has no backward)


def test_default_model_blocks_hold_the_loaded_weights(llm_fp32):
    """Every linear of the bundled Q4_1 model (and its tied Q8_0 head) got blocks whose
    dequantization is exactly the dense weight in use, rows in the same (un-permuted) order."""
    model = llm_fp32.engine.model
    for layer in model.layers:
        for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert lin.blocks is not None and lin.blocks.kind == "q4_1"
            assert torch.equal(lin.blocks.dequantize(), lin.weight)
    assert model.head_blocks is not None and model.head_blocks.kind == "q8_0"
    assert torch.equal(model.head_blocks.dequantize(), model.embed.weight)


def test_switch_off_and_compiler_missing_fall_back_to_dense(monkeypatch, tmp_path, caplog):
    off = LLM(progress=False, dtype="float32", gguf_kernels=False, kv_cache_blocks=32)
    assert all(layer.qkv.blocks is None for layer in off.engine.model.layers)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    kernels.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            llm = LLM(progress=False, dtype="float32", kv_cache_blocks=32)
        assert "no C compiler" in caplog.text
        assert llm.engine.model.head_blocks is None
        p = SamplingParams(max_tokens=8, temperature=0)
        assert llm.generate("The capital of France is", p)[0].token_ids == \
            off.generate("The capital of France is", p)[0].token_ids
    finally:
        kernels.load.cache_clear()


def test_failed_build_returns_none(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_compiler", lambda: "false")  # a "compiler" that always fails
    assert kernels.compile_library(["-march=native"]) is None
    assert not list((tmp_path / "ratchetlm" / "kernels").glob("*.so"))


def test_auto_dtype_picks_fp32_for_gguf_on_cpu_when_kernels_are_built():
    from ratchetlm.engine.config import EngineConfig

    assert EngineConfig().torch_dtype() == torch.float32  # bundled GGUF, kernels built
    assert EngineConfig(model="some/model.gguf").torch_dtype() == torch.float32
    no_kernels = EngineConfig(gguf_kernels=False).torch_dtype()
    folder = EngineConfig(model="some/hf_folder").torch_dtype()
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert no_kernels == folder == (torch.bfloat16 if native_bf16 else torch.float32)


def test_unwritable_cache_falls_back_to_temp_dir(monkeypatch, tmp_path):
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # cache_dir() lies under a file: mkdir fails
    monkeypatch.setattr(kernels.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    lib = kernels.compile_library([])
    assert lib is not None
    assert list((tmp_path / "tmp").glob("ratchetlm-kernels-*/ggml_blocks-*.so"))
