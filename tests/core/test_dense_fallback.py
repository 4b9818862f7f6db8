"""Where the weights cannot stay in their stored form (no C compiler for the block kernels, or
``gguf_kernels=False``), every tensor becomes a dense copy: the loader refuses one larger than the
memory left on the host with an error naming the cause, before allocating it (instead of the OOM
killer), and a ``CC`` that names no executable falls back to the system compiler."""

from __future__ import annotations

import shutil

import pytest
import torch

from ratchetlm import kernels
from ratchetlm.memory import host_memory
from ratchetlm.models import registry
from ratchetlm.models.loader import ModelLoadError, default_model_path

MiB = 2**20


def _load(**kw):
    return registry.load_model(str(default_model_path()), torch.device("cpu"), torch.float32, progress=False, **kw)


def test_a_dense_copy_larger_than_the_free_memory_is_refused_naming_why(monkeypatch):
    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kernels.build, "_compiler", lambda: None)
    monkeypatch.setattr(registry, "available_bytes", lambda: 100 * MiB)
    with pytest.raises(ModelLoadError) as e:
        _load()
    msg = str(e.value)
    # SmolLM2-135M as fp32: 134.5M parameters, 0.5 GiB
    assert default_model_path().name in msg and "dense 0.5 GiB copy" in msg and "0.1 GiB" in msg
    assert "no C compiler was found" in msg


def test_gguf_kernels_false_is_checked_too(monkeypatch):
    monkeypatch.setattr(registry, "available_bytes", lambda: 100 * MiB)
    with pytest.raises(ModelLoadError, match="gguf_kernels=False"):
        _load(gguf_kernels=False)


def test_weights_kept_as_blocks_do_not_count(monkeypatch):
    if kernels.load() is None:  # asked here, not in a skipif (evaluated at collection: it would build them)
        pytest.skip("needs the block kernels")
    # the quantized matrices stay in the file's blocks: only norms (and nothing else) are dense
    monkeypatch.setattr(registry, "available_bytes", lambda: 1 * MiB)
    assert _load(numerics="int16").model.numerics == "int16"


def test_enough_memory_loads_dense(monkeypatch):
    monkeypatch.setattr(registry, "available_bytes", lambda: 64 * 2**30)
    assert _load(gguf_kernels=False).model.numerics == "exact"


def test_available_bytes_reads_the_host():
    have = host_memory.available_bytes()
    assert have is None or have > 0


def test_a_CC_that_is_no_executable_falls_back_to_the_system_compiler(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert kernels.build._compiler() == (shutil.which("cc") or shutil.which("gcc"))
    assert "CC='/nonexistent/cc' is not an executable" in caplog.text


def test_an_fp32_checkpoint_too_big_is_refused_naming_its_form(monkeypatch, tmp_path):
    from tests.wedlm.factory import make_tiny_wedlm_folder

    path, _ = make_tiny_wedlm_folder(tmp_path / "tiny")  # fp32 safetensors: dense is its stored form
    monkeypatch.setattr(registry, "available_bytes", lambda: 1024)
    with pytest.raises(ModelLoadError, match="stored as float32"):
        registry.load_model(str(path), torch.device("cpu"), torch.float32, progress=False)
