"""The paths a user names for a command to write: checked before the work starts, a file written atomically, and
every problem with them a K2Error of one line naming the path, what is wrong and what to do."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from ..core.errors import K2Error

ADVICE = {errno.ENAMETOOLONG: "choose a shorter name", errno.EACCES: "choose a folder you can write to",
          errno.EPERM: "choose a folder you can write to", errno.EROFS: "choose a folder you can write to",
          errno.ENOSPC: "free some space or choose another place"}


def check_output_file(path: str | Path, option: str | None = None) -> None:
    """A K2Error unless a file can be written at `path`: its folder exists and takes new files, its name fits, and
    what is already there, if anything, is a file."""
    target, label = _target(path), _label(path, option)
    if os.path.isdir(target):
        raise K2Error(f"{label} is a folder; give the name of a file to write inside it")
    if os.path.exists(target) and not stat.S_ISREG(os.stat(target).st_mode):
        raise K2Error(f"{label} is not a regular file (a device, pipe or socket); give a file to write")
    folder = target.parent
    try:
        is_folder = stat.S_ISDIR(os.stat(folder).st_mode)
    except FileNotFoundError:
        raise K2Error(f"{label}: folder {folder} does not exist; create it first") from None
    except OSError as exc:
        raise _refusal(label, f"reach {folder}", exc) from None
    if not is_folder:
        raise K2Error(f"{label}: {folder} is not a folder; choose another path")
    _check_writable(label, folder, target)


def check_output_folder(path: str | Path, option: str | None = None) -> None:
    """A K2Error unless a folder can be made (or kept) at `path` and written into: the part of it that exists is a
    folder that takes new files, and the names it adds fit."""
    if not str(path).strip():  # Path("") is the working folder: never taken for a folder the user did not name
        raise K2Error(f"{option or 'the output folder'} is empty; give a folder to write into")
    path, label = Path(path), _label(path, option)
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise K2Error(f"{label}: {existing} is not a folder; choose another path")
    _check_writable(label, existing, path)


def write_output_file(path: str | Path, write: Callable[[BinaryIO], None], option: str | None = None) -> None:
    """write(file) into a temporary file beside `path`, then renamed to it: `path` ends whole or untouched."""
    target = _target(path)
    try:
        descriptor, partial = tempfile.mkstemp(dir=target.parent, prefix=".k2deploy-", suffix=".partial")
        try:
            with os.fdopen(descriptor, "wb") as out:
                write(out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise _refusal(_label(path, option), "write it", exc) from None


@contextmanager
def output_errors(path: str | Path, option: str | None = None) -> Iterator[None]:
    """Writing under `path`: an OSError becomes a K2Error naming the path, the error and what to do."""
    try:
        yield
    except OSError as exc:
        raise _refusal(_label(path, option), f"write {exc.filename or 'there'}", exc) from None


def _refusal(label: str, what: str, exc: OSError) -> K2Error:
    return K2Error(f"{label}: cannot {what} ({exc.strerror or exc}); {ADVICE.get(exc.errno, 'choose another path')}")


def _label(path: str | Path, option: str | None) -> str:
    return f"{option} {path}" if option else str(path)


def _target(path: str | Path) -> Path:
    """Where a file named `path` is written: through symbolic links, not over them."""
    return Path(os.path.realpath(path))


def _nearest_existing(path: Path) -> Path:
    """`path` itself, or the closest of its parents that exists."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _check_writable(label: str, folder: Path, path: Path) -> None:
    """A K2Error unless the names `path` adds below `folder` (a folder that exists) fit and files can be made there."""
    most = os.pathconf(folder, "PC_NAME_MAX")
    for name in Path(os.path.relpath(path, folder)).parts if path != folder else ():
        if len(os.fsencode(name)) > most:
            raise K2Error(f"{label}: a name in it is {len(os.fsencode(name))} bytes long, the file system allows "
                          f"{most}; choose a shorter name")
    if len(os.fsencode(str(path))) >= os.pathconf(folder, "PC_PATH_MAX"):
        raise K2Error(f"{label}: the path is longer than the file system allows; choose a shorter one")
    try:
        descriptor, probe = tempfile.mkstemp(dir=folder, prefix=".k2deploy-", suffix=".probe")
    except OSError as exc:
        raise _refusal(label, f"create files in {folder}", exc) from None
    os.close(descriptor)
    os.unlink(probe)
