"""An artifact's data files are checked against the manifest's digests, all of every file's bytes, whichever record
an export wrote: BLAKE3 chunks (format version 5) or an older artifact's sha256 ones."""

import hashlib

import pytest

from k2deploy.core import file_hashes

CHUNK = file_hashes.SMALLEST_CHUNK  # small chunks: many a file, more than the reads in flight


def _written(path, data: bytes, kind: str) -> tuple:
    path.write_bytes(data)
    if kind == "blake3":
        digests = file_hashes.ChunkDigests()
        digests.update(data)
        record = digests.record()
    elif kind == "sha256 chunks":
        record = {"chunk_bytes": CHUNK, "chunk_sha256": [hashlib.sha256(data[at:at + CHUNK]).hexdigest()
                                                       for at in range(0, len(data), CHUNK)]}
    else:
        record = {"sha256": hashlib.sha256(data).hexdigest()}
    return path, {"bytes": len(data), **record}


@pytest.mark.parametrize("kind", ["blake3", "sha256 chunks", "sha256 whole"])
def test_each_file_is_judged_on_its_own_bytes(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(file_hashes, "CHUNK_BYTES", CHUNK)
    sizes = [CHUNK * 20 + 123, 7, CHUNK * 3, 0]  # a chunked file, one shorter than a chunk, whole chunks, empty
    files = [_written(tmp_path / f"f{i}.data", bytes((i * 31 + j) % 251 for j in range(size)), kind)
             for i, size in enumerate(sizes)]
    assert file_hashes.files_matching(files, threads=2) == [True] * 4
    last = files[0][0].read_bytes()
    files[0][0].write_bytes(last[:-1] + bytes([last[-1] ^ 1]))  # the last byte of the last, short chunk
    files[2][0].write_bytes(files[2][0].read_bytes()[:-5])  # cut short
    assert file_hashes.files_matching(files, threads=2) == [False, True, False, True]
    files[1][0].unlink()
    assert file_hashes.files_matching(files, threads=1) == [False, False, False, True]
