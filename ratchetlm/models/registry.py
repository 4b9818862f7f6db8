"""Build a ready model (weights on device, in dtype) plus its tokenizer from a model reference."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ratchetlm import kernels
from ratchetlm.models.config import ModelConfig
from ratchetlm.models.llama import LlamaModel
from ratchetlm.models.loader import (
    ModelLoadError,
    ModelSource,
    gguf_block_weights,
    gguf_config,
    iter_gguf_weights,
    iter_hf_weights,
    read_hf_config,
    resolve,
)
from ratchetlm.models.tokenizer import load_tokenizer


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Any
    source: ModelSource


def load_model(
    ref: str | None,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    mask_token_id: int | None = None,
    gguf_kernels: bool = True,
) -> LoadedModel:
    """``gguf_kernels``: for a block-quantized GGUF run on CPU in fp32, also keep the Q4_1/Q8_0
    blocks so decode-size matmuls read them through the fused kernel (same weights, fewer bytes)."""
    source = resolve(ref)
    reader = None
    if source.kind == "gguf":
        import gguf

        reader = gguf.GGUFReader(str(source.path))
        cfg = gguf_config(reader)
        weights = iter_gguf_weights(reader, cfg, progress)
    else:
        d = read_hf_config(source.path)
        try:
            cfg = ModelConfig.from_hf_dict(d)
        except KeyError as e:
            raise ModelLoadError(f"config.json in {source.path} lacks field {e}") from None
        except ValueError as e:
            raise ModelLoadError(f"{source.path / 'config.json'}: {e}") from None
        weights = iter_hf_weights(source.path, progress)
    tokenizer = load_tokenizer(source)
    mask_id = mask_token_id if mask_token_id is not None else cfg.mask_token_id
    if mask_id is None and getattr(tokenizer, "mask_token_id", None) is not None:
        mask_id = tokenizer.mask_token_id
    if mask_id != cfg.mask_token_id:
        cfg = replace(cfg, mask_token_id=mask_id)
    with torch.device("meta"):
        model = LlamaModel(cfg)
    model = model.to_empty(device="cpu").to(torch.float32)
    model.load_hf_weights(weights)
    model = model.to(device=device, dtype=dtype).eval()
    if reader is not None and gguf_kernels and device.type == "cpu" and dtype == torch.float32 and kernels.load():
        model.attach_blocks(gguf_block_weights(reader, cfg))
    return LoadedModel(model, cfg, tokenizer, source)
