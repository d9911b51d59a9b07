"""The machine's memory bandwidth, measured in the same run as the benchmark it bounds.

Method: numpy copies one array of `nbytes` into another (both touched first, so no page
faults are timed), `repeats` times; each copy moves 2 x nbytes (read + write, STREAM's "copy"
convention), so GB/s = 2 * nbytes / seconds / 1e9. The arrays (256 MiB each by default) are far
larger than any last-level cache.

It runs in a child process (`python -m k2deploy.bench.bandwidth`): its half a gigabyte of
arrays then never enters the benchmark's own peak RSS, and the child exits before the timed
runs start.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from ..core.errors import K2Error

DEFAULT_BYTES = 256 << 20
DEFAULT_REPEATS = 7
METHOD = ("numpy copy of one array into another (read + write counted: 2 x bytes per copy), "
          "arrays touched first, child process")


def measure(nbytes: int = DEFAULT_BYTES, repeats: int = DEFAULT_REPEATS) -> list[float]:
    """GB/s of each of `repeats` timed copies (after one untimed copy)."""
    count = max(nbytes // 8, 1)
    src = np.ones(count, dtype=np.float64)
    dst = np.zeros(count, dtype=np.float64)
    np.copyto(dst, src)  # warm: both arrays resident
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        samples.append(2 * src.nbytes / (time.perf_counter() - started) / 1e9)
    return samples


def measure_in_child(nbytes: int = DEFAULT_BYTES, repeats: int = DEFAULT_REPEATS, timeout: float = 300) -> list[float]:
    """measure() in a fresh Python process; its samples."""
    command = [sys.executable, "-m", "k2deploy.bench.bandwidth", "--bytes", str(nbytes), "--repeats", str(repeats)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise K2Error(f"the memory bandwidth measurement did not finish in {timeout:.0f} s") from None
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise K2Error(f"the memory bandwidth measurement failed: {tail}")
    return json.loads(done.stdout)["gb_per_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k2deploy.bench.bandwidth",
                                     description="Measure memory copy bandwidth (GB/s) and print it as JSON.")
    parser.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help="bytes per array (default: 256 MiB)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed copies (default: 7)")
    args = parser.parse_args(argv)
    print(json.dumps({"bytes": args.bytes, "gb_per_s": measure(args.bytes, args.repeats)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
