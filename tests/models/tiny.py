"""Tiny random-weight models of each family, as HF folders and as GGUF files, plus the helpers
the family tests share. No small real checkpoint of these families exists for CI, so the tests
write their own; HF transformers on the same weights is the oracle.

GGUF files are written the way llama.cpp's converter writes them (gguf-py's own tensor-name map,
Q/K rows permuted for the ``llama`` architecture, Gemma norms stored as ``1 + w``, Llama 3 RoPE as
a ``rope_freqs`` tensor), so our GGUF loader is checked against the converter's conventions, not
against itself.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ratchetlm import LLM
from ratchetlm.decoding.base import Proposal
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine

VOCAB = 258  # 256 byte tokens + <s> + </s>
BOS, EOS = 256, 257


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    return [b2u[i] for i in range(256)] + ["<s>", "</s>"]


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 258 tokens, any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(byte_tokens())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              bos_token_id=BOS, eos_token_id=EOS, pad_token_id=0)


def hf_model(arch: str, **overrides):
    """A random HF ``*ForCausalLM`` of ``arch`` in fp32, norms and biases perturbed (random init
    leaves them at 1/0, which hides a wrong mapping) and Q/K scaled up so attention scores are O(1)
    (random init leaves them near 0: uniform attention hides wrong masks, positions and soft-caps)."""
    import transformers

    torch.manual_seed(0)
    cfg_cls = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
               "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
               "Gemma2ForCausalLM": "Gemma2Config", "Gemma3ForCausalLM": "Gemma3TextConfig",
               "Phi3ForCausalLM": "Phi3Config"}[arch]
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **overrides})
    if arch in ("Gemma2ForCausalLM",):
        cfg._attn_implementation = "eager"  # HF: sdpa has no soft-cap
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            if any(k in n for k in ("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(8.0)
    return model.eval()


def save_hf(path: Path, model) -> Path:
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def hf_logits(model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab] fp32
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def engine_logits(llm: LLM, ids: list[int], rows: list[int], n_decode: int = 0) -> dict[int, torch.Tensor]:
    """Our logits at prompt positions ``rows`` from one prefill of ``ids[:-n_decode]``, then at each
    of the last ``n_decode`` positions from single-token decode steps through the paged cache."""
    eng = llm.engine
    start = len(ids) - n_decode
    sid = eng.add_request(ids[:start], _params(n_decode + 1))
    seq = eng.seqs[sid]
    eng.scheduler.schedule()
    eng.blocks.grow(seq, len(ids))
    pre = [r for r in rows if r < start] + [start - 1]
    p = Proposal(token_ids=ids[:start], positions=list(range(start)), logit_rows=pre)
    out = dict(zip(pre, eng.runner.execute([seq], [p]).logits[0], strict=True))
    seq.num_cached = start
    for i in range(start, len(ids)):
        p = Proposal(token_ids=[ids[i]], positions=[i], logit_rows=[0])
        out[i] = eng.runner.execute([seq], [p]).logits[0][0]
        seq.num_cached += 1
    eng.abort(sid)
    eng.release(sid)
    return out


def engine_on(llm: LLM, **kwargs) -> LLMEngine:
    """A fresh engine (own KV cache, own strategy) on ``llm``'s already loaded model."""
    cfg = EngineConfig(**{"device": "cpu", "dtype": "float32", "progress": False, **kwargs})
    return LLMEngine(cfg, llm.engine.model, llm.model_config)


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy to completion (EOS ignored): output ids per prompt, in order."""
    from ratchetlm import SamplingParams

    sids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            for p in prompts]
    drain(engine)
    return [engine.release(s).output_ids for s in sids]  # type: ignore[union-attr]


def drain(engine: LLMEngine, stall_steps: int = 20) -> int:
    """Step until every request finished; returns the step count. Fails (instead of looping forever)
    when ``stall_steps`` steps in a row change no sequence's committed tokens or K/V — what an engine
    whose blocks never come back does (a request admitted for a cache it cannot run in waits
    forever) — or after more steps than one per token of every request, ten times over."""
    seqs = [s for s in engine.seqs.values() if not s.is_finished]
    limit = 10 * sum(s.num_prompt_tokens + s.params.max_tokens for s in seqs) + 100
    steps = stalled = 0
    while engine.has_unfinished():
        before = [(len(s.token_ids), s.num_cached) for s in seqs]
        engine.step()
        steps += 1
        stalled = stalled + 1 if [(len(s.token_ids), s.num_cached) for s in seqs] == before else 0
        free = engine.blocks.num_free
        assert stalled < stall_steps, (
            f"engine made no progress for {stalled} steps (step {steps}): {len(engine.scheduler.waiting)} "
            f"waiting, {len(engine.scheduler.running)} running, {free} of {engine.blocks.num_blocks} KV blocks free")
        assert steps <= limit, f"requests not finished after {steps} steps (limit {limit}): the engine is livelocked"
    return steps


def _params(n: int):
    from ratchetlm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0)


# ---------------------------------------------------------------- GGUF, as llama.cpp's converter writes it

GGUF_ARCH = {"LlamaForCausalLM": "LLAMA", "MistralForCausalLM": "LLAMA", "Qwen2ForCausalLM": "QWEN2",
             "Qwen3ForCausalLM": "QWEN3", "Gemma2ForCausalLM": "GEMMA2", "Gemma3ForCausalLM": "GEMMA3",
             "Phi3ForCausalLM": "PHI3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation for the ``llama`` architecture (rotate-half -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for ``rope_type: llama3``."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, orig = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: Path, model, quant: str = "F32", window_flags: bool | list[bool] = False) -> Path:
    """Write ``model`` (a tiny HF model from :func:`hf_model`) as a GGUF with the byte tokenizer.
    ``quant``: the type of 2-D weights (``F32``, ``Q8_0``, ...; other tensors stay F32).
    ``window_flags``: the layer pattern as one flag per layer (true = sliding), as newer converters
    write it, instead of llama.cpp's per-architecture period (a list: those flags, as given)."""
    import gguf

    c = model.config
    arch_enum = getattr(gguf.MODEL_ARCH, GGUF_ARCH[type(model).__name__])
    arch = gguf.MODEL_ARCH_NAMES[arch_enum]
    tmap = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rotary)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    if window_flags:
        flags = window_flags if isinstance(window_flags, list) else [t == "sliding_attention" for t in c.layer_types]
        w.add_sliding_window_pattern(flags)
    if getattr(c, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if getattr(c, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch.startswith("gemma"):  # llama.cpp derives the attention scale from key_length: keep them equal
        assert c.query_pre_attn_scalar == head_dim, "GGUF cannot carry query_pre_attn_scalar != head_dim"
        local = c.rope_parameters.get("sliding_attention") or {}
        if arch == "gemma3" and local.get("rope_theta", 10000.0) != 10000.0:
            w.add_rope_freq_base_swa(local["rope_theta"])
    if rope.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    tensors: dict[str, np.ndarray] = {}
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(rope, head_dim)
    if rope.get("rope_type") == "longrope":
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(_longrope_attn(c, rope))
    gemma = arch.startswith("gemma")
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.float().numpy()
        stem, _, suffix = name.rpartition(".")
        new = tmap.get_name(stem)
        assert new is not None, name
        if arch == "llama" and stem.endswith("q_proj"):
            data = _permute(data, c.num_attention_heads)
        if arch == "llama" and stem.endswith("k_proj"):
            data = _permute(data, c.num_key_value_heads)
        if gemma and "norm" in stem:
            data = data + 1  # the converter bakes Gemma's (1 + w) into the stored norm
        tensors[f"{new}.{suffix}"] = data
    qtype = getattr(gguf.GGMLQuantizationType, quant)
    for name, data in tensors.items():
        if data.ndim == 2 and quant != "F32" and name != "token_embd.weight" or (
                name == "token_embd.weight" and quant != "F32" and data.shape[1] % 32 == 0):
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(byte_tokens())
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_pad_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _longrope_attn(c, rope) -> float:
    factor = c.max_position_embeddings / rope["original_max_position_embeddings"]
    return math.sqrt(1 + math.log(factor) / math.log(rope["original_max_position_embeddings"])) if factor > 1 else 1.0
