"""Running one CLI command: a K2Error becomes one line on stderr and exit code 2, Ctrl-C exit code 130, and
SIGTERM, where the command stops on it as on Ctrl-C (`sigterm_as_interrupt`), exit code 143.

So do the two failures of the machine around it: a full disk (ENOSPC) and an output closed early (a pipe
into `head`); neither leaves a traceback.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from ..core.errors import K2Error


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program was, so that what cleans up after Ctrl-C cleans up after it too."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises Terminated, where it would otherwise end the process on the spot and leave
    what it was writing half-written."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_command(name: str, action: Callable[[], None]) -> int:
    try:
        action()
        sys.stdout.flush()
    except K2Error as exc:
        print(f"k2deploy {name}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"k2deploy {name}: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"k2deploy {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        print(f"k2deploy {name}: error: the output was closed before the command finished (broken pipe)",
              file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        print(f"k2deploy {name}: error: no space left on the device{f' writing {exc.filename}' if exc.filename else ''}; "
              f"free some space and run it again (an export resumes where it stopped)", file=sys.stderr)
        return 2
    return 0
