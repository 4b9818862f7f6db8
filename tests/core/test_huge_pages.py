"""memory/huge_pages.py: packed weights and CPU KV pools are cut from huge-page chunks, and that memory is
ordinary, separate and aligned."""

import mmap

import numpy as np
import pytest
import torch

from ratchetlm import kernels
from ratchetlm.kv.pools import Pools
from ratchetlm.layers.block_quant import BlockWeight
from ratchetlm.memory import huge_pages

from .test_block_kernels import random_raw


def mapping(a: np.ndarray) -> mmap.mmap | None:
    """The anonymous mapping an array was cut from (np.frombuffer's base is a memoryview of it)."""
    obj = getattr(a.base, "obj", None)
    return obj if isinstance(obj, mmap.mmap) else None


def test_arrays_are_aligned_separate_and_outlive_their_chunk() -> None:
    small, big = huge_pages.MIN_BYTES, huge_pages.NUMPY_HUGE
    sizes = [small + 5, 3 * small, big - 1, 100, big]
    arrays = [huge_pages.empty(n) for n in sizes * 3]
    for a, n in zip(arrays, sizes * 3, strict=True):
        assert a.dtype == np.uint8 and a.shape == (n,) and a.flags.writeable
        chunked = small <= n < big  # below: not worth it; above: numpy's own arrays get huge pages
        assert (mapping(a) is not None) == chunked
        if chunked:
            assert a.ctypes.data % huge_pages.ALIGN == 0
    for i, a in enumerate(arrays):
        a[:] = i
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))  # no overlap
    assert all(bool((a == i).all()) for i, a in enumerate(arrays))
    # fill chunks past the current one: earlier arrays keep their mapping and their bytes
    rest = [huge_pages.empty(big // 2) for _ in range(2 * huge_pages.CHUNK // big + 2)]
    assert len({id(mapping(r)) for r in rest}) >= 2
    assert all(bool((a == i).all()) for i, a in enumerate(arrays))


def test_packed_weights_live_in_huge_page_chunks() -> None:
    lib = kernels.load()
    if lib is None:
        pytest.skip("no kernel library")
    k = 2048  # Q4_K, 64 rows: a 72 KB packed value array, above MIN_BYTES
    _, q, sm, _ = BlockWeight.from_gguf("Q4_K", random_raw("Q4_K", 64, k, seed=3), k).pack_q8(lib)
    assert q.nbytes >= huge_pages.MIN_BYTES
    assert mapping(q) is not None and q.ctypes.data % huge_pages.ALIGN == 0


def test_cpu_kv_pools_come_from_huge_page_chunks_zeroed_and_separate(monkeypatch: pytest.MonkeyPatch) -> None:
    cut: list[np.ndarray] = []
    real = huge_pages.empty

    def empty(nbytes: int) -> np.ndarray:
        cut.append(real(nbytes))
        cut[-1][:] = 0xFF  # garbage: the pool must be zeroed all the same
        return cut[-1]

    monkeypatch.setattr(huge_pages, "empty", empty)
    pools = Pools()
    k = pools.add("k", 3, 40, (2, 8), torch.float16, "cpu")
    v = pools.add("v", 3, 40, (2, 8), torch.bfloat16, "cpu")
    assert len(cut) == 2 and k.data_ptr() == cut[0].ctypes.data and v.data_ptr() == cut[1].ctypes.data
    assert k.shape == (3, 40, 2, 8) and k.dtype == torch.float16 and v.dtype == torch.bfloat16
    assert not k.any() and not v.any()
    k.fill_(1.0)
    assert not v.any()


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_large_pools_are_zero_pages_until_written() -> None:
    """A large pool (the default ~1 GiB KV cache) is a mapping of its own: zero, huge-page aligned,
    and resident only where rows are written (zeroing it all cost ~1 s of system CPU per engine)."""
    n = 64 << 20
    before = _rss_kb()
    t = huge_pages.zeros((2, n // 8, 2), torch.float16)  # 2 * n/8 * 2 * 2 bytes = n
    assert t.shape == (2, n // 8, 2) and t.dtype == torch.float16
    assert t.data_ptr() % huge_pages.HUGE == 0
    assert _rss_kb() - before < n // 1024 // 4  # not touched: not resident
    assert not t.any()  # reads see zeros (the kernel's zero page)
    t[1, 7].fill_(3.0)
    assert t[1, 7].tolist() == [3.0, 3.0] and int(t.count_nonzero()) == 2
    u = huge_pages.zeros((n // 4,), torch.float32)  # a second mapping, separate from the first
    assert not u.any() and u.data_ptr() != t.data_ptr()
