"""What a wheel carries (pyproject.toml's package data): a non-editable install must be able to build
the kernels, which compile at first use from the sources *and* the headers they include; a header
left out turns every GGUF model into the dense fallback without an error."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from ratchetlm import kernels

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "ratchetlm"


def _shipped(path: Path) -> bool:
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["ratchetlm"]
    rel = path.relative_to(PACKAGE).as_posix()
    return any(fnmatch.fnmatch(rel, g) for g in globs)  # (fnmatch's * also matches "/")


def test_every_kernel_source_and_header_is_package_data():
    files = list(kernels.SOURCES) + list(kernels.HEADERS)
    assert files and all(f.exists() for f in files)
    missing = [f.name for f in files if not _shipped(f)]
    assert not missing, f"not in pyproject's package-data: {missing}"


def test_kernel_headers_list_every_included_header():
    # the build's cache key hashes HEADERS: an included header missing there would reuse a stale library
    included = {m for f in kernels.SOURCES + kernels.HEADERS
                for m in re.findall(r'#include "([^"]+)"', f.read_text())}
    assert included == {h.name for h in kernels.HEADERS}
