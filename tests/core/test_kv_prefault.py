"""kv/prefault.py and memory/huge_pages.populate: the CPU KV pools' pages are backed ahead of the blocks in use,
by a thread, without changing a byte; residency is read with mincore(2), not through the code under test."""

import ctypes
import mmap

import pytest
import torch

from ratchetlm import SamplingParams
from ratchetlm.engine.config import EngineConfig
from ratchetlm.engine.llm_engine import LLMEngine
from ratchetlm.kv.prefault import Prefault
from ratchetlm.memory import huge_pages

PAGE = mmap.PAGESIZE


def resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s span that are backed (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // PAGE * PAGE
    n = -(-(t.data_ptr() + t.numel() * t.element_size() - start) // PAGE)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * PAGE), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def pool(layers: int = 3, rows: int = 40_000) -> torch.Tensor:  # [layers, rows, 2, 64] half: a fresh mapping
    return huge_pages.zeros((layers, rows, 2, 64), torch.float16)


def populate_or_skip(t: torch.Tensor) -> None:
    if not huge_pages.populate(t):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")


def test_populate_backs_every_page_and_changes_no_byte() -> None:
    t = pool()
    data = torch.randn(10, 2, 64, generator=torch.Generator().manual_seed(0)).half()
    t[1, 1000:1010] = data  # rows written before the advice
    untouched = t[2, 10_000:30_000]  # 5 MB no one has written
    assert resident_pages(untouched) < 2 * huge_pages.HUGE // PAGE  # a fresh mapping: unbacked
    populate_or_skip(t[1:3])
    pages = -(-(untouched.data_ptr() + untouched.numel() * 2) // PAGE) - untouched.data_ptr() // PAGE
    assert resident_pages(untouched) == pages  # (checked before anything below reads the pool)
    assert torch.equal(t[1, 1000:1010], data)  # the advice writes nothing: the rows written stay,
    assert int(t.count_nonzero()) == int(data.count_nonzero())  # and every other byte is still zero


def test_prefault_backs_the_rows_ahead_of_those_in_use_and_no_further() -> None:
    t = pool()
    pf = Prefault([t, pool()])
    populate_or_skip(t[0, :1])
    assert pf.ahead_rows == huge_pages.HUGE // (2 * 64 * 2)  # a huge page of one layer's rows
    pf.ahead(pf.ahead_rows - 1)  # less than a huge page of rows in use: the first writes fault what it would
    assert pf._worker is None and pf.wanted == 0
    pf.ahead(pf.ahead_rows + 500)
    pf.wait()
    assert pf.done == pf.wanted == 2 * pf.ahead_rows + 500
    for layer in range(3):
        backed, beyond = t[layer, : pf.done], t[layer, pf.done + PAGE :]
        assert resident_pages(backed) * PAGE >= backed.numel() * 2  # every row asked for
        assert resident_pages(beyond) * PAGE <= 2 * huge_pages.HUGE  # not the rest (at most a huge page it shares)
    pf.ahead(pf.ahead_rows + 400)  # nothing new wanted: no worker
    assert pf._worker is None and pf.wanted == 2 * pf.ahead_rows + 500
    pf.ahead(10**9)  # capped at the pool
    pf.wait()
    assert pf.done == t.shape[1] and pf._worker is None


def generate(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    seqs = [eng.seqs[eng.add_request(p, params)] for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [list(s.output_ids) for s in seqs]


def test_an_engine_backs_its_pool_ahead_of_its_blocks_and_decodes_the_same_tokens(llm_default) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [llm_default.tokenize(p) for p in ("The capital of France is", "Write a haiku about rain.")]
    outs = {}
    for on in (True, False):
        cfg = EngineConfig(kv_prefault=on, kv_cache_blocks=4096, progress=False, numerics=llm_default.config.numerics)
        eng = LLMEngine(cfg, llm_default.engine.model, llm_default.model_config, tokenizer=llm_default.tokenizer)
        outs[on] = generate(eng, prompts, params)
        runner = eng.runner
        if not on:
            assert runner.prefault == []
            continue
        (pf, blocks), = runner.prefault
        assert pf.done == 0 and pf._worker is None  # a few blocks in use: no thread, the writes back them
        blocks.high_water = 2 * pf.ahead_rows // blocks.block_size  # as if earlier requests had reached there
        assert generate(eng, prompts, params) == outs[on]
        pf.wait()
        in_use = blocks.high_water * blocks.block_size
        assert pf.done == min(pf.rows, in_use + pf.ahead_rows) and pf.supported
        k = runner.cache.stacked["k"]
        assert resident_pages(k[5, in_use : pf.done]) * PAGE >= k[5, in_use : pf.done].numel() * k.element_size()
    assert outs[True] == outs[False]


def test_kv_prefault_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="kv_prefault must be true or false"):
        EngineConfig(kv_prefault="yes")  # type: ignore[arg-type]
