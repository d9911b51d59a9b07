"""The exporter's data file is written and hashed on a thread of its own: the bytes land in order, the hash is
theirs, and a failed write (a full disk) is raised on the caller's side."""

import io

import blake3
import pytest

from k2deploy.core import file_hashes
from k2deploy.export.background_writer import BackgroundWriter


def test_bytes_land_in_order_and_the_hashes_are_theirs(monkeypatch):
    monkeypatch.setattr(file_hashes, "CHUNK_BYTES", 4096)  # pieces straddle the chunks' ends
    pieces = [bytes([i]) * (1000 + i) for i in range(50)]
    out = io.BytesIO()
    with BackgroundWriter(out) as sink:
        for piece in pieces:
            sink.write(memoryview(piece))
        record = sink.finish()
    whole = b"".join(pieces)
    assert out.getvalue() == whole
    assert record == {"chunk_bytes": 4096, "chunk_blake3": [blake3.blake3(whole[at:at + 4096]).hexdigest()
                                                            for at in range(0, len(whole), 4096)]}
    read = lambda offset, length: whole[offset:offset + length]  # noqa: E731
    assert file_hashes.matches({"bytes": len(whole), **record}, read, threads=2)
    damaged = whole[:5000] + b"\xff" + whole[5001:]
    assert not file_hashes.matches({"bytes": len(whole), **record}, lambda o, n: damaged[o:o + n], threads=2)


class _FullDisk(io.RawIOBase):
    def writable(self):
        return True

    def write(self, data):
        raise OSError(28, "No space left on device")


def test_a_failed_write_is_raised_on_the_callers_side():
    with pytest.raises(OSError, match="No space left"):
        with BackgroundWriter(_FullDisk()) as sink:
            for _ in range(10):
                sink.write(b"x" * 10)
            sink.finish()
