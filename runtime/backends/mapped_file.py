"""A weights file mapped read-only and read from the disk once: where the manifest's sha256 is still to check, a
thread hashes the file in order, asking the disk for the bytes ahead of it, while the native step's loader lays the
same page-cache pages out (runtime/backends/native_decode.py). The hash costs no second read, and the pages the loader is
done with leave the process and, with `drop`, the page cache too: the laid-out copy then takes the place of the
file's pages instead of crowding them, as it must where both do not fit."""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from pathlib import Path

import numpy as np

CHUNK = 8 << 20  # bytes hashed at a time
AHEAD = 64 << 20  # bytes asked of the disk ahead of the hash (posix_fadvise WILLNEED): reading overlaps hashing


class MappedFile:
    def __init__(self, path: Path, sha256: str | None = None, drop: bool = False):
        """sha256: the digest the file must have, hashed from now on (`check` waits for it); None: hashed already.
        drop: pages let go of (`forget`) leave the page cache too, once the hash has read them."""
        with open(path, "rb") as handle:
            self.fd = os.dup(handle.fileno())
        size = os.fstat(self.fd).st_size
        self.memory = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if size else None
        self.bytes = np.frombuffer(self.memory, np.uint8) if size else np.zeros(0, np.uint8)
        self.drop = drop
        self.hashed_to, self.digest = (0, None) if sha256 else (size, sha256)
        self._thread = threading.Thread(target=self._hash, daemon=True) if sha256 else None
        if self._thread:
            self._thread.start()

    def _hash(self) -> None:
        """Reads the file through in order into a buffer of its own (so that its pages go to the page cache, not
        into this process's mapping) and hashes it."""
        digest, size, buffer = hashlib.sha256(), len(self.bytes), bytearray(CHUNK)
        advise = hasattr(os, "posix_fadvise")
        try:
            if advise:
                os.posix_fadvise(self.fd, 0, min(size, AHEAD), os.POSIX_FADV_WILLNEED)
            for start in range(0, size, CHUNK):
                if advise and start + AHEAD < size:
                    os.posix_fadvise(self.fd, start + AHEAD, CHUNK, os.POSIX_FADV_WILLNEED)
                count = os.preadv(self.fd, [buffer], start)
                if count <= 0:
                    return  # cut short under the mapping: its digest stays None, and `hash` says so
                digest.update(memoryview(buffer)[:count])  # hashlib lets go of the GIL over large buffers
                self.hashed_to = start + count
        except OSError:
            return
        self.digest = digest.hexdigest()

    def hash(self) -> str | None:
        """The file's sha256 as read through (None where it could not be), once the hash is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.digest

    def forget(self, view: np.ndarray) -> None:
        """The pages under `view` (bytes of this file that are laid out and not read again) leave this process's
        memory and, with drop, once hashed, the page cache."""
        start = view.ctypes.data - self.bytes.ctypes.data
        if self.memory is None or not 0 <= start < len(self.bytes) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        first = start // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(start + view.nbytes, len(self.bytes))
        self.memory.madvise(mmap.MADV_DONTNEED, first, end - first)
        if self.drop and end <= self.hashed_to and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, first, end - first, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Waits for the hash, then lets go of the file (arrays over its bytes must be gone or never used again)."""
        self.hash()
        os.close(self.fd)
        self.fd = -1
