"""What the tree's text may not say: no absolute path of the checkout it was written in (a command copied from a
docstring must run from any clone), and no inventory in docs/architecture.md that has drifted from the files."""

from __future__ import annotations

import re
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


def test_the_architecture_page_names_every_source_file_and_no_other():
    """docs/architecture.md's inventory is written by hand: each module of the package is named there (by its file
    name or path), and each file it names exists, so that the page cannot drift from the code unseen."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([A-Za-z0-9_/.]+\.(?:py|c|h))`", page))
    names = {name.rsplit("/", 1)[-1] for name in named}
    sources = [path for folder in ("core", "export", "runtime", "commands", "bench", "plugins")
               for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".c", ".h") and path.name != "__init__.py"]
    unnamed = sorted(path.relative_to(ROOT).as_posix() for path in sources if path.name not in names)
    assert not unnamed, f"source files docs/architecture.md does not name: {unnamed}"
    everything = {path.name for path in ROOT.rglob("*") if ".venv" not in path.parts and ".git" not in path.parts}
    gone = sorted(name for name in named if name.rsplit("/", 1)[-1] not in everything)
    assert not gone, f"files docs/architecture.md names that the tree does not hold: {gone}"
