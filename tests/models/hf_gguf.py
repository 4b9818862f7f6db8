"""HF transformers' GGUF loader as the tests' oracle, without the waste around it.

``from_pretrained(gguf_file=...)`` (transformers 5.24's legacy path, the one SmolLM2's Llama and
Gemma 3 take) reads the file's metadata with gguf-py's ``GGUFReader``, which slices every field of
the file out of a ``numpy.memmap``: each slice goes through the memmap subclass's Python
``__getitem__``/``__array_finalize__``, three per vocabulary string, and transformers' value parser
indexes those memmap slices again. For Gemma 3's 262k-token vocabulary the reader takes ~28 s of CPU,
9 s on a plain array over the same mapping. The loader also parses the file again for the weights
after the config (and the tokenizer a third time), and builds gguf-py's tensor name table once per
module of the model (``get_tensor_name_map`` in ``get_gguf_hf_weights_map``, recursing over ~400
modules: ~14 s of CPU for SmolLM2).

:func:`gguf_parsed_once` removes that waste and nothing else: the same bytes parsed by the same
gguf-py and transformers code (the reader's fields and tensors are element for element those of the
memmap reader), one reader per file and one name table per (architecture, layer count), both
only read by their callers."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any


class _PlainMap:
    """gguf-py's ``np`` inside gguf_reader, except that ``memmap`` returns a plain ndarray view of the
    mapping (same bytes, read-only as mapped; the view keeps the mapping alive)."""

    def __init__(self, np: Any) -> None:
        self._np = np

    def __getattr__(self, name: str) -> Any:
        return getattr(self._np, name)

    def memmap(self, *args: Any, **kwargs: Any) -> Any:
        return self._np.memmap(*args, **kwargs).view(self._np.ndarray)


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, gguf-py's ``GGUFReader`` reads through a plain array and returns its first
    reader of a path again, and ``get_tensor_name_map`` its first map for the same arguments
    (transformers imports both from ``gguf`` at call time). Restored on exit, the readers dropped."""
    import gguf
    from gguf import gguf_reader

    reader, names, np = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_reader.np
    gguf_reader.np = _PlainMap(np)  # type: ignore[assignment]
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)  # type: ignore[misc]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf_reader.np = reader, names, np  # type: ignore[misc]
