"""Decode when a process asks for more threads than it gets cores: more threads than the host has, two processes
side by side, a busy process beside it. The native step's pool spins only while each thread has a core to itself
(runtime/backends/native/decode_step.c); this measures what a step costs when they do not.

    . .venv/bin/activate && python benchmarks/oversubscribed.py [ART] [--rounds 3] [--prompt-len 128]
        [--new-tokens 64] [--json]

(from the repository root; without ART, the `small` artifact that benchmarks/decode_latency.py writes under
/tmp/k2deploy-bench, made first if missing). Each case runs `generate`-like processes (benchmarks/thread_pools.py's
child: a prompt, then greedy tokens back to back, decode through the native step) in interleaved rounds:

    alone                  one process with --threads 1, the host's cores, and the host's cores x 2
    two side by side       two processes started together, with one thread each (the floor: nothing shared but
                           the memory system) and with the host's cores each (their pools share the cores by
                           leases, runtime/backends/native/core_leases.py)
    beside a busy process  one process with the host's cores, a process spinning on one core beside it

The table gives the median over rounds of each process's time per output token, its ratio to the best "alone" row,
and, for two side by side, to the floor: a pool that starves (threads spinning for a core another thread needs)
shows as a ratio of 10-100, one that degrades gracefully as about the share of the cores it lost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from thread_pools import _CHILD, ensure_artifact

SPIN = "import time\nend = time.time() + 600\nwhile time.time() < end: pass\n"


def _child(artifact: Path, threads: int, prompt_len: int, new_tokens: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(artifact), "one pool", str(threads), str(prompt_len),
                             str(new_tokens), "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _tpot(process: subprocess.Popen) -> float:
    out, err = process.communicate()
    if process.returncode != 0:
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"oversubscribed.py: a generate process failed: {tail}")
    return json.loads(out.strip().splitlines()[-1])["tpot_ms"]


def run_case(case: str, threads: int, artifact: Path, prompt_len: int, new_tokens: int) -> list[float]:
    """One round of a case -> each measured process's time per output token."""
    if case == "alone":
        return [_tpot(_child(artifact, threads, prompt_len, new_tokens))]
    if case == "two side by side":
        pair = [_child(artifact, threads, prompt_len, new_tokens) for _ in range(2)]
        return [_tpot(p) for p in pair]
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        return [_tpot(_child(artifact, threads, prompt_len, new_tokens))]
    finally:
        spinner.kill()
        spinner.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", type=Path, help="a cpu-lowered artifact (default: decode_latency's small)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the cases (default 3)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--new-tokens", type=int, default=64, help="generated tokens (default 64)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.prompt_len < 1 or args.new_tokens < 2:
        parser.error("--rounds and --prompt-len: at least 1; --new-tokens: at least 2")
    artifact = ensure_artifact(args.artifact)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cases = [("alone", t) for t in sorted({1, cores, 2 * cores})]
    cases += [("two side by side", 1), ("two side by side", cores), ("beside a busy process", cores)]
    runs: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    for round_ in range(args.rounds):
        for case, threads in cases:
            runs[case, threads] += run_case(case, threads, artifact, args.prompt_len, args.new_tokens)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    tpot = {case: statistics.median(values) for case, values in runs.items()}
    best = min(tpot[case] for case in cases if case[0] == "alone")
    floor = tpot["two side by side", 1]
    rows = [{"case": case, "threads": threads, "tpot_ms": tpot[case, threads], "x_best_alone": tpot[case, threads] / best,
             "x_floor": tpot[case, threads] / floor if case == "two side by side" else None} for case, threads in cases]
    if args.json:
        print(json.dumps({"artifact": str(artifact), "cores": cores, "rounds": args.rounds, "rows": rows}, indent=2))
        return 0
    print(f"{artifact.name}: decode through the native step on {cores} core(s), prompt {args.prompt_len}, "
          f"{args.new_tokens} tokens, median of {args.rounds} rounds")
    print(f"{'case':<24} {'threads':>7} {'TPOT ms':>8} {'x best alone':>13} {'x floor':>8}")
    for row in rows:
        floor_ratio = "" if row["x_floor"] is None else f"{row['x_floor']:.2f}x"
        print(f"{row['case']:<24} {row['threads']:>7} {row['tpot_ms']:>8.2f} {row['x_best_alone']:>12.2f}x "
              f"{floor_ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
