"""A weights file mapped read-only for as long as the native step runs on it (runtime/backends/native/decoder.py): the
artifact holds the step's tiles, so the step reads them in place, from the page cache, and the process holds each
weight once and copies nothing at start. The file is checked against its manifest record in the one read that
brings it into the page cache (decoder.GraphWeights.check: its chunks read and hashed on every core,
core/file_hashes.py); the step's first use maps the cached pages.

Read through the mapping instead, every page of a real-size layer was mapped while the rest were still being read,
and once the page cache neared the host's memory the reads slowed to a third (the 21.7 GB FP8 K2 artifact on a
24 GiB host: 22 s against 12.9 s read into the page cache and mapped at first use)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np


class MappedFile:
    def __init__(self, path: Path):
        with open(path, "rb") as handle:  # the mapping keeps the file; the descriptor goes now
            size = handle.seek(0, 2)
            self.memory = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        if self.memory is not None and hasattr(mmap, "MADV_HUGEPAGE"):
            self.memory.madvise(mmap.MADV_HUGEPAGE)  # where the kernel maps the page cache's large folios whole
        self.bytes = np.frombuffer(self.memory, np.uint8) if size else np.zeros(0, np.uint8)
