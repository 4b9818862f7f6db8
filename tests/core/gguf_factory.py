"""Tiny random-weight GGUF files written with gguf-py's GGUFWriter, for tests.

Weights are random but valid in every supported format: the simple formats are gguf-py
quantizations of random normals, the K-quants (which gguf-py cannot quantize) are random blocks
with fp16 scales chosen so the weights are ~0.05 in size. The vocabulary is a tiny byte-level BPE
(256 byte tokens, one merge, 2 specials) so that tokenizer conversion takes no time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# scale magnitudes for random K-quant blocks: (byte offset of each fp16 scale, its magnitude)
_K_SCALES = {"Q2_K": ((80, 3e-3), (82, 3e-3)), "Q3_K": ((108, 5e-4),), "Q4_K": ((0, 1e-4), (2, 1e-4)),
             "Q5_K": ((0, 5e-5), (2, 5e-5)), "Q6_K": ((208, 1e-5),)}
VOCAB = 259  # 256 byte tokens, one merge, <bos>, <eos>
BOS, EOS = 257, 258


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable-unicode map, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def encode_tensor(name: str, w: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for GGUFWriter.add_tensor: ``w`` quantized to ``type_name`` (K-quants: random)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    q = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), None
    if type_name == "F16":
        return w.astype(np.float16), None
    if type_name in _K_SCALES or type_name.startswith("IQ"):  # formats gguf-py cannot quantize: random blocks
        blck, nbytes = GGML_QUANT_SIZES[q]
        n, k = w.shape
        raw = rng.integers(0, 256, (n, k // blck, nbytes), dtype=np.uint8)
        for off, mag in _K_SCALES.get(type_name, ()):
            raw[..., off:off + 2] = rng.uniform(0.5 * mag, mag, (n, k // blck, 1)).astype(np.float16).view(np.uint8)
        return raw.reshape(n, -1), q
    return quantize(w.astype(np.float32), q), q


def write_tiny_gguf(path: Path, arch: str, types: list[str], *, hidden: int = 256, inter: int = 512,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                    tied: bool = True, seed: int = 0, override: dict[str, str] | None = None,
                    pre: str = "default", add_bos: bool | None = None, chat_template: str | None = None,
                    metadata: dict[str, float | int] | None = None) -> Path:
    """A ``arch`` model (llama / qwen2 / qwen3 layout) whose 2-D tensors cycle through ``types``;
    ``override`` names the format of particular tensors (e.g. an unsupported one). ``pre``,
    ``add_bos`` (``tokenizer.ggml.add_bos_token``, absent when None) and ``chat_template`` are
    written as the tokenizer's metadata; ``metadata``: more keys (a float is written as float32, an int
    as int32), e.g. ``general.sampling.temp``."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(_byte_tokens() + ["Ġt", "<bos>", "<eos>"])
    w.add_token_types([1] * 257 + [3, 3])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(key, value)

    def normal(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    cycle = iter(types * 100)

    def add(name: str, arr: np.ndarray, type_name: str | None = None) -> None:
        type_name = (override or {}).get(name) or type_name or next(cycle)
        data, raw = encode_tensor(name, arr, type_name, rng) if arr.ndim == 2 else (arr, None)
        w.add_tensor(name, data, raw_dtype=raw)

    q, kv = heads * head_dim, kv_heads * head_dim
    add("token_embd.weight", normal(VOCAB, hidden, scale=1.0), "Q8_0")
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", 1 + normal(hidden, scale=0.1))
        add(b + "attn_q.weight", normal(q, hidden))
        add(b + "attn_k.weight", normal(kv, hidden))
        add(b + "attn_v.weight", normal(kv, hidden))
        if arch == "qwen2":
            for t, n in (("q", q), ("k", kv), ("v", kv)):
                add(b + f"attn_{t}.bias", normal(n, scale=0.1))
        if arch == "qwen3":
            add(b + "attn_q_norm.weight", 1 + normal(head_dim, scale=0.1))
            add(b + "attn_k_norm.weight", 1 + normal(head_dim, scale=0.1))
        add(b + "attn_output.weight", normal(hidden, q))
        add(b + "ffn_norm.weight", 1 + normal(hidden, scale=0.1))
        add(b + "ffn_gate.weight", normal(inter, hidden))
        add(b + "ffn_up.weight", normal(inter, hidden))
        add(b + "ffn_down.weight", normal(hidden, inter))
    add("output_norm.weight", 1 + normal(hidden, scale=0.1))
    if not tied:
        add("output.weight", normal(VOCAB, hidden, scale=0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
