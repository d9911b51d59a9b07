"""The host's cores shared by this project's processes: one lock file a core, its lease.

A native decode pool takes, at each step, the leases of its cores that no other process holds, and runs the step
on those alone (runtime/backends/native/decode_step.c). Two processes that each ask for every core (two stage
processes, two `generate`s, a server beside a benchmark) then settle on disjoint cores instead of spinning against
each other. A lease is an advisory `flock` on its file, so the kernel gives it back when its process ends, however it
ends.

The files live in a folder of the user's own, made private (`/dev/shm/k2deploy-cores-UID`, else the temporary
folder's), or in the folder K2DEPLOY_CORE_LEASES names; K2DEPLOY_CORE_LEASES=off, or a folder that is not the user's
alone (another owner, writable by others, a link), gives no leases: each process then takes every core it asks for.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ....core.errors import K2Error

LEASES_VARIABLE = "K2DEPLOY_CORE_LEASES"
_opened: dict[Path, int] = {}  # each lease file's descriptor, open for the process's life (the pool holds its number)


def lease_folder() -> Path | None:
    """The folder of the host's lease files (made where missing), or None: no leases."""
    named = os.environ.get(LEASES_VARIABLE, "").strip()
    if named.lower() == "off" or not hasattr(os, "getuid"):
        return None
    if named:
        if not os.path.isabs(named):  # never a folder made wherever the process happens to run
            raise K2Error(f"{LEASES_VARIABLE}={named!r}: give an absolute folder for the host's core leases, or off")
        folder = Path(named)
    else:
        shared = Path("/dev/shm")
        folder = (shared if shared.is_dir() else Path(tempfile.gettempdir())) / f"k2deploy-cores-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError:
        return None
    private = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022
    return folder if private else None


def core_leases(cpus: list[int]) -> list[int]:
    """An open lease file for each CPU (the first CPU of its core) -> descriptors, -1 for a CPU of -1 and
    everywhere where there are no leases."""
    folder = lease_folder()
    leases = []
    for cpu in cpus:
        path = None if folder is None or cpu < 0 else folder / f"cpu{cpu}"
        if path is not None and path not in _opened:
            try:
                _opened[path] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError:  # a file that is not ours to lock: this core is not shared by leases
                path = None
        leases.append(-1 if path is None else _opened[path])
    return leases
