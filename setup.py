"""pip's build hook: everything else about the package is in pyproject.toml.

``build_py`` also compiles the CPU kernels for this machine into the user's kernel cache
(ratchetlm/kernels/build.py, loaded by path: pip builds in an isolated environment without torch), so
that a fresh install's first ``ratchet generate`` compiles nothing. It never fails the install: where the
build cannot run here (no compiler, a read-only home) the first use builds the kernels instead.
``RATCHETLM_NO_KERNEL_BUILD=1`` skips it (building a wheel for other machines: the cache key holds this
CPU's flags, so a library built here would not be used there).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BUILD = Path(__file__).resolve().parent / "ratchetlm" / "kernels" / "build.py"


def build_kernels() -> None:
    if os.environ.get("RATCHETLM_NO_KERNEL_BUILD"):
        return
    try:
        spec = importlib.util.spec_from_file_location("_ratchetlm_kernel_build", BUILD)
        assert spec is not None and spec.loader is not None
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        t0 = time.perf_counter()
        path = build.prebuild()
        took = time.perf_counter() - t0
        note = f"CPU kernels in {path} ({took:.0f} s)" if path else "CPU kernels not built: the first use will try"
        print(f"ratchetlm: {note}", file=sys.stderr)
    except Exception as e:  # never fail an install over the kernels: the first use builds them
        print(f"ratchetlm: CPU kernels not built at install ({e!r}); the first use will try", file=sys.stderr)


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        build_kernels()


setup(cmdclass={"build_py": BuildPyWithKernels})
