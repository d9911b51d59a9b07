"""Every command a test runs on an artifact the native step can run names its decode path. `--decode auto` (the
default) runs whichever of the native step and the graphs measured faster at the artifact's first start on this
host: a timing race, whose outcome a test must not depend on. So the native step runs unless the test asks for a
path itself (the tests of `auto`, and of the graphs on a cpu artifact, name theirs) or for another provider or
backend (whose refusal of a cpu artifact the test checks)."""

from pathlib import Path

from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native.build import NativeUnavailable
from k2deploy.runtime.backends.native.decoder import NativeDecoder

RUNS_AN_ARTIFACT = ("generate", "score", "bench", "serve")
ELSEWHERE = {"--provider": "cpu", "--backend": "onnxruntime"}  # a flag that takes the model off the native step


def _native_runs(path: str) -> bool:
    try:
        manifest = load_manifest(Path(path))
        NativeDecoder.check_target(manifest)
    except (K2Error, NativeUnavailable, OSError, ValueError, RecursionError):
        return False  # not an artifact it runs, or a hostile or broken one: the command says what is wrong with it
    return bool(manifest.data.get("complete"))  # a whole model's (a part goes to the graphs, or is refused)


def named_decode(args: list[str]) -> list[str]:
    """`k2deploy` arguments -> the same, with `--decode native` where the command runs an artifact the native step
    runs (on the cpu provider, through ONNX Runtime's backend) and names no decode path."""
    if not args or args[0] not in RUNS_AN_ARTIFACT or "--decode" in args or len(args) < 2:
        return args
    if any(flag in args[:-1] and args[args.index(flag) + 1] != plain for flag, plain in ELSEWHERE.items()):
        return args
    return [*args, "--decode", "native"] if _native_runs(args[1]) else args
