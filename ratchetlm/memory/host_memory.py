"""Memory this process may still take on the host: what the loader checks a dense weight copy against
before allocating it (a container's limit counts, not only the machine's free memory)."""

from __future__ import annotations

from pathlib import Path


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo, capped by the cgroup's limit less its usage (v2, else v1);
    None where neither is readable (not Linux)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):  # v1 writes ~2^63 for none
            room = max(limit - usage, 0)
            avail = room if avail is None else min(avail, room)
            break
    return avail
