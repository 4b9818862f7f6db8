"""Releasing a repacked weight's file pages: RSS falls, the bytes stay, anonymous memory is never touched."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from ratchetlm.layers.mapped_pages import is_read_only_file_view, release_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED) is Linux's")


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_a_file_view_gives_its_pages_back_and_reads_the_same_bytes(tmp_path):
    n = 64 * mmap.PAGESIZE * 16  # 4 MB
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    path = tmp_path / "w.bin"
    data.tofile(path)
    m = np.memmap(path, mode="r")
    view = m[123:].reshape(-1, 1).view(np.uint8)  # an unaligned start, like a tensor inside a GGUF
    assert is_read_only_file_view(view)
    assert int(view.astype(np.int64).sum()) == int(data[123:].astype(np.int64).sum())  # touch every page
    before = _rss_file_kb()
    released = release_pages(view)
    assert released >= n - 2 * mmap.PAGESIZE  # every page wholly inside the view
    assert _rss_file_kb() <= before - released // 1024 // 2  # resident file pages actually dropped
    assert np.array_equal(np.asarray(view)[:, 0], data[123:])  # faulted back in from the file


@pytest.mark.parametrize("make", [
    lambda: np.arange(1 << 20, dtype=np.uint8),  # anonymous memory: MADV_DONTNEED would zero it
    lambda: np.arange(1 << 20, dtype=np.uint8)[::2],
])
def test_memory_that_is_not_a_read_only_file_view_is_left_alone(make):
    a = make()
    a.flags.writeable = False
    expected = a.copy()
    assert not is_read_only_file_view(a)
    assert release_pages(a) == 0
    assert np.array_equal(a, expected)


def test_a_writable_file_mapping_is_left_alone(tmp_path):
    path = tmp_path / "w.bin"
    np.full(1 << 20, 7, np.uint8).tofile(path)
    m = np.memmap(path, mode="r+")
    m[:10] = 9  # a dirty private page would be lost (or a shared one written back): never advise these
    assert release_pages(m) == 0
    assert int(m[0]) == 9
