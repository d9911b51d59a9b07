"""A file written and hashed on a thread of its own, in the order the bytes come, while the caller makes the next.

The exporter's pieces come from numpy (re-quantisation) and the sink's work is a file write and a BLAKE3 update:
all three let go of the interpreter lock, so the two overlap on two cores. At most `depth` pieces wait; an error on
either side stops both and is raised on the caller's.
"""

from __future__ import annotations

import queue
import threading
from typing import BinaryIO

from ..core.file_hashes import ChunkDigests

_DONE = object()


class BackgroundWriter:
    """write(data) queues bytes for `file`; finish() -> their digests (core/file_hashes.py ChunkDigests.record) once
    all are written. Use as a context: leaving it
    by an exception stops the thread without writing what is still queued."""

    def __init__(self, file: BinaryIO, depth: int = 2):
        self.file, self.digest = file, ChunkDigests()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="k2-export-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (data := self._queue.get()) is not _DONE:
            if self._stop.is_set() or self._error is not None:
                continue
            try:
                self.file.write(data)
                self.digest.update(data)
            except BaseException as exc:  # raised again on the caller's thread
                self._error = exc

    def write(self, data) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def finish(self) -> dict:
        self._queue.put(_DONE)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.digest.record()

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None and self._thread.is_alive():
            self._stop.set()
            self._queue.put(_DONE)
            self._thread.join()
