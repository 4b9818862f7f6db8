"""Engine configuration. CLI flags map 1:1 onto these fields."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ratchetlm.engine.dtype import DTYPES, DtypeChoice, choose_dtype
from ratchetlm.engine.generation_config import check_generation_config
from ratchetlm.engine.step_cost import DEFAULT_MAX_STEP_MS

NUMERICS = ("exact", "int8", "int16")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner ("auto": generate, what a causal LM does)
POOLING_TYPES = ("last", "mean")  # engine/pooling.py  # CPU block kernels' compute modes (layers/block_quant.py)
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local GGUF file / HF folder; None = the bundled SmolLM2-135M-Instruct
    device: str = "cpu"
    # auto = fp32 on CPU (HF-identical; stored weights read in place by the block kernels), on CUDA the HF
    # checkpoint's dtype, bf16 for GGUF (engine/dtype.py says why)
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's max positions
    kv_cache_blocks: int | None = None  # default: ~1 GiB of KV (at least one max_model_len)
    # the cache budget in bytes, for any model's cache layout (default ~1 GiB); exclusive with kv_cache_blocks
    kv_cache_bytes: int | None = None
    # CUDA (vLLM's meaning): the fraction of the GPU's memory this engine may fill; the KV cache gets what
    # the loaded model and an activation reserve leave of it (engine/kv_budget.py). None: the ~1 GiB
    # default. On CPU it is accepted and ignored with a warning (size the cache with kv_cache_bytes).
    gpu_memory_utilization: float | None = None
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048  # an upper bound; the step-time budget below usually binds first
    # the step-time budget (engine/step_cost.py): while any sequence decodes, a prompt is fed in chunks
    # the measured cost model predicts to keep each step under this many milliseconds (kept within 4.5-5x
    # the decode rows' own time), so a long prompt never freezes other streams. None: 100 on CPU, 50 on
    # CUDA; inf: off (token budget only)
    max_step_ms: float | None = None
    max_waiting: int = 1024  # queue limit; add_request beyond it raises QueueFullError
    # most tentative K/V rows one forward may stage (kv/staging.py); proposals past it fall back to recompute
    staging_capacity: int = 1024
    # reuse committed full KV blocks of earlier requests with the same prefix (kv/block_manager.py)
    enable_prefix_caching: bool = True
    # CPU: a thread backs the KV pools' pages just ahead of the blocks in use (kv/prefault.py), so that no
    # step waits for a new region's first-write faults; False: pages are backed by the step that first
    # writes them
    kv_prefault: bool = True
    decoding: str = "autoregressive"
    decoding_options: dict[str, Any] = field(default_factory=dict)
    # CPU fp32: GGUF weights (every format) and 16-bit HF weights stay in their stored form and every
    # matmul reads them through the block kernels (False: dense fp32 copies multiplied by BLAS)
    gguf_kernels: bool = True
    # CPU block kernels: "exact" = fp32 activations times the exactly dequantized weights (HF-identical);
    # "int8" / "int16" = activations quantized per row in blocks of 32 to 8 / 16 bits, integer (VNNI)
    # dot products with the weights' int8 values: faster, batch-invariant like the exact mode, not
    # HF-identical (quality vs exact: docs/models.md#numerics-tiers); "auto" = for a quantized GGUF on CPU
    # in fp32 with AVX2 or AVX-512, the fastest mode measured llama.cpp-grade for its weight format (int8 or
    # int16: models/auto_numerics.py), exact otherwise
    numerics: str = "auto"
    # the KV cache's element type. "float16" (llama.cpp's default) halves the cache's memory and the bytes
    # attention reads a step, each K/V value rounded to half once, as it is written (attention reads a
    # token's K/V as the cache holds them from the step that makes them on, so speculative == plain and
    # alone == batched hold in the integer modes); "auto" = float16 in the integer numerics modes (they
    # meet the quality gates with it: README) and the run dtype otherwise (fp32 on CPU: HF-identical)
    kv_cache_dtype: str = "auto"
    seed: int = 0  # global RNG seed for unseeded sampling
    # structured outputs: tokens the grammar forces are verified and committed in the same forward as
    # the model's next token (same output, fewer forwards); False = one token per forward
    jump_forward: bool = True
    # ranks one model is split over (Megatron tensor parallelism, docs/parallel.md): this process is rank 0
    # and starts the others (gloo on CPU, NCCL on CUDA: one GPU per rank)
    tensor_parallel_size: int = 1
    progress: bool = True  # tqdm bars for loading and batch generation
    # vLLM's flag: the engine always runs eagerly (no CUDA graphs, no torch.compile), so both values hold
    enforce_eager: bool = False
    # vLLM's runner: "generate" (text) or "pooling" (LLM.embed / LLM.encode and /v1/embeddings on the final
    # hidden states, engine/pooling.py; no generation, a KV cache of one block unless sized, numerics "auto" =
    # exact); "auto" = generate
    runner: str = "auto"
    pooling_type: str = "last"  # pooling runner: "last" (the last token's hidden state) or "mean" (over the prompt)
    pooling_normalize: bool = True  # pooling runner: L2-normalise the pooled vector (a request may override)
    # vLLM's: the default sampling parameters of requests that omit them (engine/generation_config.py):
    # "auto" = the model's (generation_config.json / GGUF general.sampling.*), "vllm" = none, or a folder
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None  # applied on top (max_new_tokens, temperature, ...)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' requested but no CUDA device is available")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "staging_capacity"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        ms = self.max_step_ms
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int | float) or math.isnan(ms) or ms <= 0):
            raise ValueError(f"max_step_ms must be a positive number of milliseconds (inf: no time budget), got {ms!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.numerics not in ("auto", *NUMERICS):
            raise ValueError(f"numerics must be 'auto', 'exact', 'int8' or 'int16', got {self.numerics!r}")
        if self.numerics in ("int8", "int16") and (not self.gguf_kernels or self.device != "cpu"):
            raise ValueError(f"numerics={self.numerics!r} runs on the CPU block kernels: it needs device='cpu' "
                             "and gguf_kernels=True")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        n = self.tensor_parallel_size
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
        if n > 1 and self.device.startswith("cuda"):
            first = int(self.device.split(":")[1]) if ":" in self.device else 0
            if first + n > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={n} needs GPUs {first}..{first + n - 1}, but "
                                 f"{torch.cuda.device_count()} are visible")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks <= 0:
            raise ValueError(f"kv_cache_blocks must be > 0, got {self.kv_cache_blocks}")
        b = self.kv_cache_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
            raise ValueError(f"kv_cache_bytes must be a positive integer, got {self.kv_cache_bytes!r}")
        if self.kv_cache_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give kv_cache_blocks or kv_cache_bytes, not both")
        if not isinstance(self.kv_prefault, bool):
            raise ValueError(f"kv_prefault must be true or false, got {self.kv_prefault!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if isinstance(self.pooling_type, str) and self.pooling_type.lower() in POOLING_TYPES:
            object.__setattr__(self, "pooling_type", self.pooling_type.lower())  # vLLM spells them LAST / MEAN
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.pooling_normalize, bool):
            raise ValueError(f"pooling_normalize must be true or false, got {self.pooling_normalize!r}")
        if self.runner == "pooling" and self.kv_cache_blocks is None and self.kv_cache_bytes is None:
            # the pooling runner writes no K/V (engine/pooling.py): one block, not the ~1 GiB default
            object.__setattr__(self, "kv_cache_blocks", 1)
        if self.runner == "pooling" and self.numerics == "auto":
            # its forwards are whole prompts, where the exact mode is the faster one (1.3x the int16 mode's
            # prompts/s, benchmarks/bench_embeddings.py) and HF-identical
            object.__setattr__(self, "numerics", "exact")
        check_generation_config(self.generation_config, self.override_generation_config)
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")

    def step_time_target(self) -> float:
        """``max_step_ms`` with None resolved to the device's default (engine/step_cost.py)."""
        if self.max_step_ms is not None:
            return float(self.max_step_ms)
        return DEFAULT_MAX_STEP_MS["cuda" if self.device.startswith("cuda") else "cpu"]

    def torch_dtype(self) -> torch.dtype:
        return self.dtype_choice().dtype

    def kv_dtype(self, run_dtype: torch.dtype, numerics: str) -> torch.dtype:
        """The KV cache's element type for a run in ``run_dtype`` and ``numerics`` (the model's mode)."""
        chosen = KV_CACHE_DTYPES[self.kv_cache_dtype]
        if chosen is not None:
            return chosen
        return torch.float16 if numerics in ("int8", "int16") and run_dtype == torch.float32 else run_dtype

    def with_model_numerics(self, model: Any) -> EngineConfig:
        """``numerics="auto"`` resolved to the mode ``model`` was loaded in (the loader decides:
        models/registry.py); any explicit mode is kept."""
        if self.numerics != "auto":
            return self
        return dataclasses.replace(self, numerics=getattr(model, "numerics", "exact"))

    def dtype_choice(self) -> DtypeChoice:
        """The run dtype and why (``dtype="auto"``: engine/dtype.py)."""
        return choose_dtype(self.dtype, self.device, self.model, self.gguf_kernels)
