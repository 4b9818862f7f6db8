"""Shared parts of benchmarks/gpu_check.py: the run's clock, the models it writes and loads, and the
timed runs of ours and of HF transformers' ``generate`` on the same weights."""

from __future__ import annotations

import argparse
import contextlib
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ratchetlm import LLM, SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]
# Llama 3.2 1B's shape; SmolLM2-135M's (the default model's) for its random stand-in
SHAPE_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
SHAPE_135M = dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)  # --dry-run
DEFAULT_SPEC = {"method": "ngram"}  # the speculative strategy's defaults (n-gram, depth 8, gain schedule)
# the training-free trees (Token Recycling + suffix matches), sized by the cost curve the engine measures: where a
# verify row costs little (a GPU) they grow to tree_nodes, which is what MAL >= 2.5 on the default model needs
# (issue 37). With rows priced free on a CPU (21 Spec-Bench cases, docs/benchmarks.md) the default model read
# MAL 2.53 at 16 nodes (the default) and 2.79 at 32: the GPU run measures whether 32 pays there.
TREE_SPEC = {"method": "hybrid"}
TREE32_SPEC = {"method": "hybrid", "tree_nodes": 32}

class Clock:
    """The run's deadline and one section's: ``left()`` is the smaller of what both have left. A
    section's budget is its own seconds plus what earlier sections left unspent."""

    def __init__(self, total: float) -> None:
        self.end = time.perf_counter() + total
        self.section_end = self.end
        self.bank = 0.0  # seconds earlier sections did not use

    def start(self, seconds: float) -> None:
        self.section_end = min(self.end - 5.0, time.perf_counter() + seconds + self.bank)

    def stop(self) -> None:
        self.bank = max(0.0, self.left())

    def left(self) -> float:
        return self.section_end - time.perf_counter()

    def total_left(self) -> float:
        return self.end - time.perf_counter()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------- models


def write_llama(folder: Path, shape: dict[str, Any], dev: torch.device, seed: int = 0) -> Path:
    """A random-weight HF ``LlamaForCausalLM`` of ``shape`` saved in bf16 with the tests' byte tokenizer
    (its 258 ids are the low end of the model's vocabulary; prompts here are token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.tiny import byte_tokenizer

    cfg = LlamaConfig(**shape, max_position_embeddings=4096, bos_token_id=256, eos_token_id=257, pad_token_id=0,
                      head_dim=shape["hidden_size"] // shape["num_attention_heads"])
    torch.manual_seed(seed)
    with torch.device(dev):  # a 1B model's random init is seconds on a GPU, a minute on a CPU
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    del model
    return folder


class Models:
    """The two models of the run, as ``{name: spec}``; a spec says where the weights are for ours and HF."""

    def __init__(self, args: argparse.Namespace, dev: torch.device, tmp: Path) -> None:
        self.dev, self.tmp, self.notes = dev, tmp, []
        big = TINY if args.dry_run else SHAPE_1B
        self.specs: dict[str, dict[str, Any]] = {
            "llama-1b-shape (random)": dict(path=str(write_llama(tmp / "llama1b", big, dev)), gguf=None, real=False)}
        default = None if args.dry_run else _default_gguf(args.default_model, self.notes)
        if default is not None:
            self.specs["SmolLM2-135M-Instruct Q4_1 (default)"] = dict(path=str(default), gguf=default, real=True)
        else:
            small = dict(TINY, num_hidden_layers=3) if args.dry_run else SHAPE_135M
            self.specs["smollm2-135m-shape (random)"] = dict(path=str(write_llama(tmp / "smol", small, dev, 1)),
                                                             gguf=None, real=False)
        self._ours: dict[tuple[str, str], LLM] = {}

    def ours(self, name: str, dtype: str) -> LLM:
        key = (name, dtype)
        if key not in self._ours:
            self._ours[key] = LLM(self.specs[name]["path"], device=str(self.dev), dtype=dtype, progress=False,
                                  max_num_seqs=128, kv_cache_bytes=(4 << 30) if self.dev.type == "cuda" else 1 << 22,
                                  numerics="exact")  # HF-identical on CPU too (CUDA runs nothing else)
        return self._ours[key]

    def hf(self, name: str, dtype: torch.dtype) -> Any:
        from transformers import AutoModelForCausalLM

        s = self.specs[name]
        if s["gguf"] is not None:
            p = Path(s["gguf"])
            m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
        else:
            m = AutoModelForCausalLM.from_pretrained(s["path"], dtype=dtype)
        return m.to(self.dev).eval()


def _default_gguf(path: str | None, notes: list[str]) -> Path | None:
    """The default model's GGUF (``--default-model`` or the installed wheel), None with a note if absent
    or if HF cannot read it (no ``gguf`` package)."""
    try:
        import gguf  # noqa: F401

        from ratchetlm.models.loader import default_model_path

        p = Path(path) if path else default_model_path()
        if not p.is_file():
            raise FileNotFoundError(p)
        return p
    except Exception as e:  # noqa: BLE001 (reported; a random model of its shape stands in)
        notes.append(f"default model not used ({type(e).__name__}: {e}); a random model of its shape stands in")
        return None


# ---------------------------------------------------------------- measurements


def engine_on(llm: LLM, dev: torch.device, dtype: str, decoding: dict[str, Any] | None = None) -> LLMEngine:
    cfg = EngineConfig(device=str(dev), dtype=dtype, decoding="speculative" if decoding else "autoregressive",
                       decoding_options=decoding or {}, kv_cache_blocks=llm.engine.blocks.num_blocks,
                       max_num_seqs=128, progress=False)
    return LLMEngine(cfg, llm.engine.model, llm.model_config)


def run_ours(eng: LLMEngine, prompts: list[list[int]], n: int, dev: torch.device, ignore_eos: bool = True,
             stats: dict[str, int] | None = None) -> tuple[list[list[int]], float, float]:
    """Greedy (EOS ignored unless ``ignore_eos`` is False): outputs, seconds from arrival to the last token,
    and decode-phase seconds (from the step at which every sequence holds its first token, as ``ratchet
    bench`` times decode); ``stats["decode_steps"]``: the steps after that one (MAL's denominator)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)
    sync(dev)
    t0 = time.perf_counter()
    ids = [eng.add_request(p, params) for p in prompts]
    t_first = None
    decode_steps = 0
    while eng.has_unfinished():
        eng.step()
        decode_steps += t_first is not None
        if t_first is None and all(eng.seqs[i].output_ids for i in ids):
            sync(dev)
            t_first = time.perf_counter()
    if stats is not None:
        stats["decode_steps"] = decode_steps
    sync(dev)
    end = time.perf_counter()
    outs = []
    for i in ids:
        seq = eng.release(i)
        assert seq is not None
        outs.append(list(seq.output_ids))
    return outs, end - t0, end - (t_first or t0)


def hf_generate(model: Any, prompts: list[list[int]], n: int, dev: torch.device, **kw: Any) -> tuple[list[list[int]],
                                                                                                      float]:
    """HF greedy ``generate`` of exactly ``n`` tokens per prompt (equal-length prompts, no padding)."""
    x = torch.tensor(prompts, device=dev)
    sync(dev)
    t = time.perf_counter()
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, **kw)
    sync(dev)
    return y[:, x.shape[1]:].tolist(), time.perf_counter() - t


def hf_decode_tps(model: Any, prompts: list[list[int]], n: int, dev: torch.device, **kw: Any) -> float:
    """Decode tokens/s: (n - 1) tokens a prompt over the time of ``n`` tokens less that of the first
    (prefill + one token), each the faster of two after a warm-up (which compiles, where it does)."""
    hf_generate(model, prompts, n, dev, **kw)
    t_n = min(hf_generate(model, prompts, n, dev, **kw)[1] for _ in range(2))
    t_1 = min(hf_generate(model, prompts, 1, dev, **kw)[1] for _ in range(2))
    return len(prompts) * (n - 1) / max(t_n - t_1, 1e-9)


def id_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (count, length), generator=g).tolist()


@contextlib.contextmanager
def cell(out: dict[str, Any], key: str, clock: Clock, need: float = 0.0) -> Iterator[bool]:
    """Run one measurement unless the section is over budget (``need``: seconds it must have left);
    an exception is recorded under ``key`` and the run goes on."""
    if clock.left() <= need:
        out.setdefault("over_budget", []).append(f"{key}: over the section's time budget")
        yield False
        return
    try:
        yield True
    except Exception as e:  # noqa: BLE001 (one failed cell must not cost the rest of the device run)
        out.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
        traceback.print_exc()


def half(dev: torch.device) -> str:
    """bf16 on a GPU; fp32 in a CPU dry run (bf16 matmuls on a CPU without bf16 units take minutes)."""
    return "bfloat16" if dev.type == "cuda" else "float32"


