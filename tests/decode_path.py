"""Every command a test runs on a cpu-target artifact names its decode path. `--decode auto` (the default) runs
whichever of the native step and the graphs measured faster at the artifact's first start on this host: a timing
race, whose outcome a test must not depend on. So the native step runs unless a test asks for a path itself (the
tests of `auto`, and of the graphs on a cpu artifact, name theirs)."""

import json
from pathlib import Path

RUNS_AN_ARTIFACT = ("generate", "score", "bench", "serve")


def _cpu_target(path: str) -> bool:
    manifest = Path(path) / "manifest.json"
    try:
        return manifest.is_file() and json.loads(manifest.read_text()).get("target") == "cpu"
    except (OSError, ValueError):
        return False  # a test of a broken artifact: the command says what is wrong with it


def named_decode(args: list[str]) -> list[str]:
    """`k2deploy` arguments -> the same, with `--decode native` where the command runs a cpu-target artifact and
    names no decode path."""
    if not args or args[0] not in RUNS_AN_ARTIFACT or "--decode" in args:
        return args
    return [*args, "--decode", "native"] if any(_cpu_target(arg) for arg in args[1:2]) else args
