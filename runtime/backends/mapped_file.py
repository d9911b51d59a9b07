"""A weights file mapped read-only for as long as the native step runs on it (runtime/backends/native_decode.py): the
artifact holds the step's tiles, so the step reads them in place, from the page cache, and the process holds each
weight once and copies nothing at start. The file is checked against its manifest record in the one read that
brings it into the page cache (native_decode.GraphWeights.check: its chunks read and hashed on every core,
core/file_hashes.py); the step's first use maps the cached pages.

Read through the mapping instead, every page of a real-size layer was mapped while the rest were still being read,
and once the page cache neared the host's memory the reads slowed to a third (the 21.7 GB FP8 K2 artifact on a
24 GiB host: 22 s against 12.9 s read into the page cache and mapped at first use). Once checked, `populate` maps
the cached pages at start (Linux's MADV_POPULATE_READ), so that the first decode steps do not fault in each routed
expert's pages as they first choose it."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

MADV_POPULATE_READ = 22  # Linux 5.14: map the pages now, reading any the page cache does not hold
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class MappedFile:
    def __init__(self, path: Path):
        with open(path, "rb") as handle:  # the mapping keeps the file; the descriptor goes now
            size = handle.seek(0, 2)
            self.memory = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        if self.memory is not None and hasattr(mmap, "MADV_HUGEPAGE"):
            self.memory.madvise(mmap.MADV_HUGEPAGE)  # where the kernel maps the page cache's large folios whole
        self.bytes = np.frombuffer(self.memory, np.uint8) if size else np.zeros(0, np.uint8)

    def populate(self, start: int = 0, stop: int | None = None) -> bool:
        """Maps bytes start .. stop of the file (default: all) into the process now, from the page cache where the
        check left them -> whether the system did (False without MADV_POPULATE_READ: each page then maps at its first
        use)."""
        stop = len(self.bytes) if stop is None else min(stop, len(self.bytes))
        if self.memory is None or start >= stop or not hasattr(_libc, "madvise"):
            return False
        page = mmap.PAGESIZE
        start -= start % page
        return _libc.madvise(ctypes.c_void_p(self.bytes.ctypes.data + start), ctypes.c_size_t(stop - start),
                             MADV_POPULATE_READ) == 0


POPULATE_BYTES = 256 << 20  # a thread's run of a file's pages in populate_all


def populate_all(files: list[MappedFile], threads: int) -> None:
    """Every file mapped in (MappedFile.populate), runs of POPULATE_BYTES on `threads` threads at once (the page
    tables of a real-size layer take seconds on one)."""
    runs = [(f, at) for f in files for at in range(0, len(f.bytes), POPULATE_BYTES)]
    with ThreadPoolExecutor(max(1, threads)) as pool:  # madvise lets go of the GIL (ctypes)
        list(pool.map(lambda run: run[0].populate(run[1], run[1] + POPULATE_BYTES), runs))
