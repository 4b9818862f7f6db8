"""GGUF architectures: a file's metadata and tensor names, as our :class:`ModelConfig` and HF names.

One row per ``general.architecture`` (``reader``: a :class:`~ratchetlm.models.gguf_file.GGUFFile`).
What the file does not say, llama.cpp hard-codes per architecture, and so do the rows (Gemma's
layer patterns, local RoPE base, attention scale). Weights stay in block form (models/loader.py).
Tensor names come from gguf-py's own HF -> GGUF map (the one llama.cpp's converter uses), inverted
over the names of the family's HF checkpoint, so no second name table is kept here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ratchetlm.errors import ModelLoadError
from ratchetlm.layers.rope_scaling import RopeScaling
from ratchetlm.models.config import ModelConfig
from ratchetlm.models.families import FAMILIES
from ratchetlm.models.gguf_file import ArrayValue, GGUFFile

Meta = Callable[[str, Any], Any]  # (key without the "{arch}." prefix, default) -> metadata value


@dataclass(frozen=True)
class GGUFArch:
    hf_architecture: str  # ModelConfig.architecture
    permuted_qk: bool  # llama.cpp's converter permuted Q/K rows for its interleaved RoPE: undo it
    config: Callable[[Meta, GGUFFile], dict[str, Any]]  # family-specific ModelConfig fields (meta, reader)


def _llama(meta: Meta, reader: GGUFFile) -> dict[str, Any]:
    names = reader.tensors
    window = meta("attention.sliding_window", None)  # Mistral-style GGUFs that keep their window
    n = int(meta("block_count", 0))
    return dict(attention_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
                sliding_window=window, layer_types=("sliding_attention",) * n if window else ())


def _gemma(pattern: int, big_layers: int) -> Callable[[Meta, GGUFFile], dict[str, Any]]:
    """Gemma 2 (every other layer local) / Gemma 3 (5 local : 1 global). llama.cpp scales attention
    by key_length ** -0.5, except for the 27B models (by hidden / heads); so does HF's config."""

    def config(meta: Meta, reader: GGUFFile) -> dict[str, Any]:
        n, hidden = int(meta("block_count", 0)), int(meta("embedding_length", 0))
        heads, key_len = int(meta("attention.head_count", 1)), meta("attention.key_length", None)
        window = int(meta("attention.sliding_window", 4096))
        scale_dim = hidden // heads if n == big_layers else int(key_len or hidden // heads)
        out: dict[str, Any] = dict(
            norm_offset=1.0, sandwich_norms=True, embed_scale=hidden**0.5, hidden_act="gelu_tanh",
            query_scale=scale_dim**-0.5, sliding_window=window,
            layer_types=_layer_types(reader, meta, n, pattern),
            attn_logit_softcap=meta("attn_logit_softcapping", None),
            final_logit_softcap=meta("final_logit_softcapping", None),
            qk_norm="blk.0.attn_q_norm.weight" in reader.tensors,
        )
        if pattern == 6:  # Gemma 3: local layers turn with their own base (llama.cpp: 10000 unless given)
            out["rope_local_theta"] = float(meta("rope.freq_base_swa", 10000.0))
        return out

    return config


def _layer_types(reader: GGUFFile, meta: Meta, n: int, period: int) -> tuple[str, ...]:
    """Gemma's local/global layers: ``attention.sliding_window_pattern`` as a period (every
    ``period``-th layer global; llama.cpp's default per architecture) or one flag per layer (newer
    converters: true = sliding)."""
    raw = meta("attention.sliding_window_pattern", None)
    if isinstance(raw, ArrayValue):
        flags = reader.array(f"{reader.get('general.architecture')}.attention.sliding_window_pattern")
        if len(flags) != n or not all(isinstance(f, bool) for f in flags):
            raise ModelLoadError(f"GGUF file {reader.path}: attention.sliding_window_pattern has {len(flags)} "
                                 f"entries for {n} layers (expected one true/false flag per layer)")
        return tuple("sliding_attention" if f else "full_attention" for f in flags)
    period = int(raw or period)
    return tuple("sliding_attention" if (i + 1) % period else "full_attention" for i in range(n))


def _phi3(meta: Meta, reader: GGUFFile) -> dict[str, Any]:
    window = meta("attention.sliding_window", None)
    n = int(meta("block_count", 0))
    return dict(sliding_window=window, layer_types=("sliding_attention",) * n if window else ())


GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", True, _llama),  # Llama 2/3, Mistral, SmolLM
    "qwen2": GGUFArch("Qwen2ForCausalLM", False, _llama),  # q/k/v bias
    "qwen3": GGUFArch("Qwen3ForCausalLM", False, _llama),  # per-head q/k RMSNorm
    "gemma2": GGUFArch("Gemma2ForCausalLM", False, _gemma(2, big_layers=46)),
    "gemma3": GGUFArch("Gemma3ForCausalLM", False, _gemma(6, big_layers=62)),
    "phi3": GGUFArch("Phi3ForCausalLM", False, _phi3),
}


def gguf_arch(reader: GGUFFile) -> tuple[str, GGUFArch]:
    arch = reader.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    return arch, GGUF_ARCHITECTURES[arch]


def gguf_config(reader: GGUFFile) -> ModelConfig:
    arch, info = gguf_arch(reader)

    def meta(key: str, default: Any = None) -> Any:
        return reader.get(f"{arch}.{key}", default)

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in reader.meta:
            raise ModelLoadError(f"GGUF file {reader.path} lacks metadata {arch + '.' + key!r}")
        return reader.meta[f"{arch}.{key}"]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(meta("attention.key_length", 0) or hidden // heads)
    rotary = int(meta("rope.dimension_count", head_dim))
    names = reader.tensors
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"GGUF file {reader.path} has no token_embd.weight tensor")
    vocab = names["token_embd.weight"].shape[0]  # the table's rows define the vocabulary
    eos = reader.get("tokenizer.ggml.eos_token_id")
    fields: dict[str, Any] = dict(
        architecture=info.hf_architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rotary_dim=rotary if rotary < head_dim else 0,
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(reader, meta),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=reader.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )
    fields.update(info.config(meta, reader))
    return ModelConfig(**fields)


def gguf_rope_scaling(reader: GGUFFile, meta: Meta) -> RopeScaling | None:
    """RoPE scaling from ``{arch}.rope.scaling.*`` and llama.cpp's factor tensors: ``rope_freqs``
    (per-frequency divisors: how Llama 3.x files carry ``llama3`` scaling) and Phi-3's
    ``rope_factors_short`` / ``rope_factors_long`` (LongRoPE)."""
    tensors = reader.tensors

    def factors(name: str) -> tuple[float, ...]:
        return tuple(float(x) for x in tensors[name].dense().reshape(-1))

    kind = meta("rope.scaling.type", "none")
    factor = float(meta("rope.scaling.factor", 1.0) or 1.0)
    orig = int(meta("rope.scaling.original_context_length", 0) or 0)
    if "rope_factors_long.weight" in tensors:
        attn = meta("rope.scaling.attn_factor", None)
        return RopeScaling("longrope", factor=int(meta("context_length", orig)) / max(orig, 1),
                           original_max_position_embeddings=orig,
                           short_factor=factors("rope_factors_short.weight"),
                           long_factor=factors("rope_factors_long.weight"),
                           attention_factor=None if attn is None else float(attn))
    if "rope_freqs.weight" in tensors:
        if kind not in ("none", "linear") or factor != 1.0:
            raise ModelLoadError(f"GGUF has both rope_freqs and rope scaling {kind!r} x{factor}: not supported")
        return RopeScaling("freq_factors", freq_factors=factors("rope_freqs.weight"))
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        # llama.cpp's attn_factor multiplies YaRN's own 0.1 ln(factor) + 1
        attn = float(meta("rope.scaling.attn_factor", 1.0)) * (0.1 * math.log(factor) + 1.0)
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=orig,
                           beta_fast=float(meta("rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(meta("rope.scaling.yarn_beta_slow", 1.0)), attention_factor=attn)
    raise ModelLoadError(f"unsupported GGUF rope scaling type {kind!r}; supported: none, linear, yarn, longrope")


@lru_cache(maxsize=16)
def _hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor stem -> HF stem (``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``), by
    inverting gguf-py's map over the HF names the family's checkpoints use."""
    import gguf

    info = GGUF_ARCHITECTURES[arch]
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    tmap = gguf.get_tensor_name_map(arch_enum, num_layers)
    hf = ["model.embed_tokens", "model.norm", "lm_head"]
    hf += [f"model.layers.{i}.{n}" for i in range(num_layers) for n in FAMILIES[info.hf_architecture].layer_names]
    out: dict[str, str] = {}
    for name in hf:
        g = tmap.get_name(name)
        if g is not None:
            out[g] = name
    return out


def gguf_target(name: str, cfg: ModelConfig) -> tuple[str | None, int | None]:
    """HF tensor name for a GGUF tensor (None = not a weight: RoPE factor tensors, read into the
    config) and, for permuted Q/K, the head count whose row permutation must be undone."""
    arch = next(a for a, i in GGUF_ARCHITECTURES.items() if i.hf_architecture == cfg.architecture)
    stem, _, suffix = name.rpartition(".")
    if stem in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
        return None, None
    hf = _hf_names(arch, cfg.num_layers).get(stem)
    if hf is None:
        raise ModelLoadError(f"unexpected GGUF tensor {name!r} for architecture {arch!r}")
    heads = None
    if GGUF_ARCHITECTURES[arch].permuted_qk:
        heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}.get(hf.split(".", 3)[-1])
    return f"{hf}.{suffix}", heads


def stored_norm_offset(hf_name: str, cfg: ModelConfig) -> float:
    """What llama.cpp's converter added to a norm weight (Gemma stores ``1 + w``); our RMSNorm
    applies ``cfg.norm_offset`` itself, so the loader subtracts it."""
    return cfg.norm_offset if hf_name.endswith("norm.weight") else 0.0
