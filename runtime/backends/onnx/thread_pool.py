"""One ONNX Runtime intra-op thread pool per process, shared by every session the process loads.

A model is a session per graph (embedding, each decoder layer, head). With a pool per session, a
process holds dozens of pools whose threads spin between runs and take the cores from each other:
on `small` (cpu lowering, 2 cores) two threads per session made decode three times slower than one.
One global pool (ONNX Runtime's `set_global_thread_pool_sizes` with `use_per_session_threads`
off) gives the process exactly `threads` intra-op threads, whatever the number of graphs.

The pool is made once, before the process's first session, and cannot be resized: a later request for
another size is an error, a request without a size takes the pool that is there.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

from ....core.errors import K2Error
from .memory_arena import use_shared_arena

_pool_threads: int | None = None  # the size of this process's pool once it is made
_pool_workers: set[int] = set()  # the thread ids ONNX Runtime made for it (Linux)
MAX_THREADS = 256  # a pool's threads, at most (--threads)
LOW_PRIORITY = 19  # the nice value of the pool's workers while the native decode step shares their cores


def core_cpus() -> list[list[int]]:
    """The CPUs this process may run on, grouped by physical core (hyperthread siblings together), in CPU order."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return [[cpu] for cpu in range(os.cpu_count() or 1)]
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:  # no topology (containers, other systems): every CPU a core
            key = ("cpu", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return list(cores.values())


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyperthread siblings count once)."""
    return max(1, len(core_cpus()))


def share_cpus(cores: list[list[int]], index: int, share: int) -> set[int]:
    """The CPUs of the index-th of `share` stage processes on a host whose physical cores are `cores`: contiguous,
    disjoint runs of whole cores while there are at least as many cores as processes, else one core each in turn."""
    if share <= len(cores):
        start, stop = index * len(cores) // share, (index + 1) * len(cores) // share
        return {cpu for core in cores[start:stop] for cpu in core}
    return set(cores[index % len(cores)])


def pin_to_share(index: int, share: int) -> set[int] | None:
    """Keeps every thread of this process (those made later inherit it) on its share of the host's cores -> the
    CPUs, or None where the host has one stage process or the system cannot pin. Stage processes that poll for
    their next message (Ray's compiled graphs) then do not take turns on the core a computing stage runs on."""
    if share <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = share_cpus(core_cpus(), index, share)
    for thread in _threads():
        try:
            os.sched_setaffinity(thread, cpus)
        except OSError:  # a thread that has just ended
            pass
    return cpus


def default_threads(share: int = 1) -> int:
    """The pool size when none is asked for: this host's physical cores, divided among `share` processes that run
    stages on it at once."""
    return max(1, physical_cores() // max(1, share))


def process_threads(threads: int | None = None, share: int = 1) -> int:
    """Makes this process's pool (`threads`, else `default_threads(share)`) unless it exists -> its size."""
    global _pool_threads
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise K2Error(f"--threads {threads}: give 1 to {MAX_THREADS}")
    if _pool_threads is not None:
        if threads is not None and threads != _pool_threads:
            raise K2Error(f"this process already runs its models on a pool of {_pool_threads} threads and cannot "
                          f"resize it to {threads}; ask for the same number or run the other model in its own process")
        return _pool_threads
    size = threads or default_threads(share)
    before = _threads()
    try:
        ort.set_global_thread_pool_sizes(size, 1)  # intra-op, inter-op (sequential execution: no inter-op work)
    except Fail as exc:
        raise K2Error(f"ONNX Runtime's thread pools were made before k2deploy could size them ({exc}); load "
                      f"k2deploy's models before other ONNX Runtime sessions with global pools") from None
    _pool_threads = size
    _pool_workers.update(_threads() - before)
    return size


def _threads() -> set[int]:
    try:
        return {int(thread) for thread in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def yield_to_native_decode() -> int:
    """Lowers the pool's worker threads to nice LOW_PRIORITY -> how many. ONNX Runtime's workers spin after each
    run (about 2^20 pauses, some 35 ms here, before they sleep; its Python API cannot turn that off for the global
    pool), and a decode step of the native pool that starts within that time found its own worker waiting for a
    core: on `small` at two threads the first steps after a prefill took 7 ms or up to 40 ms instead of 2.7. At nice
    19 a spinning worker gives way at once; alone on its core (a prefill, when the native pool sleeps) it runs as
    before. Under other processes' load it gets less of the cores than before, so prefill can lose some speed."""
    lowered = 0
    for thread in _pool_workers:
        try:
            os.setpriority(os.PRIO_PROCESS, thread, LOW_PRIORITY)
            lowered += 1
        except (OSError, AttributeError):  # a thread that ended; a system without per-thread priorities
            pass
    return lowered


def session_options(threads: int | None = None, share: int = 1) -> ort.SessionOptions:
    """Options for a session that runs on the process's one pool (made here on first use) and draws its memory
    from the process's one arena (runtime/backends/onnx/memory_arena.py)."""
    process_threads(threads, share)
    options = ort.SessionOptions()
    options.use_per_session_threads = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return use_shared_arena(options)
