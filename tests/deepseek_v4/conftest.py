"""Tiny random DeepSeek-V4 checkpoints built with HF transformers (the oracle).

Widths are tiny; capacity constants are the real ones (window 128, ratios 4/128,
indexer top-k 512, 16384 positions) so boundaries sit at their true positions.
"""

from __future__ import annotations

import pytest
import torch

LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]
MLP_TYPES = ["hash_moe", "hash_moe", "moe", "moe"]


def tiny_hf_config(**overrides):
    # 16 indexer heads: with few heads many slots score exactly 0 (all ReLUs off) and the
    # top-512 cut lands inside a tie that HF's topk breaks arbitrarily.
    from transformers import DeepseekV4Config

    kw = dict(
        vocab_size=96, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        max_position_embeddings=16384, layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES,
        o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=512,
        sliding_window=128, partial_rotary_factor=0.25, hc_mult=4,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1},
        eos_token_id=None, bos_token_id=None,
    )
    kw.update(overrides)
    return DeepseekV4Config(**kw)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """HF initialises sinks, biases, hash tables and norms to constants that would hide
    bugs (every hash token on expert 0, zero sinks); give every tensor a random value."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", ".base", "hc_base", "position_bias")):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(("scale", "hc_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(1.0, p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                perm = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: b.shape[1]]
                                    for _ in range(b.shape[0])])
                b.copy_(perm)
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def build_hf_model(seed: int = 0, **overrides):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_hf_config(**overrides)).eval()
    randomize_(model, seed)
    return model


@pytest.fixture(scope="session")
def hf_model():
    torch.set_num_threads(1)
    return build_hf_model(seed=0)


@pytest.fixture(scope="session")
def tiny_v4_dir(tmp_path_factory, hf_model):
    path = tmp_path_factory.mktemp("tiny_v4")
    hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model(tiny_v4_dir):
    from ratchetlm.models.deepseek_v4.loader import load_deepseek_v4

    return load_deepseek_v4(tiny_v4_dir)


LONG_LEN = 16384


@pytest.fixture(scope="session")
def long_run(model):
    """The reference forward over one 16384-token stream: (ids, logits [16384, vocab], traces).

    The reference is itself checked against HF (test_reference_vs_hf.py); decode at long
    positions is checked against it because HF's dense forward cannot reach 16k here."""
    from ratchetlm.models.deepseek_v4.reference import reference_forward

    ids = torch.randint(0, 96, (LONG_LEN,), generator=torch.Generator().manual_seed(2024))
    logits, traces = reference_forward(model, ids, chunk=512)
    return ids, logits, traces
