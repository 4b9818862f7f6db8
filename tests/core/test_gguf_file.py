"""The light GGUF reader agrees with gguf-py's GGUFReader (the oracle) and rejects bad files clearly."""

from __future__ import annotations

import numpy as np
import pytest

from ratchetlm import LLM
from ratchetlm.layers.ggml_types import GGML_TYPES
from ratchetlm.models.gguf_file import ArrayValue, GGUFFile, GGUFFormatError
from ratchetlm.models.loader import ModelLoadError, default_model_path
from tests.models.hf_gguf import gguf_parsed_once


def test_type_table_equals_gguf_py():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert {q.value: (q.name, *GGML_QUANT_SIZES[q]) for q in GGML_QUANT_SIZES} == GGML_TYPES
    assert all(GGMLQuantizationType(i).name == name for i, (name, _, _) in GGML_TYPES.items())


def test_metadata_and_tensors_match_gguf_reader():
    import gguf

    path = default_model_path()
    with gguf_parsed_once():  # gguf-py's parser on a plain array over the mapping (not its slow memmap slices)
        ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # GGUFReader adds header pseudo-fields
    assert list(ours.meta) == list(fields)
    for key, field in fields.items():
        if isinstance(ours.meta[key], ArrayValue):
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "general.languages"):
                assert ours.array(key) == list(field.contents())
            else:
                assert ours.meta[key].count == len(field.data)
        else:
            assert ours.meta[key] == pytest.approx(field.contents()) if isinstance(ours.meta[key], float) \
                else ours.meta[key] == field.contents()
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors[:12]:
        mine = ours.tensors[t.name]
        assert mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(reversed([int(d) for d in t.shape]))
        assert np.array_equal(mine.data.reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))
        assert not mine.data.flags.writeable and not mine.data.flags.owndata  # a view of the mapped file


def test_bad_files_get_a_clear_error(tmp_path):
    bad = tmp_path / "notgguf.gguf"
    bad.write_bytes(b"hello world, not a model" * 4)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LLM(str(bad), progress=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_model_path().read_bytes()[:4096])
    with pytest.raises(ModelLoadError, match="truncated|outside the file"):
        LLM(str(cut), progress=False)


def _header_bytes(n: int = 1_300_000) -> bytes:
    with open(default_model_path(), "rb") as f:  # the default model's header ends at ~1.2 MB
        return f.read(n)


def _open(tmp_path, data: bytes) -> str:
    """'ok', or the GGUFFormatError's message; any other exception fails the test."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    try:
        GGUFFile(path)
    except GGUFFormatError as e:
        assert str(path) in str(e)
        return str(e)
    return "ok"


def test_a_file_cut_anywhere_in_its_header_is_named_truncated(tmp_path):
    """Issue 40: a cut header, or one whose tail is zeros (a download that preallocated the file),
    was an IndexError or OverflowError from the walk; every cut gives a GGUFFormatError saying so."""
    data = _header_bytes()
    for cut in [*range(24, 600, 7), *range(600, len(data), 26_183)]:
        assert "truncated" in _open(tmp_path, data[:cut]), cut
        assert "truncated" in _open(tmp_path, data[:cut] + bytes(len(data) - cut)), cut
    assert "empty" in _open(tmp_path, b"")


def test_corrupt_header_bytes_give_a_format_error(tmp_path):
    """Random bytes in the header's first 2 kB (metadata counts, lengths, types): the file opens or
    fails with GGUFFormatError, never another exception (an OverflowError before this check)."""
    import random

    data = _header_bytes()
    rng = random.Random(40)
    for _ in range(120):
        b = bytearray(data)
        for _ in range(3):
            b[rng.randrange(4, 2000)] = rng.randrange(256)
        _open(tmp_path, bytes(b))
