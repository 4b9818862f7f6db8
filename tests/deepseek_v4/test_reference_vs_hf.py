"""The unpaged reference forward and the loader against HF's DeepseekV4ForCausalLM."""

from __future__ import annotations

import json

import pytest
import torch

from ratchetlm.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from ratchetlm.models.deepseek_v4.reference import reference_forward
from ratchetlm.models.deepseek_v4.rope import inv_freq

ATOL = 5e-5


def _ids(n: int, seed: int, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_parses_saved_checkpoint(tiny_v4_dir):
    cfg = DeepseekV4Config.from_hf_dict(json.loads((tiny_v4_dir / "config.json").read_text()))
    assert cfg.layer_types == (SLIDING, SLIDING, CSA, HCA)
    assert (cfg.csa_ratio, cfg.hca_ratio, cfg.sliding_window, cfg.index_topk) == (4, 128, 128, 512)
    assert cfg.rope_head_dim == 8 and cfg.compress_rope.yarn_factor == 16.0
    assert cfg.main_rope.yarn_factor is None and cfg.main_rope.theta == 10000.0


def test_config_rejects_inconsistent_fields():
    d = json.loads(json.dumps({"num_hidden_layers": 2, "layer_types": ["sliding_attention"]}))
    with pytest.raises((ValueError, KeyError)):
        DeepseekV4Config.from_hf_dict(d)


def test_rope_tables_match_hf(hf_model, model):
    rot = hf_model.model.rotary_emb
    assert torch.allclose(inv_freq(model.config.main_rope), rot.main_inv_freq, rtol=1e-6)
    assert torch.allclose(inv_freq(model.config.compress_rope), rot.compress_inv_freq, rtol=1e-6)
    # YaRN actually changed something, so the comparison above is not trivially plain RoPE.
    assert not torch.allclose(rot.compress_inv_freq, inv_freq(model.config.compress_rope.__class__(160000.0, 8)))


def test_loader_accepts_hf_module_names(hf_model, tiny_v4_dir, model):
    # The on-disk checkpoint uses the official names; the in-memory HF names load too.
    from ratchetlm.models.deepseek_v4.loader import to_module_names

    hf_state = hf_model.state_dict()
    ours = to_module_names(dict(hf_state), model.config.num_experts)
    for k, v in model.state_dict().items():
        if k.startswith("mtp."):  # HF does not build the MTP module (tests/deepseek_v4/test_mtp.py)
            continue
        assert torch.equal(ours[k], v), k


@pytest.mark.parametrize("T", [1, 5, 130, 300])
def test_reference_matches_hf_full_forward(hf_model, model, T):
    ids = _ids(T, seed=T)
    with torch.no_grad():
        want = hf_model(ids[None]).logits[0]
    got, _ = reference_forward(model, ids, chunk=64)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_reference_matches_hf_with_active_topk(hf_model, model):
    # 2304 tokens -> 576 CSA entries at the end, so the indexer really drops entries (top 512).
    T = 2304
    ids = _ids(T, seed=11)
    with torch.no_grad():
        want = hf_model(ids[None]).logits[0]
    got, traces = reference_forward(model, ids)
    assert traces[2].main.entries.shape[0] == T // 4 > 512
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)


def test_reference_respects_causality(model):
    ids = _ids(260, seed=3)
    a, _ = reference_forward(model, ids)
    b, _ = reference_forward(model, torch.cat([ids[:200], _ids(60, seed=4)]))
    torch.testing.assert_close(a[:200], b[:200], atol=1e-6, rtol=0)
    assert not torch.allclose(a[200:], b[200:])
