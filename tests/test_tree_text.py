"""What the tree's text may not say: no absolute path of the checkout it was written in (a command copied from a
docstring must run from any clone)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: no tracked files to read")
    return [ROOT / name for name in listed.stdout.decode().split("\0") if name]


def test_no_tracked_file_names_this_checkouts_own_path():
    own = str(ROOT)
    found = []
    for path in _tracked():
        try:
            if own.encode() in path.read_bytes():
                found.append(path.relative_to(ROOT).as_posix())
        except (IsADirectoryError, FileNotFoundError):  # a submodule, or a file deleted but not yet staged
            continue
    assert not found, f"files that name {own}: {found}"
