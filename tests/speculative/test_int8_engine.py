"""The integer numerics modes (int8, int16) at engine level. They are not HF-identical (activations
are rounded to integers), so their oracle is themselves: because every row's result is independent
of the rows beside it, speculative decoding (n-gram chain and tree, EAGLE head) must equal plain
greedy decoding in the same mode token for token, a request alone must equal the same request in a
batch of 8, preemption must not change outputs, and WeDLM must equal its no-cache reference run on
the same integer-mode model."""

from __future__ import annotations

import argparse

import pytest
import torch

from ratchetlm import LLM, kernels
from ratchetlm.cli import add_engine_args, engine_kwargs
from ratchetlm.decoding.speculative.eagle import EagleConfig, EagleHead
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.layers.block_quant import BlockWeight, Linear
from ratchetlm.sampling_params import SamplingParams

from .conftest import GREEDY, run_engine
from .prompts import PROMPTS


@pytest.fixture(scope="module", params=["int8", "int16"])
def llm_int8(request):
    return LLM(progress=False, numerics=request.param, kv_cache_blocks=64)


def int8_engine(llm, decoding: str = "autoregressive", kv_cache_blocks: int = 192, **options) -> LLMEngine:
    if decoding == "speculative":
        options.setdefault("depth_schedule", "constant")
    cfg = EngineConfig(dtype="float32", decoding=decoding, decoding_options=options, numerics=llm.config.numerics,
                       kv_cache_blocks=kv_cache_blocks, progress=False)
    return LLMEngine(cfg, llm.engine.model, llm.model_config, tokenizer=llm.tokenizer)


@pytest.fixture(scope="module")
def encoded8(llm_int8) -> list[list[int]]:
    return [llm_int8.tokenize(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference8(llm_int8, encoded8) -> list[list[int]]:
    """Plain greedy in int8, each prompt alone (the oracle)."""
    return [run_engine(int8_engine(llm_int8), [p], GREEDY)[0] for p in encoded8]



def test_the_engines_here_run_a_half_kv_cache(llm_int8):
    """kv_cache_dtype="auto" in the integer modes: every equality below holds with K/V rounded to half as
    written (tests/core/test_kv_cache_dtype.py has the kernel's oracle)."""
    assert int8_engine(llm_int8).cache.k.dtype == torch.float16

def test_config_and_cli_validate_numerics():
    with pytest.raises(ValueError, match="numerics must be"):
        EngineConfig(numerics="fp8")
    with pytest.raises(ValueError, match="gguf_kernels"):
        EngineConfig(numerics="int8", gguf_kernels=False)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--numerics", "int8"]))["numerics"] == "int8"
    assert engine_kwargs(p.parse_args([]))["numerics"] == EngineConfig().numerics
    with pytest.raises(SystemExit):
        p.parse_args(["--numerics", "int4"])


def test_int8_model_runs_its_matmuls_in_int8_and_names_its_cache_apart(llm_int8, llm_fp32):
    mods = [m for m in llm_int8.engine.model.modules() if isinstance(m, Linear) and m.blocks is not None]
    assert mods and all(m.numerics == llm_int8.config.numerics for m in mods)
    assert llm_int8.engine.kv_identity() != llm_fp32.engine.kv_identity()
    ids = torch.tensor(llm_int8.tokenize(PROMPTS[3]))
    # not the exact mode's logits (a stub that ignored the mode would pass the equality tests), but close
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch

    def logits(llm):
        batch = build_attention_batch(torch.arange(len(ids)), [len(ids)], [torch.empty(0, dtype=torch.long)], [None],
                                      NullSink(), None)
        with torch.inference_mode():
            return llm.engine.model.logits(llm.engine.model(ids, batch))

    a, b = logits(llm_int8), logits(llm_fp32)
    assert not torch.equal(a, b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


SPEC = {"ngram_chain": dict(method="ngram", depth=4), "ngram_tree": dict(method="ngram", num_candidates=3, depth=4)}


@pytest.mark.parametrize("name", list(SPEC))
def test_speculative_equals_plain_greedy_in_int8(llm_int8, encoded8, reference8, name):
    eng = int8_engine(llm_int8, "speculative", **SPEC[name])
    assert run_engine(eng, encoded8, GREEDY) == reference8
    assert eng.strategy.metrics()["spec_decode_num_accepted_tokens"] > 0  # drafts were really verified
    for i in (0, 3):
        assert run_engine(int8_engine(llm_int8, "speculative", **SPEC[name]), [encoded8[i]], GREEDY) == [reference8[i]]


def test_eagle_head_equals_plain_greedy_in_int8(llm_int8, encoded8, reference8, tmp_path):
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(llm_int8.model_config, 512))
    head.draft_vocab.copy_(torch.randperm(llm_int8.model_config.vocab_size)[:512])
    head.save(tmp_path / "head")
    eng = int8_engine(llm_int8, "speculative", method="eagle", draft_model=str(tmp_path / "head"), depth=3)
    subset = [0, 3, 5, 9]
    assert run_engine(eng, [encoded8[i] for i in subset], GREEDY) == [reference8[i] for i in subset]


def test_alone_equals_in_a_batch_of_8_and_preemption_changes_nothing(llm_int8, encoded8, reference8):
    batch = run_engine(int8_engine(llm_int8), encoded8[:8], GREEDY)
    assert batch == reference8[:8]
    tight = int8_engine(llm_int8, kv_cache_blocks=6)
    assert run_engine(tight, encoded8[:6], GREEDY) == reference8[:6]
    assert tight.scheduler.num_preemptions > 0


@pytest.mark.parametrize("numerics", ["int8", "int16"])
def test_wedlm_equals_its_no_cache_reference_in_int8(tmp_path, numerics):
    """A tiny WeDLM model whose linear weights are Q8_0 blocks, in int8 mode: the paged engine (window
    forwards over cached K/V) equals the reference decoder recomputing the whole sequence each step
    through the same int8 model without a cache."""
    from ratchetlm.decoding.wedlm_reference import wedlm_generate_reference
    from ratchetlm.decoding.wedlm_window import WeDLMConfig
    from ratchetlm.kv.sink import NullSink
    from ratchetlm.layers.attention import build_attention_batch

    from ..wedlm.factory import make_tiny_wedlm_folder

    path, _ = make_tiny_wedlm_folder(tmp_path / "tiny", head_scale=150.0)
    llm = LLM(str(path), dtype="float32", progress=False, max_model_len=256)
    model = llm.engine.model
    for m in model.modules():
        if isinstance(m, Linear) and m.blocks is None:
            m.use_blocks(BlockWeight.quantize_q8_0(m.weight))
    assert model.set_numerics(numerics) > 0

    @torch.inference_mode()
    def no_cache_logits(ids: list[int], pos: list[int]) -> torch.Tensor:
        batch = build_attention_batch(torch.tensor(pos), [len(ids)], [torch.empty(0, dtype=torch.long)], [None],
                                      NullSink(), None)
        return model.logits(model(torch.tensor(ids), batch))

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100, 7]]
    opts = dict(window_size=8, entropy_threshold=0.4)
    cfg = EngineConfig(dtype="float32", decoding="wedlm", decoding_options=opts, numerics=numerics,
                       kv_cache_blocks=64, max_model_len=256, progress=False)
    eng = LLMEngine(cfg, model, llm.model_config)
    got = run_engine(eng, prompts, params)
    mask_id, eos = llm.model_config.mask_token_id, llm.model_config.eos_token_ids
    for p, g in zip(prompts, got, strict=True):
        ref = wedlm_generate_reference(no_cache_logits, p, params, WeDLMConfig(**opts), mask_id, 256, eos, None)
        assert g == ref.output_ids
        assert max(ref.commits_per_step) > 1  # not vacuous: some steps commit several tokens


def test_default_numerics_is_the_integer_mode_where_the_weights_have_integers(llm_default, llm_fp32, tmp_path):
    """numerics="auto" (the default) runs a quantized GGUF on CPU in the mode its weight format's table entry
    names (the bundled Q4_1 file: models/auto_numerics.py) and anything without integer weights (an fp32 HF
    folder, the dense path) in exact; the engine's config and cache names say which."""
    from ratchetlm.models.auto_numerics import FAST_INT_ISAS, INT8_GRADE_FILE_TYPES, OTHER_FORMATS

    from ..wedlm.factory import make_tiny_wedlm_folder

    assert EngineConfig().numerics == "auto"
    if kernels.int8_isa() not in FAST_INT_ISAS:
        pytest.skip("auto keeps exact where the integer kernels have no vector form (next test)")
    mode = "int8" if "Q4_1" in INT8_GRADE_FILE_TYPES else OTHER_FORMATS
    assert llm_default.config.numerics == mode == llm_default.engine.cfg.numerics
    assert llm_default.numerics_description.startswith(f"numerics={mode} (auto: Q4_1 weights")
    mods = [m for m in llm_default.engine.model.modules() if isinstance(m, Linear) and m.blocks is not None]
    assert mods and all(m.numerics == mode for m in mods)
    assert all(layer.fixed_order_attention for layer in llm_default.engine.model.layers)
    assert llm_default.engine.kv_identity()["numerics"] == mode != llm_fp32.engine.kv_identity()["numerics"]
    path, _ = make_tiny_wedlm_folder(tmp_path / "tiny")  # fp32 safetensors: nothing to run in integers
    folder = LLM(str(path), dtype="float32", progress=False, max_model_len=64, kv_cache_blocks=8)
    assert folder.config.numerics == "exact"
    assert folder.numerics_description == "numerics=exact (auto: no quantized block weights here)"
    assert not any(layer.fixed_order_attention for layer in folder.engine.model.layers)
    dense = LLM(dtype="float32", progress=False, gguf_kernels=False, kv_cache_blocks=8)
    assert dense.config.numerics == "exact"
    # an engine built on a loaded model takes the model's mode
    eng = LLMEngine(EngineConfig(dtype="float32", progress=False, kv_cache_blocks=8), llm_default.engine.model,
                    llm_default.model_config)
    assert eng.cfg.numerics == mode


def test_auto_numerics_goes_by_weight_format():
    """int8 only for the weight formats a real model measured llama.cpp-grade in (the table: Q4_1, Q4_K_M,
    Q8_0, Q6_K, Q5_K_M), int16 for every other quantized format, exact without integer weights or a vector
    integer kernel; the GGUF's general.file_type names the format as llama.cpp does."""
    from ratchetlm.models.auto_numerics import INT8_GRADE_FILE_TYPES, choose_auto, file_type

    class Reader(dict):  # GGUFFile.get
        pass

    assert file_type(Reader({"general.file_type": 15})) == "Q4_K_M"
    assert file_type(Reader({"general.file_type": 3})) == "Q4_1"
    assert file_type(Reader({"general.file_type": 7})) == "Q8_0"
    assert file_type(Reader({"general.file_type": 18})) == "Q6_K"
    assert file_type(Reader({"general.file_type": 17})) == "Q5_K_M"
    assert file_type(Reader({"general.file_type": 9999})) == "file type 9999"
    assert file_type(Reader()) is None and file_type(None) is None
    for fmt in INT8_GRADE_FILE_TYPES:
        c = choose_auto(fmt, True, "avx512vnni")
        assert c.numerics == "int8" and fmt in c.describe() and INT8_GRADE_FILE_TYPES[fmt] in c.describe()
    # int8 for the formats a real model (requantized by llama.cpp's quantizer) measured grade in
    for fmt in ("Q8_0", "Q6_K", "Q5_K_M"):
        assert choose_auto(fmt, True, "avx512vnni").numerics == "int8"
    for fmt in ("Q6_K", "Q5_K_M"):
        assert choose_auto(fmt, True, "avx2").numerics == "int8"
    # except where int16 is no slower: Q8_0's bytes on AVX2 (int8 splits them into nibbles)
    c = choose_auto("Q8_0", True, "avx2")
    assert c.numerics == "int16" and "Q8_0 weights on avx2" in c.describe()
    # int16 for a quantized format nobody measured (Q4_0, Q3_K_M, Q2_K, ...) and for a file without a type
    for fmt in ("Q4_0", "Q3_K_M", "Q2_K", "Q5_0", "file type 9999", None):
        assert fmt not in INT8_GRADE_FILE_TYPES
        c = choose_auto(fmt, True, "avx2")
        assert c.numerics == "int16" and "no real model of the format measured" in c.describe()
    assert choose_auto("Q4_K_M", False, "avx512vnni").numerics == "exact"
    assert choose_auto("Q4_K_M", True, "scalar").numerics == "exact"


@pytest.mark.parametrize(("file_type", "mode"),
                         [(18, "int8"), (17, "int8"), (2, "int16"), (None, "int16")])
def test_auto_numerics_reads_the_files_weight_format(tmp_path, file_type, mode):
    """The loader keys auto on the GGUF's general.file_type, not on the blocks it finds: the same Q6_K tensors
    run in int8 in a file that says Q6_K (18) or Q5_K_M (17), in int16 in one that says Q4_0 (2, no real model
    measured) or says nothing."""
    from tests.core.gguf_factory import write_tiny_gguf

    if kernels.int8_isa() not in ("avx512vnni", "avx2"):
        pytest.skip("auto keeps exact where the integer kernels have no vector form")
    meta = {} if file_type is None else {"general.file_type": file_type}
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", ["Q6_K"], metadata=meta)
    llm = LLM(str(path), progress=False, max_model_len=64, kv_cache_blocks=8)
    assert llm.config.numerics == mode
    names = {18: "Q6_K", 17: "Q5_K_M", 2: "Q4_0", None: "these"}
    assert llm.numerics_description.startswith(f"numerics={mode} (auto: {names[file_type]} weights")


def test_default_numerics_is_exact_without_a_vector_integer_kernel(monkeypatch, caplog):
    """Where the integer kernels are the portable C loop (no AVX2: several times slower than exact),
    auto keeps exact; asking for int16 there still gets it, with a warning."""
    from ratchetlm.models import registry

    monkeypatch.setattr(registry.kernels, "int8_isa", lambda: "scalar")
    assert LLM(progress=False, kv_cache_blocks=8).config.numerics == "exact"
    assert "integer kernels" not in caplog.text
    assert LLM(progress=False, kv_cache_blocks=8, numerics="int16").config.numerics == "int16"
    assert "runs the portable integer kernels on this CPU" in caplog.text


def test_long_prefill_mlp_in_row_chunks_is_bit_identical(llm_int8, monkeypatch):
    """A prefill longer than MLP_ROWS runs its MLP MLP_ROWS rows at a time (bounding peak memory); the
    rows do not depend on each other in the integer modes, so every logit equals the one-call MLP's."""
    from ratchetlm.models import llama
    from tests.models.tiny import engine_logits

    ids = (llm_int8.tokenize(" ".join(PROMPTS)) * 4)[:300]
    rows = [0, 127, 128, 250, 299]
    layers = llm_int8.engine.model.layers
    assert all(ly.mlp_rows == llama.MLP_ROWS < 300 for ly in layers)
    calls: list[int] = []
    mlp = llama.DecoderLayer.mlp
    monkeypatch.setattr(llama.DecoderLayer, "mlp", lambda self, hn: calls.append(hn.shape[0]) or mlp(self, hn))
    chunked = engine_logits(llm_int8, ids, rows)
    c = llama.MLP_ROWS
    assert calls[: -(-300 // c)] == [c] * (300 // c) + [300 % c]  # the first layer's chunks
    try:
        for ly in layers:
            ly.mlp_rows = None
        calls.clear()
        whole = engine_logits(llm_int8, ids, rows)
        assert calls[0] == 300
    finally:
        for ly in layers:
            ly.mlp_rows = llama.MLP_ROWS
    assert chunked.keys() == whole.keys() and all(torch.equal(chunked[r], whole[r]) for r in chunked)
