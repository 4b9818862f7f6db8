"""Tensor-parallel fixtures: a tiny random GGUF Llama (Q8_0 block weights, 4 query heads sharing 1
KV head, untied head) and helpers that build engines on a loaded (possibly tensor-parallel) model."""

from __future__ import annotations

import psutil
import pytest
import torch

from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from tests.models.tiny import hf_model, write_gguf


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # tiny forwards on a shared 2-core machine: one thread per rank avoids oversubscription
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """Q8_0 (32-weight blocks): each of 2 ranks holds 2 query heads (32 input columns of O) and 64
    MLP rows, block-aligned; the one KV head is replicated on both ranks."""
    model = hf_model("LlamaForCausalLM", num_key_value_heads=1, tie_word_embeddings=False)
    return str(write_gguf(tmp_path_factory.mktemp("tp") / "tiny-q8.gguf", model, quant="Q8_0"))


def engine_on(llm, **kwargs) -> LLMEngine:
    """A fresh engine (own KV cache on every rank, own strategy) on ``llm``'s loaded model."""
    cfg = EngineConfig(**{"dtype": "float32", "progress": False, **kwargs})
    return LLMEngine(cfg, llm.engine.model, llm.model_config, parallel=getattr(llm.engine.runner, "group", None))


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
