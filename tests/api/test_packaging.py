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


def _stand_in_compiler(tmp_path: Path, fail: bool = False) -> Path:
    """A "compiler" that answers --version and writes each -o file (or fails every call): what the build
    asks of gcc, without the minute a real build takes (the real compile is every kernel test's)."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo stand-in cc 1.0; exit 0; fi\n'
                  + ("exit 1\n" if fail else 'while [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n'))
    cc.chmod(0o755)
    return cc


def _run_pips_build_py(monkeypatch) -> None:
    """setup.py's build_py command as pip runs it (setuptools' own copying stubbed out)."""
    import runpy

    import setuptools
    from setuptools.command.build_py import build_py
    from setuptools.dist import Distribution

    captured: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    runpy.run_path(str(REPO / "setup.py"))
    monkeypatch.setattr(build_py, "run", lambda self: None)
    captured["cmdclass"]["build_py"](Distribution()).run()


def test_pip_install_builds_the_library_load_looks_for(monkeypatch, tmp_path):
    """pip install (editable or not) runs build_py, which builds the kernels into the user's cache under the
    name load() looks for on this machine: a fresh install's first `ratchet generate` compiles nothing."""
    cc = _stand_in_compiler(tmp_path)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RATCHETLM_NO_KERNEL_BUILD", raising=False)
    _run_pips_build_py(monkeypatch)
    wanted = kernels.cache_dir() / kernels.build._library_name(kernels.build._version(str(cc)), ["-march=native"])
    assert [p.name for p in kernels.cache_dir().glob("*.so")] == [wanted.name]


def test_a_failed_kernel_build_never_fails_the_install(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("CC", str(_stand_in_compiler(tmp_path, fail=True)))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RATCHETLM_NO_KERNEL_BUILD", raising=False)
    _run_pips_build_py(monkeypatch)  # no exception (it tried the cache and the temp folder, both builds failed)
    assert "the first use will try" in capfd.readouterr().err
