"""Running one CLI command: a K2Error becomes one line on stderr and exit code 2, Ctrl-C exit code 130.

So do the two failures of the machine around it: a full disk (ENOSPC) and an output closed early (a pipe
into `head`); neither leaves a traceback.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Callable

from ..core.errors import K2Error


def run_command(name: str, action: Callable[[], None]) -> int:
    try:
        action()
        sys.stdout.flush()
    except K2Error as exc:
        print(f"k2deploy {name}: error: {exc}", file=sys.stderr)
        return 2
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
