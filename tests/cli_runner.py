"""Runs the command line as a user does: a separate process, its exit code and its output."""

import subprocess
import sys


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k2deploy", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)
