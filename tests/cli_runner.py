"""Runs the command line as a user does: a separate process, its exit code and its output."""

import subprocess
import sys

from decode_path import named_decode


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k2deploy", *named_decode(list(map(str, args)))], capture_output=True,
                          text=True, env=env, timeout=600)
