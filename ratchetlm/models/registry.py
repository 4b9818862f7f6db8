"""Build a ready model (weights on device, in dtype) plus its tokenizer from a model reference."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from ratchetlm import kernels
from ratchetlm.memory.host_memory import available_bytes
from ratchetlm.models.auto_numerics import FAST_INT_ISAS, NumericsChoice, choose_auto, file_type
from ratchetlm.models.config import ModelConfig
from ratchetlm.models.deepseek_v4.loader import is_deepseek_v4_folder
from ratchetlm.models.gguf_arch import gguf_config
from ratchetlm.models.gguf_file import GGUFFile, GGUFFormatError
from ratchetlm.models.llama import LlamaModel
from ratchetlm.models.loader import (
    ModelLoadError,
    ModelSource,
    gguf_block_weights,
    hf_block_weights,
    iter_gguf_weights,
    iter_hf_weights,
    read_hf_config,
    resolve,
)
from ratchetlm.models.shard import TPShard, check_divisible
from ratchetlm.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: Any  # LlamaModel, or DeepseekV4ForCausalLM (its own cache layout, same engine)
    config: Any  # ModelConfig / DeepseekV4Config
    tokenizer: Any
    source: ModelSource
    numerics: NumericsChoice  # the mode the model runs in, and why (the engine logs it once)


def load_model(
    ref: str | None,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    mask_token_id: int | None = None,
    gguf_kernels: bool = True,
    numerics: str = "exact",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: Any = None,
) -> LoadedModel:
    """``gguf_kernels``: a run on CPU in fp32 keeps a GGUF's 2-D weights, and an HF folder's 16-bit
    (BF16 / F16) 2-D weights, in their stored form (read in place from the mmapped file) and
    multiplies them through the block kernels; otherwise (or without a C compiler) every tensor is
    dequantized to a dense copy in ``dtype``. ``numerics="int8"`` / ``"int16"``: those block weights
    that have integer values multiply integer activations (layers/block_quant.py); a model with none
    is refused. ``"auto"``: models/auto_numerics.py chooses, by the GGUF's weight format, where some
    weights have integer values (a quantized GGUF on CPU in fp32) and the kernels' integer dot product
    is one of ``FAST_INT_ISAS``, else ``"exact"`` (the model's ``numerics`` says which).
    ``tp_rank`` of ``tp_size``: load only that tensor-parallel rank's slice (models/shard.py); its
    collectives run over ``tp_group``."""
    source = resolve(ref)
    if source.kind != "gguf" and is_deepseek_v4_folder(source.path):
        if tp_size > 1:
            raise ModelLoadError(_V4_TP)
        from ratchetlm.models.deepseek_v4.loader import load_deepseek_v4

        if numerics not in ("exact", "auto"):
            raise ModelLoadError(f"numerics={numerics!r} needs GGUF block weights; DeepSeek-V4 folders run in "
                                 "'exact' only")
        v4 = load_deepseek_v4(source.path, dtype=dtype).to(device)
        why = "auto: DeepSeek-V4 runs in exact only" if numerics == "auto" else "as requested"
        return LoadedModel(v4, v4.config, load_tokenizer(source), source, NumericsChoice("exact", why))
    reader, cfg = _read_config(source)
    tokenizer = load_tokenizer(source)
    mask_id = mask_token_id if mask_token_id is not None else cfg.mask_token_id
    if mask_id is None and getattr(tokenizer, "mask_token_id", None) is not None:
        mask_id = tokenizer.mask_token_id
    if mask_id != cfg.mask_token_id:
        cfg = replace(cfg, mask_token_id=mask_id)
    try:
        shard = TPShard.of(cfg, tp_rank, tp_size, tp_group)
    except ValueError as e:
        raise ModelLoadError(f"{source.path.name}: {e}") from None
    with torch.device("meta"):
        model = LlamaModel(cfg, shard)
    in_blocks: set[str] = set()
    stored_form = gguf_kernels and device.type == "cpu" and dtype == torch.float32
    if stored_form and kernels.load():
        # before any dense allocation: a bf16 checkpoint run in fp32 is never expanded to an fp32 copy
        blocks = gguf_block_weights(reader, cfg) if reader is not None else hf_block_weights(source.path)
        in_blocks = model.attach_blocks(blocks)
    if device.type == "cpu":
        _check_dense_fits(model, source.path.name, _dense_reason(stored_form))
    # dense tensors are allocated in the run dtype (a bf16 checkpoint is never expanded to fp32 first)
    model = _materialize(model).to(dtype)
    if reader is not None:
        model.load_hf_weights(iter_gguf_weights(reader, cfg, progress, skip=in_blocks))
    else:
        model.load_hf_weights(iter_hf_weights(source.path, progress, skip=in_blocks))
    model = model.to(device=device).eval()
    # the integer modes run on CPU block weights only: a CUDA or dense load never builds the CPU kernels
    isa = kernels.int8_isa() if in_blocks else None
    fast_int = isa in FAST_INT_ISAS
    choice = NumericsChoice(numerics, "as requested")
    if numerics == "auto":  # by weight format, where the weights have integer values and the kernels are fast
        has_int = bool(in_blocks) and model.set_numerics("int16") > 0
        choice = choose_auto(file_type(reader), has_int, isa)
        model.set_numerics(choice.numerics)
    elif numerics != "exact" and model.set_numerics(numerics) == 0:
        raise ModelLoadError(f"numerics={numerics!r} needs quantized GGUF block weights on CPU in fp32 with the "
                             f"kernels built; {source.path} has none here (use numerics='exact')")
    elif numerics != "exact" and not fast_int:
        log.warning("numerics=%r runs the portable integer kernels on this CPU (no AVX2): expect it several "
                    "times slower than numerics='exact', the default here", numerics)
    return LoadedModel(model, cfg, tokenizer, source, choice)


def _dense_reason(stored_form: bool) -> str:
    """Why a CPU load holds (some of) its weights as a dense copy, for the error below."""
    if not stored_form:
        return "it was asked for (gguf_kernels=False or a dtype other than float32)"
    if kernels.load() is None:
        return f"the GGUF block kernels are not available: {kernels.unavailable_reason()}"
    return "they are stored as float32 or in a form the kernels do not read"


def _check_dense_fits(model: LlamaModel, name: str, why: str) -> None:
    """Refuse, before allocating it, a dense copy of the weights larger than the memory left on the
    host (a 7B GGUF expanded to float32 is ~28 GB): a clear error instead of the OOM killer."""
    need = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))  # (meta)
    have = available_bytes()
    if have is not None and need > have:
        raise ModelLoadError(f"{name}: its weights would be held as a dense {need / 2**30:.1f} GiB copy, because "
                             f"{why}, and only {have / 2**30:.1f} GiB of memory is available")


def _materialize(model: LlamaModel) -> LlamaModel:
    """``model.to_empty(device="cpu")``: uninitialised CPU storage for every meta tensor. Not through
    ``torch.empty_like``, whose reference implementation for meta tensors imports torch.fx's symbolic
    shapes and with them sympy: ~30 MB of resident memory, for nothing (the load takes as long)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))


def _read_config(source: ModelSource) -> tuple[GGUFFile | None, ModelConfig]:
    """The GGUF reader (None for an HF folder) and the model's config."""
    reader = None
    if source.kind == "gguf":
        try:
            reader = GGUFFile(source.path)
        except GGUFFormatError as e:
            raise ModelLoadError(str(e)) from None
        cfg = gguf_config(reader)
    else:
        d = read_hf_config(source.path)
        try:
            cfg = ModelConfig.from_hf_dict(d)
        except KeyError as e:
            raise ModelLoadError(f"config.json in {source.path} lacks field {e}") from None
        except ValueError as e:
            raise ModelLoadError(f"{source.path / 'config.json'}: {e}") from None
    return reader, cfg


def check_tensor_parallel(ref: str | None, n: int) -> None:
    """Refuse, before any rank starts, a model that cannot be split over ``n`` ranks (naming why)."""
    source = resolve(ref)
    if source.kind != "gguf" and is_deepseek_v4_folder(source.path):
        raise ModelLoadError(_V4_TP)
    _, cfg = _read_config(source)
    try:
        check_divisible(cfg, n)
    except ValueError as e:
        raise ModelLoadError(f"{source.path.name}: {e}") from None


_V4_TP = ("DeepSeek-V4 does not run with tensor_parallel_size > 1 (its compressed KV pools, indexer and MTP "
          "module are not sharded); use tensor_parallel_size=1")
