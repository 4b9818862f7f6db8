"""The light GGUF reader agrees with gguf-py's GGUFReader (the oracle) and rejects bad files clearly."""

from __future__ import annotations

import numpy as np
import pytest

from ratchetlm import LLM
from ratchetlm.layers.ggml_types import GGML_TYPES
from ratchetlm.models.gguf_file import ArrayValue, GGUFFile
from ratchetlm.models.loader import ModelLoadError, default_model_path


def test_type_table_equals_gguf_py():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert {q.value: (q.name, *GGML_QUANT_SIZES[q]) for q in GGML_QUANT_SIZES} == GGML_TYPES
    assert all(GGMLQuantizationType(i).name == name for i, (name, _, _) in GGML_TYPES.items())


def test_metadata_and_tensors_match_gguf_reader():
    import gguf

    path = default_model_path()
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
