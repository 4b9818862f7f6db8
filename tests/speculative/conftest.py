"""Speculative-decoding fixtures. One torch thread: on the shared 2-core CPU, two threads
contending with other processes make small ops orders of magnitude slower."""

from __future__ import annotations

import pytest
import torch

from ratchetlm import LLM
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.sampling_params import SamplingParams
from tests.conftest import make_tiny_hf_folder

from .prompts import PROMPTS

torch.set_num_threads(1)


GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


def make_engine(llm, decoding: str = "autoregressive", kv_cache_blocks: int = 192, max_num_seqs: int = 32,
                staging_capacity: int = 1024, jump_forward: bool = True, **options) -> LLMEngine:
    """A fresh engine (own small KV cache) on an already loaded model. Speculative tests draft
    with a constant depth unless they name a schedule: they test what a given draft does (the
    default "auto" schedule may skip drafts; tests/speculative/test_gain_schedule.py covers it).
    Tests that name the gain schedule price verified rows at the old constant: the measured cost
    curve (the default) would make their draft lengths depend on how busy the machine is, and
    measuring it costs every test process a probe."""
    if decoding == "speculative":
        options.setdefault("depth_schedule", "constant")
        options.setdefault("verify_token_cost", 0.09)
    cfg = EngineConfig(device="cpu", dtype="float32", decoding=decoding, decoding_options=options,
                       kv_cache_blocks=kv_cache_blocks, max_num_seqs=max_num_seqs, staging_capacity=staging_capacity,
                       progress=False, jump_forward=jump_forward)
    return LLMEngine(cfg, llm.engine.model, llm.model_config, tokenizer=llm.tokenizer)


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Generate to completion; output ids per prompt, in order."""
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.seqs[i].output_ids for i in ids]


@pytest.fixture(scope="session")
def spec_llm(llm_default):
    """The model in the engine's default numerics (``auto``: int8 on the bundled Q4_1 file), the mode users
    run. Speculative == plain holds in every mode because each row's result is independent of the rows beside
    it; the exact (HF-identical) mode's own equalities run on ``exact_llm`` below (the EAGLE head, the draft
    model, the penalties, and grammars under the proposers that are models) and in tests/core against HF.
    (int8 forwards cost ~0.4x exact fp32 ones on one thread: tests/speculative 657 -> ~400 CPU-s,
    docs/benchmarks.md "spec8".)"""
    return llm_default


@pytest.fixture(scope="session")
def encoded(spec_llm) -> list[list[int]]:
    return [spec_llm.tokenize(p) for p in PROMPTS]


@pytest.fixture(scope="session")
def reference(spec_llm, encoded) -> list[list[int]]:
    """Plain greedy outputs (``GREEDY``) of every prompt, batched: the oracle of the equality tests."""
    return run_engine(make_engine(spec_llm), encoded, GREEDY)


@pytest.fixture(scope="session")
def exact_llm(llm_fp32):
    """The model in the exact (HF-identical) fp32 mode: the EAGLE head's features are compared with a
    teacher-forced fp32 pass, and a draft model loaded from the same file drafts in that mode."""
    return llm_fp32


@pytest.fixture(scope="session")
def exact_reference(exact_llm, encoded) -> list[list[int]]:
    """``reference`` in the exact mode (the same file's vocabulary: ``encoded`` are its tokens too)."""
    return run_engine(make_engine(exact_llm), encoded, GREEDY)


@pytest.fixture(scope="session")
def tiny_sampler(tmp_path_factory) -> tuple[str, LLM, torch.nn.Module]:
    """(folder, loaded LLM, HF model): the target of the statistical sampling tests (test_sampling_e2e.py,
    test_controls_sampling.py), a tiny random-weight Llama (3 layers, hidden 64) with a 258-token byte
    vocabulary, in the exact mode; loaded again from the folder it is also their draft model. What they test
    is the algorithm (speculative sampling gives the target's law), which no vocabulary size changes, while a
    small one makes each of their thousands of sampled requests cheap (with the SmolLM2 vocabulary's 49k-wide
    lm_head, softmax, top-k, multinomial and fp64 residual per row, a 300-request run cost ~4x as much)."""
    from tests.models.tiny import BOS, EOS, byte_tokenizer

    path, hf = make_tiny_hf_folder(tmp_path_factory.mktemp("tiny_sampler"), "LlamaForCausalLM", byte_tokenizer(),
                                   bos_token_id=BOS, eos_token_id=EOS)
    return str(path), LLM(str(path), progress=False, numerics="exact", dtype="float32", kv_cache_blocks=8), hf
