"""WeDLM fixtures: a tiny random WeDLM-shaped Qwen3 and the model trained here, each loaded once
by the engine and by HF transformers (the reference decoder's independent forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ratchetlm import LLM
from ratchetlm.decoding.wedlm_reference import hf_logits_fn, wedlm_generate_reference
from ratchetlm.decoding.wedlm_window import WeDLMConfig
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.sampling_params import SamplingParams

from .factory import make_tiny_wedlm_folder

TRAINED = Path(__file__).resolve().parents[2] / "ratchetlm" / "assets" / "wedlm-tiny"


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # Tiny forwards: one thread avoids oversubscription on the shared 2-core CI machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Pair:
    """The engine's LLM and the HF model on the same weights."""

    def __init__(self, path: Path, hf_model) -> None:
        self.path = path
        self.llm = LLM(str(path), dtype="float32", progress=False, numerics="exact", max_model_len=256,
                       kv_cache_blocks=128)  # 2048 tokens; the default ~1 GiB is resident memory
        self.hf = hf_model
        self.mask_id = self.llm.model_config.mask_token_id
        self.eos = self.llm.model_config.eos_token_ids

    def engine(self, max_model_len: int = 256, kv_cache_blocks: int = 128, max_num_batched_tokens: int = 2048,
               decoding: str = "wedlm", staging_capacity: int = 1024, **wedlm) -> LLMEngine:
        cfg = EngineConfig(dtype="float32", decoding=decoding, decoding_options=wedlm, kv_cache_blocks=kv_cache_blocks,
                           max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                           block_size=16, staging_capacity=staging_capacity, progress=False)
        return LLMEngine(cfg, self.llm.engine.model, self.llm.model_config, tokenizer=self.llm.tokenizer)

    def reference(self, prompt: list[int], params: SamplingParams, max_model_len: int = 256, seed: int | None = None,
                  **wedlm):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        # the request's logits controls, fresh (the reference judges every mask on its whole path)
        controls = self.llm.engine.controls.build(params, prompt, () if params.ignore_eos else self.eos)
        return wedlm_generate_reference(hf_logits_fn(self.hf), prompt, params, WeDLMConfig(**wedlm), self.mask_id,
                                        max_model_len, self.eos, gen, controls)


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, max_steps: int = 2000):
    """Generate to completion; returns (outputs per prompt, finish reasons, steps)."""
    ids = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < max_steps, "wedlm engine did not finish (hang)"
    return [engine.seqs[i].output_ids for i in ids], [engine.seqs[i].finish_reason for i in ids], steps


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Pair:
    path, hf = make_tiny_wedlm_folder(tmp_path_factory.mktemp("tiny_wedlm"), head_scale=150.0)
    return Pair(path, hf)


@pytest.fixture(scope="session")
def trained() -> Pair:
    from transformers import AutoModelForCausalLM

    assert (TRAINED / "model.safetensors").exists(), f"the shipped WeDLM checkpoint is missing: {TRAINED}"
    hf = AutoModelForCausalLM.from_pretrained(str(TRAINED), dtype=torch.float32).eval()
    return Pair(TRAINED, hf)
