"""What tells one checkpoint's bytes from another's without reading them all: each file's size, its inode and
modification time, and a BLAKE3 digest of SAMPLES blocks spread over it (the last included). An export's journal
keeps it (a resume keeps only graphs made from the same files: two checkpoints of one shape written to one folder
differ in every sampled block of their tensors) and the manifest records it."""

from __future__ import annotations

import os
from pathlib import Path

import blake3

SAMPLES = 16  # blocks read from each file
SAMPLE_BYTES = 4096


def file_identity(path: Path) -> dict:
    """{bytes, inode, mtime_ns, sampled_blake3} of one file."""
    info = path.stat()
    digest = blake3.blake3()
    with open(path, "rb") as handle:
        for i in range(SAMPLES):
            at = max(0, (info.st_size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            handle.seek(at)
            digest.update(handle.read(SAMPLE_BYTES))
    return {"bytes": info.st_size, "inode": info.st_ino, "mtime_ns": info.st_mtime_ns,
            "sampled_blake3": digest.hexdigest()}


def checkpoint_identity(checkpoint: Path, files: list[str]) -> dict:
    """{name: file_identity} of the checkpoint's `files` (its config and weight shards), in name order."""
    return {name: file_identity(checkpoint / name) for name in sorted(files) if (checkpoint / name).is_file()}


def changed(before: dict, now: dict) -> str | None:
    """None where two identities name the same files, else the first file that differs and how."""
    for name in sorted(set(before) | set(now)):
        old, new = before.get(name), now.get(name)
        if old is None or new is None:
            return f"{name} is {'new' if old is None else 'gone'}"
        for key in ("bytes", "sampled_blake3", "mtime_ns", "inode"):
            if old.get(key) != new.get(key):
                return f"{name} changed ({key.replace('_', ' ')})"
    return None
