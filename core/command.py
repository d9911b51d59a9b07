"""Running one CLI command: a K2Error becomes one line on stderr and exit code 2, Ctrl-C exit code 130."""

from __future__ import annotations

import sys
from typing import Callable

from .errors import K2Error


def run_command(name: str, action: Callable[[], None]) -> int:
    try:
        action()
    except K2Error as exc:
        print(f"k2deploy {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"k2deploy {name}: interrupted", file=sys.stderr)
        return 130
    return 0
