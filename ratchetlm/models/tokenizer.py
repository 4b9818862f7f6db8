"""Tokenizer and chat template for a model source.

GGUF files carry their vocabulary, merges and chat template as metadata; transformers'
GGUF converter turns that into a fast tokenizer. Conversion takes ~15 s, so the converted
tokenizer is cached on disk, keyed by the GGUF file's path, size and mtime.
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


def load_tokenizer(source: ModelSource) -> Any:
    """Return a HF fast tokenizer (``encode``/``decode``/``apply_chat_template``)."""
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import AutoTokenizer

    if source.kind == "hf":
        if not (source.path / "tokenizer.json").is_file() and not (source.path / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"model folder {source.path} has no tokenizer.json")
        return AutoTokenizer.from_pretrained(str(source.path))
    st = source.path.stat()
    key = hashlib.sha1(f"{source.path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_root() / "tokenizers" / key
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
