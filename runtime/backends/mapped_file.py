"""A weights file mapped read-only for as long as the native step runs on it (runtime/backends/native_decode.py): the
artifact holds the step's tiles, so the step reads them in place, from the page cache, and the process holds each
weight once and copies nothing at start. The file is checked against its manifest record in the same read that
brings it into memory: `matches` hashes its chunks through the mapping, one a thread (core/file_hashes.py), asking
the disk for each chunk ahead of its hash."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from ...core import file_hashes


class MappedFile:
    def __init__(self, path: Path):
        with open(path, "rb") as handle:  # the mapping keeps the file; the descriptor goes now
            size = handle.seek(0, 2)
            self.memory = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        if self.memory is not None and hasattr(mmap, "MADV_HUGEPAGE"):
            self.memory.madvise(mmap.MADV_HUGEPAGE)  # where the kernel maps the page cache's large folios whole
        self.bytes = np.frombuffer(self.memory, np.uint8) if size else np.zeros(0, np.uint8)

    def _read(self, offset: int, length: int) -> memoryview:
        if hasattr(mmap, "MADV_WILLNEED"):
            start = offset // mmap.PAGESIZE * mmap.PAGESIZE
            self.memory.madvise(mmap.MADV_WILLNEED, start, offset + length - start)
        return self.bytes[offset:offset + length].data

    def matches(self, record: dict, threads: int) -> bool:
        """Whether the file's bytes are the ones its manifest record lists, hashed through the mapping (which then
        holds them: the step's first use reads no disk)."""
        return len(self.bytes) == record["bytes"] and file_hashes.matches(record, self._read, threads)
