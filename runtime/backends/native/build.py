"""Builds the native decode step (runtime/backends/native/decode_step.c) for this host, once per instruction-set level, and
loads it.

The step's products are written once over runtime/backends/native/isa.h, which each instruction set lowers to its own
int8 dot-product instructions; the level is the compiler's -march. `level()` picks it: $K2DEPLOY_NATIVE_ISA (one
of `levels()`), else `native` (`-march=native`: everything this host has). Each level the host can execute
(`host_levels()`) can be built and loaded (tests and `benchmarks/native_step.py --isa all` check each). The
library is compiled with the system's C compiler into a cache folder, named by a hash of the sources, the
compiler's version, the flags and the host's CPU flags, so that a new source, compiler or CPU gets its own build.
The build writes to a temporary name and renames it into place: an interrupted build leaves nothing a later load
would take. No compiler, or a failed build, is a `NativeUnavailable` with the reason; the runtime then decodes
through the ONNX graphs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("decode_step.c")
# the files SOURCE includes: its parts (model.h, pool.c, products.c, ...) and isa.h
PARTS = sorted(path for path in SOURCE.parent.iterdir() if path.suffix in (".c", ".h") and path != SOURCE)
# -ffp-contract=off: every float step rounds as written, so a product's result is the same whichever of its forms
# (one input, or several at once) computes it
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-std=gnu11"]
ISA_VARIABLE = "K2DEPLOY_NATIVE_ISA"

# level -> (its -march flags, the /proc/cpuinfo flags a CPU needs to run it); "native" is whatever this host has
X86_LEVELS = {
    "plain": (["-march=x86-64"], []),
    "ssse3": (["-march=x86-64-v2"], ["ssse3", "sse4_1", "sse4_2", "popcnt"]),
    "avx2": (["-march=x86-64-v3"], ["ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "bmi1", "bmi2",
                                    "f16c", "movbe"]),
    "avx-vnni": (["-march=x86-64-v3", "-mavxvnni"], ["avx2", "fma", "bmi2", "f16c", "movbe", "avx_vnni"]),
    "avx512bw": (["-march=x86-64-v4"], ["avx2", "fma", "bmi2", "f16c", "movbe", "avx512f", "avx512bw", "avx512cd",
                                        "avx512dq", "avx512vl"]),
    "avx512-vnni": (["-march=x86-64-v4", "-mavx512vnni"], ["avx2", "fma", "bmi2", "f16c", "movbe", "avx512f",
                                                            "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                                                            "avx512_vnni"]),
}
ARM_LEVELS = {
    "plain": (["-march=armv8-a+nosimd"], []),
    "neon": (["-march=armv8-a"], ["asimd"]),
    "neon-dotprod": (["-march=armv8.2-a+dotprod"], ["asimd", "asimddp"]),
}
_loaded: dict[str, ctypes.CDLL] = {}
# what decode_step.c's k2_contract(i) gives, in order: its constants and the sizes of the structs it takes
CONTRACT = ("page", "tile", "max_top_k", "max_groups", "max_experts", "max_threads", "code_zero", "sizeof_lin",
            "sizeof_dims", "sizeof_layer", "sizeof_model", "sizeof_pages")


def contract(lib: ctypes.CDLL) -> dict[str, int]:
    """The library's constants and struct sizes by name (CONTRACT)."""
    return {name: int(lib.k2_contract(i)) for i, name in enumerate(CONTRACT)}


def fields(lib: ctypes.CDLL) -> dict[str, int]:
    """The offsets of the fields of the structs the library takes, by "Struct.field" (k2_field)."""
    out, name = {}, ctypes.c_char_p()
    while (at := lib.k2_field(len(out), ctypes.byref(name))) >= 0:
        out[name.value.decode()] = int(at)
    return out


class NativeUnavailable(Exception):
    """The native decode step cannot run here; the message says why."""


def cache_dir() -> Path:
    """$K2DEPLOY_NATIVE_CACHE, else $XDG_CACHE_HOME/k2deploy/native, else ~/.cache/k2deploy/native."""
    if os.environ.get("K2DEPLOY_NATIVE_CACHE"):
        return Path(os.environ["K2DEPLOY_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "k2deploy" / "native"


def _cpu_flags() -> str:
    """The first CPU's flags line of /proc/cpuinfo ("flags" on x86, "Features" on ARM), else the machine's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


def levels() -> dict[str, tuple[list[str], list[str]]]:
    """This machine family's instruction-set levels, narrowest first: name -> (-march flags, CPU flags needed)."""
    machine = os.uname().machine
    if machine in ("x86_64", "amd64", "i686"):
        return X86_LEVELS
    if machine in ("aarch64", "arm64"):
        return ARM_LEVELS
    return {"plain": ([], [])}


def host_levels() -> list[str]:
    """The levels this host's CPU can execute, narrowest first."""
    have = set(_cpu_flags().partition(":")[2].split())
    return [name for name, (_, needs) in levels().items() if set(needs) <= have]


def level() -> str:
    """The level to load: $K2DEPLOY_NATIVE_ISA, else "native"; NativeUnavailable for one this host cannot run."""
    chosen = os.environ.get(ISA_VARIABLE, "").strip() or "native"
    if chosen == "native":
        return chosen
    if chosen not in levels():
        raise NativeUnavailable(f"{ISA_VARIABLE}={chosen!r} is not an instruction-set level; choose native or one of "
                                f"{', '.join(levels())}")
    if chosen not in host_levels():
        raise NativeUnavailable(f"{ISA_VARIABLE}={chosen}: this CPU cannot run it (it runs "
                                f"{', '.join(host_levels())})")
    return chosen


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable("no C compiler (cc) on PATH; install one (Debian: apt install gcc) or set CC")
    return compiler


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _seal(library_path: Path) -> Path:
    """The file beside a build that holds its sha256, written by the build that made it."""
    return library_path.with_name(library_path.name + ".sha256")


def _intact(library_path: Path) -> bool:
    """Whether a cached build is the one its build wrote: a truncated, replaced or damaged file (or one without its
    seal) is built again, never loaded (loading a truncated library can kill the process)."""
    try:
        return library_path.is_file() and _seal(library_path).read_text().strip() == _digest(library_path)
    except (OSError, UnicodeDecodeError):
        return False


def build(isa: str = "native") -> Path:
    """The library for this host at level `isa` ("native" or one of `levels()`), compiled first if its cache holds
    none -> its path."""
    compiler = _compiler()
    march = ["-march=native"] if isa == "native" else levels()[isa][0]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{compiler} does not run ({exc})") from None
    sources = [SOURCE.read_text(), *(f"{part.name}\n{part.read_text()}" for part in PARTS)]
    key = hashlib.sha256("\0".join([*sources, version, " ".join(FLAGS + march), _cpu_flags()]).encode()).hexdigest()
    target = cache_dir() / f"decode_step-{isa}-{key[:16]}.so"
    if _intact(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            done = subprocess.run([compiler, *FLAGS, *march, str(SOURCE), "-o", str(built), "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                reason = (done.stderr.strip().splitlines() or ["no message"])[0][:300]
                raise NativeUnavailable(f"{compiler} could not build {SOURCE.name}: {reason}")
            _check_built(compiler, built)  # before it is sealed into the cache
            seal = Path(scratch) / (target.name + ".sha256")
            seal.write_text(_digest(built))
            os.replace(built, target)
            os.replace(seal, _seal(target))
    except OSError as exc:
        raise NativeUnavailable(f"cannot write the native build under {target.parent} ({exc}); set "
                                f"K2DEPLOY_NATIVE_CACHE to a writable folder") from None
    except subprocess.SubprocessError as exc:
        raise NativeUnavailable(f"{compiler} did not finish building {SOURCE.name} ({exc})") from None
    return target


def _check_built(compiler: str, built: Path) -> None:
    """NativeUnavailable unless `compiler` wrote a library there that loads and holds the step (a compiler that
    exits 0 and writes nothing, or writes something else, is named, not the cache folder)."""
    if not built.is_file() or built.stat().st_size == 0:
        raise NativeUnavailable(f"{compiler} exited without writing a library for {SOURCE.name}; set CC to a C "
                                f"compiler (gcc or clang)")
    # loaded in a child: mapped here, the cached file rewritten in place later would fault this process at exit
    probe = "import ctypes, sys; ctypes.CDLL(sys.argv[1]).k2_isa"
    try:
        loads = subprocess.run([sys.executable, "-c", probe, str(built)], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        loads = False
    if not loads:
        raise NativeUnavailable(f"{compiler} wrote a file for {SOURCE.name} that is not its library (it does not "
                                f"load); set CC to a C compiler (gcc or clang)")


def library(isa: str | None = None) -> ctypes.CDLL:
    """The loaded library at level `isa` (default: `level()`), built first where needed; one per level a process."""
    isa = isa or level()
    if isa not in _loaded:
        try:
            lib = ctypes.CDLL(str(build(isa)))
        except OSError as exc:
            raise NativeUnavailable(f"the native build does not load ({exc})") from None
        pointer, number = ctypes.c_void_p, ctypes.c_int
        signatures = {"k2_pool_start": ([number, pointer, pointer], number),
                      "k2_pool_leases": ([pointer], number), "k2_scratch_floats": ([pointer, number, number], ctypes.c_long),
                      "k2_decode_step": ([pointer, number, pointer, pointer, pointer, number, pointer, pointer, pointer], number),
                      "k2_decode_layers": ([pointer, number, number, number, pointer, pointer, number, pointer, pointer,
                                            pointer], number),
                      "k2_logits": ([pointer, number, pointer, pointer, pointer], None),
                      "k2_contract": ([number], ctypes.c_long), "k2_field": ([number, pointer], ctypes.c_long),
                      "k2_isa": ([], ctypes.c_char_p)}
        for name, (arguments, result) in signatures.items():
            try:
                function = getattr(lib, name)
            except AttributeError:
                raise NativeUnavailable(f"the native build {lib._name} lacks {name}: it is not this project's build; "
                                        f"delete it") from None
            function.argtypes, function.restype = arguments, result
        _loaded[isa] = lib
    return _loaded[isa]
