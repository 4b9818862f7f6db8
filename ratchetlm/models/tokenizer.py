"""Tokenizer and chat template for a model source.

GGUF files carry their vocabulary, merges and chat template as metadata; transformers'
GGUF converter turns that into a fast tokenizer. Which special tokens a text prompt gets (the BOS)
is read from the metadata (:func:`special_tokens`), not left to the converter. Conversion takes ~15 s, so the converted
tokenizer is cached on disk, keyed by the GGUF file's path, size and mtime and the transformers version.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
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


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens the tokenizer adds around a text prompt (``add_special_tokens=True``):
    ``prefix`` (the BOS, when the model wants one) and ``suffix`` (an EOS, rarely)."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()


# llama.cpp's defaults when a GGUF lacks ``tokenizer.ggml.add_bos_token``: SentencePiece vocabularies
# (``llama``) start with BOS, and so do BPE vocabularies with Llama 3's pre-tokenizer; others do not
_BOS_BY_DEFAULT_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3"})


def special_tokens(source: ModelSource, tokenizer: Any) -> SpecialTokens:
    """What ``add_special_tokens=True`` adds to a text prompt, per the tokenizer's own metadata:
    a GGUF's ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (read as llama.cpp reads them);
    an HF folder's tokenizer as HF transformers runs it (its post-processor, which honours
    ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token``)."""
    if source.kind == "gguf":
        from ratchetlm.models.gguf_file import GGUFFile

        f = GGUFFile(source.path)
        model, pre = f.get("tokenizer.ggml.model"), f.get("tokenizer.ggml.pre")
        add_bos = f.get("tokenizer.ggml.add_bos_token", model == "llama" or pre in _BOS_BY_DEFAULT_PRE)
        add_eos = f.get("tokenizer.ggml.add_eos_token", False)
        bos, eos = f.get("tokenizer.ggml.bos_token_id"), f.get("tokenizer.ggml.eos_token_id")
        return SpecialTokens((int(bos),) if add_bos and bos is not None else (),
                             (int(eos),) if add_eos and eos is not None else ())
    return probe_special_tokens(tokenizer)


def probe_special_tokens(tokenizer: Any) -> SpecialTokens:
    """The tokens HF's tokenizer puts around a text of its own (``with = prefix + without + suffix``)."""
    without = list(tokenizer.encode("a", add_special_tokens=False))
    with_ = list(tokenizer.encode("a", add_special_tokens=True))
    for k in range(len(with_) - len(without) + 1):
        if with_[k:k + len(without)] == without:
            return SpecialTokens(tuple(with_[:k]), tuple(with_[k + len(without):]))
    raise ModelLoadError(f"cannot tell which special tokens the tokenizer adds: {with_} vs {without}")


def other_tokenizer(ref: str, model_source: ModelSource, vocab_size: int) -> tuple[Any, ModelSource] | None:
    """vLLM's ``tokenizer=``: a local GGUF file or a folder with ``tokenizer.json`` (None when it names
    the model's own path). Its vocabulary must fit the model's. Returns it and its source."""
    from ratchetlm.models.loader import resolve

    path = Path(ref).expanduser()
    if path.resolve() in (model_source.path.resolve(), model_source.path.parent.resolve()):
        return None
    if path.is_dir() and (path / "tokenizer.json").is_file() and not (path / "config.json").is_file():
        source = ModelSource("hf", path)
    else:
        source = resolve(ref)
    tok = load_tokenizer(source)
    if len(tok) > vocab_size:
        raise ModelLoadError(f"tokenizer {ref!r} has {len(tok)} tokens but the model's vocabulary is {vocab_size}")
    return tok, source
