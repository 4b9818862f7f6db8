"""The same engine on ``device="cuda"``: HF parity in fp32, greedy identity of multi-token decoding
(n-gram speculation) with plain decoding, batched == alone, GGUF block weights (their CPU kernels
fall back), WeDLM == its reference; DeepSeek-V4 is refused on CUDA with a clear error. Run with
``pytest -m cuda tests/cuda`` on a machine with a GPU; everywhere else these are skipped (CI has none).

In bf16 the contract is weaker: CUDA's matrix kernels pick their reduction by the number of rows,
so a row's bits can depend on its batch; the bf16 cases check closeness to HF bf16, not identity."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from tests.models.tiny import engine_logits, hf_model, save_hf, write_gguf

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FAMILIES = {
    "llama3": ("LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=24, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=3.0, query_pre_attn_scalar=16)),
}
PROMPTS = [
    "The ratchet only moves forward: committed tokens are never taken back, and the window slides.",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n",
    "abcabcabcabc",
    "Sliding windows keep memory flat; global layers keep everything they need.",
]
NGRAM = {"method": "ngram", "depth": 4, "num_candidates": 2, "depth_schedule": "constant"}


def _ids(text: str) -> list[int]:
    return list(text.encode())


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _hf_logits_cuda(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0].float().cpu()


def _texts(llm: LLM, prompts: list[list[int]], n: int = 32) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _greedy(n))]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, cfg = FAMILIES[request.param]
    model = hf_model(arch, **cfg)
    path = save_hf(tmp_path_factory.mktemp(request.param), model)
    return request.param, model, path


def test_fp32_logits_and_greedy_match_hf_on_cuda(family):
    name, model, path = family
    llm = LLM(str(path), device="cuda", dtype="float32", progress=False, kv_cache_blocks=64, block_size=8)
    assert next(llm.engine.model.parameters()).device.type == "cuda"
    gpu = model.to("cuda")
    try:
        ids = _ids(PROMPTS[0])
        ours = engine_logits(llm, ids, rows=list(range(len(ids) - 6)), n_decode=6)
        ref = _hf_logits_cuda(gpu, ids)
        for r, lg in ours.items():
            assert lg.device.type == "cpu" or lg.is_cuda
            torch.testing.assert_close(lg.float().cpu(), ref[r], atol=1e-3, rtol=1e-3, msg=f"{name} row {r}")
        ids = _ids(PROMPTS[1])
        out = list(ids)
        for _ in range(24):  # HF's own math, re-forwarded each step, on the same device
            out.append(int(_hf_logits_cuda(gpu, out)[-1].argmax()))
        assert _texts(llm, [ids], 24)[0] == out[len(ids):], name
    finally:
        model.to("cpu")


def test_half_kv_cache_on_cuda(family):
    """kv_cache_dtype="float16" under fp32 activations: SDPA reads the cache widened and this forward's
    K/V rounded the same way, so batched and speculative still equal alone."""
    name, model, path = family
    prompts = [_ids(p) for p in PROMPTS]
    llm = LLM(str(path), device="cuda", dtype="float32", progress=False, kv_cache_blocks=64, block_size=8,
              kv_cache_dtype="float16")
    assert llm.engine.cache.k.dtype == torch.float16 and llm.engine.runner.dtype == torch.float32
    alone = [_texts(llm, [p])[0] for p in prompts]
    spec = LLM(str(path), device="cuda", dtype="float32", progress=False, kv_cache_blocks=64, block_size=8,
               decoding="speculative", decoding_options=NGRAM, kv_cache_dtype="float16")
    assert _texts(llm, prompts) == alone, name
    assert _texts(spec, prompts) == alone, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_and_speculative_equal_alone_on_cuda(family, dtype):
    name, model, path = family
    prompts = [_ids(p) for p in PROMPTS]
    llm = LLM(str(path), device="cuda", dtype=dtype, progress=False, kv_cache_blocks=64, block_size=8)
    alone = [_texts(llm, [p])[0] for p in prompts]
    spec = LLM(str(path), device="cuda", dtype=dtype, progress=False, kv_cache_blocks=64, block_size=8,
               decoding="speculative", decoding_options=NGRAM)
    if dtype == "float32":
        assert _texts(llm, prompts) == alone, name
        assert _texts(spec, prompts) == alone, name
        m = spec.engine.strategy.metrics()
        assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
    else:  # bf16: reductions may differ with the row count; the texts must still mostly agree
        got = _texts(spec, prompts)
        same = sum(a == b for x, y in zip(got, alone, strict=True) for a, b in zip(x, y, strict=True))
        assert same >= 0.5 * sum(map(len, alone)), (name, got, alone)


def test_bf16_logits_close_to_hf_bf16(family):
    name, model, path = family
    llm = LLM(str(path), device="cuda", dtype="bfloat16", progress=False, kv_cache_blocks=64, block_size=8)
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
    gpu = model.to(device="cuda", dtype=torch.float32)
    try:
        ids = _ids(PROMPTS[3])
        ours = engine_logits(llm, ids, rows=list(range(len(ids) - 4)), n_decode=4)
        ref = _hf_logits_cuda(gpu, ids)
        worst = max(float((lg.float().cpu() - ref[r]).abs().max() / ref[r].abs().max()) for r, lg in ours.items())
        agree = sum(int(lg.float().cpu().argmax()) == int(ref[r].argmax()) for r, lg in ours.items()) / len(ours)
        assert worst < 0.1 and agree >= 0.9, (name, worst, agree)
    finally:
        model.to("cpu")


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_gguf_blocks_on_cuda_equal_the_cpu_exact_engine(tmp_path, quant):
    model = hf_model("LlamaForCausalLM")
    path = write_gguf(tmp_path / f"tiny-{quant}.gguf", model, quant)
    cpu = LLM(str(path), device="cpu", dtype="float32", numerics="exact", progress=False)
    gpu = LLM(str(path), device="cuda", dtype="float32", progress=False)
    prompts = [_ids(p) for p in PROMPTS]
    assert _texts(gpu, prompts) == _texts(cpu, prompts)


def test_wedlm_engine_equals_reference_on_cuda(tmp_path):
    from ratchetlm.decoding.wedlm_reference import hf_logits_fn, wedlm_generate_reference
    from ratchetlm.decoding.wedlm_window import WeDLMConfig
    from tests.wedlm.factory import make_tiny_wedlm_folder

    path, hf = make_tiny_wedlm_folder(tmp_path / "w", head_scale=150.0)
    opts = dict(window_size=8, entropy_threshold=0.4)
    llm = LLM(str(path), device="cuda", dtype="float32", numerics="exact", progress=False, max_model_len=256,
              decoding="wedlm", decoding_options=opts)
    cfg = llm.model_config
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = _texts(llm, prompts)
    hf.to("cuda")  # the reference's own forward on the same device
    for p, g in zip(prompts, got, strict=True):
        controls = llm.engine.controls.build(params, p, ())
        want = wedlm_generate_reference(hf_logits_fn(hf), p, params, WeDLMConfig(**opts), cfg.mask_token_id,
                                        256, cfg.eos_token_ids, None, controls)
        assert g == want.output_ids


def test_deepseek_v4_refuses_cuda_with_a_clear_error(tmp_path):
    """DeepSeek-V4's paged step builds its metadata on the CPU and is untested on CUDA: refused at
    load with a message naming the device, not a crash mid-step."""
    from tests.deepseek_v4.conftest import build_hf_model

    build_hf_model(seed=0).save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="device='cpu' only"):
        LLM(str(tmp_path), device="cuda", dtype="float32", progress=False, max_num_seqs=2)
