"""A file's digests chunk by chunk, so that a large file is checked on every core at once, at the disk's pace.

The exporter records each data file's BLAKE3 digest of each CHUNK_BYTES chunk (the manifest's `chunk_bytes` and
`chunk_blake3`); a reader checks the chunks, a contiguous run of them a thread, in the same read that brings the
file into memory, so every byte is covered by a chunk's digest. BLAKE3 because of its pace: 9.1-9.5 GB/s on one
core of an AVX-512 AMD EPYC against sha256's 2.0 there with the SHA extensions and 0.72 without them (as on a
Skylake or Cascade Lake Xeon), so the threads of a check wait on the disk, not on a core (`python
benchmarks/file_digests.py`). Artifacts exported before it hold sha256
records (whole, and per chunk in the last of them); those are checked as they were.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import blake3

CHUNK_BYTES = 64 << 20  # bytes each chunk digest covers (the last chunk may be shorter)
SMALLEST_CHUNK = 1 << 16  # a manifest's chunk_bytes at least this: its digest list stays short
READ_BYTES = 8 << 20  # bytes hashed at a time
READS_IN_FLIGHT = 8  # a file's chunks read on at least this many threads: a disk serves several streams faster
# than one (the INT4 K2 artifact's 14.8 GB from a virtual disk: 4.3-5.0 s on 8, 5.2-6.3 s on 2, 8.3-9.0 s in one
# stream of 1 MiB reads, alternating); with BLAKE3 the threads wait on the disk, not on a core
CHUNK_DIGESTS = {"chunk_blake3": blake3.blake3, "chunk_sha256": hashlib.sha256}  # record key -> its digest


class ChunkDigests:
    """The BLAKE3 digest of each CHUNK_BYTES chunk of a stream, fed in any pieces."""

    def __init__(self):
        self.chunk, self.filled, self.chunks = blake3.blake3(), 0, []

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), CHUNK_BYTES - self.filled)
            self.chunk.update(view[:take])  # lets go of the interpreter lock over large buffers
            self.filled += take
            view = view[take:]
            if self.filled == CHUNK_BYTES:
                self.chunks.append(self.chunk.hexdigest())
                self.chunk, self.filled = blake3.blake3(), 0

    def record(self) -> dict:
        """{chunk_bytes, chunk_blake3} of everything fed."""
        chunks = self.chunks + ([self.chunk.hexdigest()] if self.filled else [])
        return {"chunk_bytes": CHUNK_BYTES, "chunk_blake3": chunks}


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def chunk_key(record: dict) -> str | None:
    """The record's key of chunk digests ("chunk_blake3" or "chunk_sha256"), None where it holds a whole sha256 only."""
    return next((key for key in CHUNK_DIGESTS if key in record), None)


def matches(record: dict, read: Callable[[int, int], object], threads: int) -> bool:
    """Whether the bytes read(offset, length) gives (a buffer) are the ones `record` ({bytes, chunk_bytes,
    chunk_blake3 | chunk_sha256} or {bytes, sha256}; its shape checked: core/manifest.py) lists: its chunks on
    `threads` threads, each a contiguous run of them (one sequential read of its part of the file), else whole."""
    size, key = record["bytes"], chunk_key(record)
    if key is None:
        return _digest(hashlib.sha256, read, 0, size) == record["sha256"]
    step, chunks, kind = record["chunk_bytes"], record[key], CHUNK_DIGESTS[key]

    def run_matches(run: range) -> bool:
        return all(_digest(kind, read, i * step, min((i + 1) * step, size)) == chunks[i] for i in run)

    count = max(1, min(threads, len(chunks)))
    runs = [range(len(chunks) * t // count, len(chunks) * (t + 1) // count) for t in range(count)]
    with ThreadPoolExecutor(max_workers=count) as pool:
        return all(pool.map(run_matches, runs))


def _digest(kind: Callable, read: Callable[[int, int], object], start: int, stop: int) -> str:
    """kind's hex digest of bytes start:stop, read READ_BYTES at a time (a chunk of any size costs no more memory)."""
    digest = kind()
    for offset in range(start, stop, READ_BYTES):
        digest.update(read(offset, min(READ_BYTES, stop - offset)))
    return digest.hexdigest()


def files_matching(files: list[tuple[object, dict]], threads: int) -> list[bool]:
    """Whether each (path, record) file on disk holds the bytes its record lists: one file after another (a virtual
    disk gave 14.8 GB in 5.2-6.0 s so, 6.0-7.1 s with each thread's run across all the files), each on `threads`
    threads, READS_IN_FLIGHT at least, every thread reading through descriptors of its own (so that the kernel's
    read-ahead follows each thread's run of the file): faster than one plain sequential read of them; False for a
    file that cannot be read through."""
    return [_file_matches(path, record, max(threads, READS_IN_FLIGHT)) for path, record in files]


def _file_matches(path, record: dict, threads: int) -> bool:
    local = threading.local()
    opened: list[int] = []

    def read(offset: int, length: int) -> memoryview:  # valid until the thread's next read
        if not hasattr(local, "fd"):
            local.fd = os.open(path, os.O_RDONLY)
            opened.append(local.fd)
            local.buffer = memoryview(bytearray(READ_BYTES))  # no fresh pages to fault in and zero for every read
        data = local.buffer[:length]
        if os.preadv(local.fd, [data], offset) != length:
            raise OSError(f"{path}: cut short")
        return data

    try:
        return matches(record, read, threads)
    except OSError:
        return False
    finally:
        for fd in opened:
            os.close(fd)
