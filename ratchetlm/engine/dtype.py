"""The run dtype ``dtype="auto"`` picks, and the one line that says why.

The rule (docs/vllm_compat.md#default-dtype), chosen so that the default output is the reference one:

* **CPU: float32, always.** fp32 activations keep results identical to HF transformers in fp32
  (the exact mode). It costs no memory: a GGUF's blocks and an HF folder's bf16/fp16 weights stay
  in their stored form and the block kernels read them in place (a dense fp32 copy is made only
  without the kernels, or for an fp32 checkpoint, which is fp32 anyway). bf16 compute on CPUs with
  native bf16 drifts from fp32 within a few tokens, so it is opt-in (``dtype="bfloat16"``).
* **CUDA, HF folder: the checkpoint's dtype** (``config.json``'s ``torch_dtype``/``dtype``; fp32
  when absent) — what HF transformers' ``dtype="auto"`` runs, so parity holds in that dtype.
* **CUDA, GGUF: bfloat16** where the GPU has it (dense copies of the dequantized weights; the
  files carry no compute dtype), else float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # e.g. "GGUF on CPU, block kernels: avx512"

    def describe(self) -> str:
        return f"dtype={str(self.dtype).removeprefix('torch.')} ({self.reason})"


def choose_dtype(dtype: str, device: str, model: str | None, gguf_kernels: bool) -> DtypeChoice:
    """``dtype`` is an explicit name or ``"auto"``; ``model`` a path (resolved as the loader does:
    a folder holding one GGUF file is that GGUF) or None for the bundled default GGUF."""
    kind, path = _source(model)
    what = {"gguf": "GGUF", "hf": "HF folder", "unknown": "model"}[kind]
    where = "CPU" if device == "cpu" else device
    if dtype != "auto":
        return DtypeChoice(DTYPES[dtype], f"{what} on {where}, as requested{_kernels(gguf_kernels, device, dtype)}")
    if device == "cpu":
        return DtypeChoice(torch.float32, f"{what} on CPU{_kernels(gguf_kernels, device, 'float32')}")
    if kind == "hf" and path is not None:
        stored = checkpoint_dtype(path)
        return DtypeChoice(stored, f"HF folder on {where}: the checkpoint's dtype")
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return DtypeChoice(torch.bfloat16, f"{what} on {where}")
    return DtypeChoice(torch.float32, f"{what} on {where}, no bf16 on this GPU")


def checkpoint_dtype(folder: Path) -> torch.dtype:
    """The compute dtype an HF ``config.json`` declares (fp32 when it declares none)."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    name = cfg.get("torch_dtype") or cfg.get("dtype") or (cfg.get("text_config") or {}).get("torch_dtype")
    return DTYPES.get(str(name), torch.float32)


def _source(model: str | None) -> tuple[str, Path | None]:
    if model is None:
        return "gguf", None
    path = Path(model).expanduser()
    if path.is_file() or path.suffix == ".gguf":
        return "gguf", path
    if (path / "config.json").is_file():
        return "hf", path
    if path.is_dir() and len(list(path.glob("*.gguf"))) == 1:
        return "gguf", path  # the loader takes the folder's one GGUF file: same dtype, same kernels
    return "unknown", None


def _kernels(gguf_kernels: bool, device: str, dtype: str) -> str:
    if device != "cpu" or DTYPES[dtype] != torch.float32:
        return ""
    if not gguf_kernels:
        return ", block kernels: off"
    from ratchetlm import kernels

    isa = kernels.isa() if kernels.load() is not None else None
    return f", block kernels: {isa}" if isa else ", block kernels: unavailable (no C compiler)"
