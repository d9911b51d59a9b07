"""Builds the native decode step (runtime/native/decode_step.c) for this host, once, and loads it.

The library is compiled with the system's C compiler (`cc -O3 -march=native`: the step's products use the
host's int8 dot-product instructions where it has them) into a cache folder, named by a hash of the source, the
compiler's version and the host's CPU flags, so that a new source, compiler or CPU gets its own build. The build
writes to a temporary name and renames it into place: an interrupted build leaves nothing a later load would
take. No compiler, or a failed build, is a `NativeUnavailable` with the reason; the runtime then decodes through
the ONNX graphs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("native") / "decode_step.c"
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-pthread", "-std=gnu11"]
_loaded: ctypes.CDLL | None = None


class NativeUnavailable(Exception):
    """The native decode step cannot run here; the message says why."""


def cache_dir() -> Path:
    """$K2DEPLOY_NATIVE_CACHE, else $XDG_CACHE_HOME/k2deploy/native, else ~/.cache/k2deploy/native."""
    if os.environ.get("K2DEPLOY_NATIVE_CACHE"):
        return Path(os.environ["K2DEPLOY_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k2deploy" / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler (cc) on PATH; install one (Debian: apt install gcc) or set CC")
    return compiler


def build() -> Path:
    """The library for this host, compiled first if its cache holds none -> its path."""
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{compiler} does not run ({exc})") from None
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, " ".join(FLAGS), _cpu_flags()]).encode()).hexdigest()
    target = cache_dir() / f"decode_step-{key[:16]}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                reason = (done.stderr.strip().splitlines() or ["no message"])[0][:300]
                raise NativeUnavailable(f"{compiler} could not build {SOURCE.name}: {reason}")
            os.replace(built, target)
    except OSError as exc:
        raise NativeUnavailable(f"cannot write the native build under {target.parent} ({exc}); set "
                                f"K2DEPLOY_NATIVE_CACHE to a writable folder") from None
    except subprocess.SubprocessError as exc:
        raise NativeUnavailable(f"{compiler} did not finish building {SOURCE.name} ({exc})") from None
    return target


def library() -> ctypes.CDLL:
    """The loaded library (built first where needed); one per process."""
    global _loaded
    if _loaded is None:
        try:
            lib = ctypes.CDLL(str(build()))
        except OSError as exc:
            raise NativeUnavailable(f"the native build does not load ({exc})") from None
        pointer, number = ctypes.c_void_p, ctypes.c_int
        lib.k2_pool_start.argtypes = [number, pointer]
        lib.k2_pool_start.restype = number
        lib.k2_scratch_floats.argtypes = [pointer, number, number]
        lib.k2_scratch_floats.restype = ctypes.c_long
        lib.k2_decode_step.argtypes = [pointer, number, pointer, pointer, pointer, number, pointer, pointer, pointer]
        lib.k2_decode_step.restype = number
        lib.k2_decode_layers.argtypes = [pointer, number, number, number, pointer, pointer, number, pointer, pointer,
                                         pointer]
        lib.k2_decode_layers.restype = number
        lib.k2_logits.argtypes = [pointer, number, pointer, pointer, pointer]
        lib.k2_logits.restype = None
        lib.k2_tile.argtypes = []
        lib.k2_tile.restype = number
        _loaded = lib
    return _loaded
