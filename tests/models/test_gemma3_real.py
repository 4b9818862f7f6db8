"""The real Gemma 3 270M (Q4_K_M GGUF made by llama.cpp) equals HF transformers' GGUF loader on the
same file: logits at positions before and past the 512-token sliding window, from prefill and from
paged decode steps, and greedy text; ``/v1/completions`` on a text prompt with HF's default
tokenization (the BOS the file's metadata asks for) gives HF's greedy text and prompt log-probs;
n-gram speculative decoding gives the same text; and its
llama.cpp-made Q4_K / Q5_0 / Q6_K / Q8_0 tensors are the real-weights fixture of the block kernels
(dequantized bit for bit like gguf-py, matmul close to fp64 and batch-invariant). The HF side
runs in its own process (tests/models/gemma3_hf_reference.py) to keep the test process's peak memory
to one model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ratchetlm import LLM, SamplingParams
from tests.models.gemma3_hf_reference import GREEDY_PROMPT, GREEDY_TOKENS, SHORT, SHORT_TOKENS, TEXT
from tests.models.tiny import engine_logits, engine_on, run


@pytest.fixture(scope="module")
def reference(gemma3_270m_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3") / "reference.pt"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "tests.models.gemma3_hf_reference", str(gemma3_270m_path), str(out)],
                   check=True, cwd=root, env=env)
    ref = torch.load(out)
    assert ref["sliding_window"] == 512 and len(ref["ids"]) > 700
    ref["tokenizer_dir"] = out.with_name("hf_tokenizer")
    return ref


@pytest.fixture(scope="module")
def gemma(gemma3_270m_path, reference):
    # The engine keeps the tokenizer transformers' converter makes from the file in its cache
    # (ratchetlm/models/tokenizer.py); where it has none yet, it gets the one the HF process converted (the
    # same converter, same release: ~25 s of CPU saved, not a different tokenizer). The tokenization itself
    # is still checked against HF's (test_config_read_from_the_file, the endpoint test).
    from ratchetlm.models.tokenizer import converted_path

    cached = converted_path(Path(gemma3_270m_path))
    if not (cached / "tokenizer.json").is_file():
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        shutil.copytree(reference["tokenizer_dir"], tmp)
        try:
            os.replace(tmp, cached)
        except OSError:  # another process converted it meanwhile: its copy is the same
            shutil.rmtree(tmp, ignore_errors=True)
    return LLM(str(gemma3_270m_path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=128)


def test_config_read_from_the_file(gemma, reference):
    c = gemma.model_config
    assert c.architecture == "Gemma3ForCausalLM" and c.sliding_window == 512 and c.qk_norm
    assert c.layer_types.count("full_attention") == 3 and c.layer_types[5] == "full_attention"
    assert (c.rope_theta, c.rope_local_theta, c.query_scale) == (1e6, 10000.0, 256**-0.5)
    # HF's default tokenization starts with the BOS (the file's add_bos_token), and so does ours
    assert reference["ids"][0] == gemma.tokenizer.bos_token_id and reference["ids"] == gemma.tokenize(TEXT)


def test_logits_match_hf_gguf_before_and_past_the_window(gemma, reference):
    ids, rows = reference["ids"], reference["rows"]
    ours = engine_logits(gemma, ids, rows=rows[:-5], n_decode=4)  # prefill rows, its last row, 4 decode steps
    assert sorted(ours) == rows
    for lg, r, ref in zip([ours[r] for r in rows], rows, reference["logits"], strict=True):
        # fp32 both sides, the same dequantized weights; logits of magnitude ~30, observed |diff| ~5e-5
        assert torch.allclose(lg, ref, atol=5e-4, rtol=0), (r, (lg - ref).abs().max())


def test_greedy_and_ngram_speculative_match_hf(gemma, reference):
    prompt, gen = reference["ids"][:GREEDY_PROMPT], reference["greedy"]
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    assert gemma.generate([prompt], params)[0].outputs[0].token_ids == gen
    spec = engine_on(gemma, kv_cache_blocks=64, decoding="speculative",
                     decoding_options={"method": "ngram", "depth": 4, "depth_schedule": "constant"})
    assert run(spec, [prompt], GREEDY_TOKENS) == [gen]
    assert spec.strategy.metrics()["spec_decode_num_accepted_tokens"] > 0


def test_completions_endpoint_equals_hf_with_default_tokenization(gemma, reference):
    """``/v1/completions`` on a text prompt, as a client sends it: the prompt gets the BOS, and the
    greedy text and the echoed prompt log-probs are HF transformers' (fp32 both sides)."""
    import httpx

    from tests.server.test_inprocess import serve

    with serve(gemma, "gemma") as base:
        tok = httpx.post(base + "/tokenize", json={"prompt": SHORT}, timeout=60).json()
        assert tok["tokens"] == reference["short_ids"]  # /tokenize shows exactly what is fed
        r = httpx.post(base + "/v1/completions", json={"model": "gemma", "prompt": SHORT, "max_tokens": SHORT_TOKENS,
                                                       "temperature": 0, "echo": True, "logprobs": 1}, timeout=600)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == SHORT + reference["short_text"]
        assert r.json()["usage"]["prompt_tokens"] == len(reference["short_ids"])
        n = len(reference["short_ids"])
        lps = choice["logprobs"]["token_logprobs"]
        assert lps[0] is None  # the BOS: nothing before it
        assert lps[1:n] == pytest.approx(reference["short_prompt_logprobs"], abs=2e-4)
        bare = httpx.post(base + "/v1/completions", json={"model": "gemma", "prompt": SHORT, "max_tokens": 1,
                                                          "add_special_tokens": False}, timeout=600)
        assert bare.json()["usage"]["prompt_tokens"] == n - 1  # vLLM's switch: no BOS
    out = gemma.generate(SHORT, SamplingParams(max_tokens=SHORT_TOKENS, temperature=0))[0]
    assert out.prompt_token_ids == reference["short_ids"]
    assert list(out.outputs[0].token_ids[:len(reference["short_greedy"])]) == reference["short_greedy"]


def test_block_kernels_on_the_files_own_tensors(gemma3_270m_path):
    """Every 2-D format of the file, on each of its tensors of that format (the embedding: its first
    4096 rows), read in place through the light GGUF reader."""
    import numpy as np
    import torch.nn.functional as F
    from gguf.quants import dequantize

    from ratchetlm.layers.block_quant import BlockWeight, block_matmul
    from ratchetlm.models.gguf_file import GGUFFile

    f = GGUFFile(gemma3_270m_path)
    seen: dict[str, int] = {}
    for t in f.tensors.values():
        if len(t.shape) != 2:
            continue
        seen[t.type_name] = seen.get(t.type_name, 0) + 1
        raw = t.data[:4096]
        w = BlockWeight.from_gguf(t.type_name, raw, t.shape[1])
        dense = w.dequantize()
        ref = np.asarray(dequantize(np.asarray(raw), t.ggml_type), dtype=np.float32)
        assert np.array_equal(dense.numpy().view(np.uint32), ref.view(np.uint32)), t.name
        if seen[t.type_name] > 2:  # the matmul on the first two tensors of each format
            continue
        x = torch.randn(33, t.shape[1], generator=torch.Generator().manual_seed(len(seen)))
        got = block_matmul(x, w)
        err = (got.double() - F.linear(x.double(), dense.double())).abs()
        assert (err <= 1e-5 * F.linear(x.double().abs(), dense.double().abs())).all(), t.name
        assert torch.equal(block_matmul(x[3:4], w), got[3:4]), t.name  # a row alone == among 33
    assert set(seen) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
