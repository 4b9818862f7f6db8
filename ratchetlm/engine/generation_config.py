"""The model's default sampling parameters (vLLM's ``generation_config`` / ``--generation-config``).

Model makers ship recommended sampling settings: an HF folder's ``generation_config.json``
(``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens``), a GGUF's
``general.sampling.*`` keys (``temp``, ``top_k``, ``top_p``, ``min_p``, ``penalty_repeat``; written by
newer converters). As in vLLM, ``generation_config="auto"`` (the default) makes them the defaults of
every request that does not set the parameter itself (a request's own value always wins);
``"vllm"`` ignores them (vLLM's neutral defaults); a folder path reads that folder's
``generation_config.json`` instead. ``override_generation_config`` (a dict of the same names) is
applied on top. ``max_new_tokens`` becomes ``max_tokens``. ``do_sample`` is not read, as vLLM does
not: a sampling temperature in the file applies.

Used by :meth:`LLM.get_default_sampling_params` (offline ``generate`` / ``chat`` without
sampling params) and by the server (requests that omit a field).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ratchetlm.models.gguf_file import GGUFFile
from ratchetlm.sampling_params import SamplingParams

GENERATION_CONFIGS = ("auto", "vllm")  # or a folder with a generation_config.json

# generation_config.json name -> SamplingParams name
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata (gguf-py's Keys.General.SAMPLING_*) -> SamplingParams name
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}


def check_generation_config(source: str, override: Any) -> None:
    """ValueErrors naming the problem with ``generation_config`` / ``override_generation_config``."""
    if source not in GENERATION_CONFIGS and not os.path.isdir(source):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a generation_config.json, "
                         f"got {source!r}")
    if override is None:
        return
    if not isinstance(override, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {override!r}")
    _sampling(override, HF_KEYS, "override_generation_config", strict=True)


def default_sampling(source: str, model: Path | None, kind: str | None, override: dict[str, Any] | None,
                     gguf: Any = None) -> dict[str, Any]:
    """The SamplingParams fields a request gets when it does not set them: the model's (``auto``; an
    HF folder's generation_config.json, a GGUF's ``general.sampling.*``, read through ``gguf``, a
    :class:`~ratchetlm.models.gguf_file.GGUFFile`), a folder's (``source`` a path) or none
    (``vllm``), with ``override`` on top."""
    found: dict[str, Any] = {}
    if source == "auto" and kind == "gguf" and gguf is not None:
        found = _sampling({k: gguf.get(k) for k in GGUF_KEYS}, GGUF_KEYS, "the GGUF's general.sampling")
    elif source != "vllm":
        folder = Path(source) if source != "auto" else (model if kind == "hf" else None)
        path = folder / "generation_config.json" if folder is not None else None
        if path is not None and path.is_file():
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
            found = _sampling(cfg if isinstance(cfg, dict) else {}, HF_KEYS, str(path.name))
    if override:
        found.update(_sampling(override, HF_KEYS, "override_generation_config", strict=True))
    return found


def model_sampling_defaults(source: str, model: Any, override: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`default_sampling` for a loaded model's ``ModelSource`` (``model``: ``.kind``, ``.path``),
    checked: a value SamplingParams refuses is a ValueError naming where it came from."""
    gguf = GGUFFile(model.path) if source == "auto" and model.kind == "gguf" else None
    found = default_sampling(source, model.path, model.kind, override, gguf)
    try:
        SamplingParams(**found)
    except ValueError as e:
        raise ValueError(f"the default sampling parameters of generation_config={source!r}: {e}") from None
    return found


def _sampling(cfg: dict[str, Any], names: dict[str, str], where: str, strict: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if strict:
        unknown = sorted(set(cfg) - set(names))
        if unknown:
            raise ValueError(f"{where}: unknown sampling parameter(s) {', '.join(unknown)}; known: "
                             f"{', '.join(names)}")
    for key, field in names.items():
        v = cfg.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"{where}: {key} must be a number, got {v!r}")
        out[field] = int(v) if field in ("top_k", "max_tokens") else float(v)
    return out
