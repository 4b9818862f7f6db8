"""docs/architecture.md is the map of the code, and a map that names files that are gone misleads a
newcomer. Every source file it names exists (a bare name or a partial path matches the end of a real
path; ``serving_*.py`` is a glob), and every package under ratchetlm/ is on it."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = (ROOT / "docs" / "architecture.md").read_text()
# a path-like mention of a source file: `engine/llm.py`, `llama.py`, `protocol*.py`, `attention_avx2.h`
MENTION = re.compile(r"(?<![\w./-])((?:[a-z_0-9]+/)*[a-z_0-9*]+\.(?:py|c|h))\b")


def repo_files() -> list[str]:
    out = []
    for top in ("ratchetlm", "benchmarks", "tests", "docs"):
        out += [p.relative_to(ROOT).as_posix() for p in (ROOT / top).rglob("*") if p.is_file()]
    return out + [p.name for p in ROOT.iterdir() if p.is_file()]


def named_files(text: str) -> set[str]:
    return {m.group(1) for m in MENTION.finditer(text)}


def missing(names: set[str], files: list[str]) -> list[str]:
    return sorted(n for n in names if not any(fnmatch.fnmatch(f, n) or fnmatch.fnmatch(f, "*/" + n) for f in files))


def test_every_file_the_map_names_exists():
    names = named_files(MAP)
    assert len(names) > 50  # the pattern still finds the map's file names
    assert missing(names, repo_files()) == []


def test_a_stale_name_is_caught():
    files = repo_files()
    assert missing({"engine/scheduler.py", "scheduler.py", "serving_*.py"}, files) == []
    assert missing({"engine/schedule_old.py", "kv/scheduler.py"}, files) == ["engine/schedule_old.py",
                                                                             "kv/scheduler.py"]


def test_every_package_is_on_the_map():
    packages = [p.name for p in (ROOT / "ratchetlm").iterdir() if (p / "__init__.py").is_file()]
    assert "decoding" in packages
    assert [p for p in packages if f"{p}/" not in MAP] == []
