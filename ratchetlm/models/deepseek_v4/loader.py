"""Loads an HF-format DeepSeek-V4 folder (``config.json`` + ``*.safetensors``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from ratchetlm.models.deepseek_v4.config import DeepseekV4Config
from ratchetlm.models.deepseek_v4.model import DeepseekV4ForCausalLM

ARCHITECTURE = "DeepseekV4ForCausalLM"

# On disk, V4 checkpoints (DeepSeek's own and what HF ``save_pretrained`` writes) use the
# official names (``attn.wkv``, ``ffn.experts.3.w1``, ``hc_attn_fn`` ...); our modules use
# HF's in-memory names. Ordered (pattern, replacement) pairs; applied in sequence.
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^(model\.)?embed\.weight$", "model.embed_tokens.weight"),
    (r"^(model\.)?head\.weight$", "lm_head.weight"),
    (r"^(model\.)?hc_head_(fn|base|scale)$", r"model.hc_head.hc_\2"),
    (r"^(model\.)?mtp\.(\d+)\.hc_head_(fn|base|scale)$", r"mtp.\2.hc_head.hc_\3"),
    (r"^model\.mtp\.", "mtp."),
    (r"^(model\.)?norm\.weight$", "model.norm.weight"),
    (r"^layers\.", "model.layers."),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.self_attn\.norm\.", ".self_attn.kv_norm."),
    (r"\.compressor\.norm\.", ".compressor.kv_norm."),
    (r"\.indexer\.norm\.", ".indexer.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
# MTP modules past the first, and copies of the shared embedding / head under an MTP prefix
_MTP_SKIPPED = re.compile(r"^(model\.)?mtp\.(([1-9]\d*)\.|\d+\.(embed|emb|head|shared_head)\.)")
_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")


def to_module_names(state: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Renames official-format keys to module names and stacks per-expert ``w1/w3`` into
    ``gate_up_proj [E, 2I, H]`` and ``w2`` into ``down_proj [E, H, I]``. HF in-memory names
    pass through unchanged."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in state.items():
        for pattern, repl in _RENAMES:
            key = re.sub(pattern, repl, key)
        if m := _EXPERT_KEY.match(key):
            experts.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = value
        else:
            out[key] = value
    for prefix, parts in experts.items():
        def stack(w: str, prefix: str = prefix, parts: dict = parts) -> torch.Tensor:
            if sorted(parts[w]) != list(range(num_experts)):
                raise ValueError(f"{prefix}: expected experts 0..{num_experts - 1} for {w}")
            return torch.stack([parts[w][e] for e in range(num_experts)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack("w1"), stack("w3")], dim=1)
        out[f"{prefix}.down_proj"] = stack("w2")
    return out


def is_deepseek_v4_folder(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    d = json.loads(cfg.read_text())
    return d.get("model_type") == "deepseek_v4" or ARCHITECTURE in (d.get("architectures") or [])


def load_deepseek_v4(path: str | Path, dtype: torch.dtype | None = None,
                     max_positions: int | None = None) -> DeepseekV4ForCausalLM:
    """Builds the model from ``path``. Weights keep the checkpoint dtype unless ``dtype`` is given.

    Raises if any checkpoint tensor is missing or unexpected. MTP weights (``mtp.{k}.*``,
    layout in ``mtp.py``) build ``model.mtp`` when present: module 0 (a chain of drafts reuses
    it); further modules and copies of the shared embedding / head under ``mtp.`` are skipped.
    """
    path = Path(path)
    cfg = DeepseekV4Config.from_hf_dict(json.loads((path / "config.json").read_text()))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    state = {k: v for k, v in state.items() if not _MTP_SKIPPED.match(k)}
    state = to_module_names(state, cfg.num_experts)
    if cfg.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = DeepseekV4ForCausalLM(cfg, max_positions=max_positions)
    if any(k.startswith("mtp.0.") for k in state):
        from ratchetlm.models.deepseek_v4.mtp import MTPModule

        model.mtp = torch.nn.ModuleList([MTPModule(cfg)])
    target = dtype or state["model.embed_tokens.weight"].dtype
    model.to(target)
    state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint mismatch: missing={missing[:8]} unexpected={unexpected[:8]}")
    return model.eval()
