"""Memory figures the kernel reports in /proc: what this host can still give, what a process holds."""

from __future__ import annotations

import os
from pathlib import Path


def proc_kib(path: str, key: str) -> int | None:
    """The `key:  N kB` line of a /proc file (meminfo, self/status) in bytes; None where the file or line is absent."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory() -> int:
    """Bytes of memory this host can still give (MemAvailable; physical memory where /proc/meminfo is absent)."""
    available = proc_kib("/proc/meminfo", "MemAvailable")
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
