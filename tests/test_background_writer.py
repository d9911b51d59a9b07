"""The exporter's data file is written and hashed on a thread of its own: the bytes land in order, the hash is
theirs, and a failed write (a full disk) is raised on the caller's side."""

import hashlib
import io

import pytest

from k2deploy.export.background_writer import BackgroundWriter


def test_bytes_land_in_order_and_the_hash_is_theirs():
    pieces = [bytes([i]) * (1000 + i) for i in range(50)]
    out = io.BytesIO()
    with BackgroundWriter(out) as sink:
        for piece in pieces:
            sink.write(memoryview(piece))
        digest = sink.finish()
    assert out.getvalue() == b"".join(pieces)
    assert digest == hashlib.sha256(b"".join(pieces)).hexdigest()


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
