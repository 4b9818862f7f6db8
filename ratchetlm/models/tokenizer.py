"""Tokenizer and chat template for a model source.

GGUF files carry their vocabulary, merges and chat template as metadata; transformers'
GGUF converter turns that into a fast tokenizer. Conversion takes ~15 s, so the converted
tokenizer is cached on disk, keyed by the GGUF file's path, size and mtime and the transformers version.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ratchetlm.models.loader import ModelLoadError, ModelSource


def cache_root() -> Path:
    base = os.environ.get("RATCHETLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ratchetlm"
    )
    return Path(base)


def converter_version() -> str:
    """The installed transformers release (the GGUF vocabulary converter), from its package metadata."""
    from importlib.metadata import version

    return version("transformers")


def converted_path(gguf: Path) -> Path:
    """Where the tokenizer converted from ``gguf`` is kept. The converter's version is part of the
    key: transformers releases convert GGUF vocabularies differently (5.16 and 5.17 read SmolLM2's
    eos as <|im_start|>), and a converted copy must not outlive the release that made it."""
    st = gguf.stat()
    ident = f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{converter_version()}"
    return cache_root() / "tokenizers" / hashlib.sha1(ident.encode()).hexdigest()[:16]


def load_tokenizer(source: ModelSource) -> Any:
    """Return a HF fast tokenizer (``encode``/``decode``/``apply_chat_template``)."""
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoTokenizer

    if source.kind == "hf":
        if not (source.path / "tokenizer.json").is_file() and not (source.path / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"model folder {source.path} has no tokenizer.json")
        return AutoTokenizer.from_pretrained(str(source.path))
    cached = converted_path(source.path)
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, cached)
    except OSError:
        pass  # another process won the race; its copy is identical
    return tok
