"""How much memory this host can still give."""

from __future__ import annotations

import os
from pathlib import Path


def available_memory() -> int:
    """Bytes of memory this host can still give (MemAvailable; physical memory where /proc/meminfo is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
