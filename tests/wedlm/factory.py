"""Tiny WeDLM-shaped models for tests.

No WeDLM checkpoint under 7B exists publicly, so the engine-vs-reference tests use (a) a tiny
random-weight Qwen3 with a declared ``mask_token_id`` and its LM head scaled up so that
per-mask entropies spread over [0, a few nats] and the entropy threshold really selects
several masks per step, and (b) the model trained here (``ratchetlm/assets/wedlm-tiny``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ratchetlm.training.corpus import vocabulary_words
from ratchetlm.training.tokenizer_build import build_tokenizer


def make_tiny_wedlm_folder(path: Path, head_scale: float = 12.0, seed: int = 0, declare_mask: bool = True):
    """Save a random 2-layer Qwen3 with the corpus tokenizer; returns (path, hf_model)."""
    import transformers

    tok = build_tokenizer(vocabulary_words())
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
        model.lm_head.weight.mul_(head_scale)
    model.eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    d = json.loads((path / "config.json").read_text())
    if declare_mask:
        d["mask_token_id"] = tok.mask_token_id
    else:
        d.pop("mask_token_id", None)
    (path / "config.json").write_text(json.dumps(d))
    if not declare_mask:  # and a tokenizer without a mask token
        tc = json.loads((path / "tokenizer_config.json").read_text())
        tc.pop("mask_token", None)
        (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return path, model
