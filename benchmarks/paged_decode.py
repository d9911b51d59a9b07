"""Decode over the paged cache against an earlier checkout's, side by side: time per output token at several
contexts, `k2deploy generate` of this checkout and of a baseline checkout run in turn, each in its own process.

    . .venv/bin/activate && python benchmarks/paged_decode.py ART --baseline REPO ART_BASE
        [--contexts 128,2048,8192] [--new-tokens 32] [--rounds 3] [--threads 1] [--json]

(from the repository root). REPO is another checkout of k2deploy (e.g. `git worktree add /tmp/base COMMIT`) and
ART_BASE the same checkpoint exported by it (artifacts of different cache layouts are not interchangeable); the
baseline runs with REPO as its `k2deploy` package (PYTHONPATH). Each round runs every context with both, so the
machine's noise falls on both; the table gives median time per output token and the ratio ours / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def tpot(artifact: str, length: int, new_tokens: int, threads: int, package: Path | None) -> dict:
    prompt = ",".join(map(str, np.random.default_rng(length).integers(3, 30000, length)))
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = f"{package}{os.pathsep}{env.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, "-m", "k2deploy", "generate", artifact, "--prompt-ids", prompt,
                           "--max-new-tokens", str(new_tokens), "--threads", str(threads), "--json"],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"generate failed on {artifact} at {length} tokens: {done.stderr.strip()}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--baseline", nargs=2, metavar=("REPO", "ART_BASE"), required=True)
    parser.add_argument("--contexts", default="128,2048,8192")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    repo, base_artifact = args.baseline
    with tempfile.TemporaryDirectory() as folder:
        package = Path(folder)
        (package / "k2deploy").symlink_to(Path(repo).resolve())  # the baseline checkout as `k2deploy`
        contexts = [int(c) for c in args.contexts.split(",")]
        runs = {(c, who): [] for c in contexts for who in ("ours", "baseline")}
        for _ in range(args.rounds):
            for context in contexts:
                runs[context, "ours"].append(tpot(args.artifact, context, args.new_tokens, args.threads, None))
                runs[context, "baseline"].append(tpot(base_artifact, context, args.new_tokens, args.threads, package))
    rows = []
    for context in contexts:
        ours = statistics.median(r["tpot_ms"] for r in runs[context, "ours"])
        base = statistics.median(r["tpot_ms"] for r in runs[context, "baseline"])
        same = all(a["token_ids"] == b["token_ids"] for a, b in zip(runs[context, "ours"], runs[context, "baseline"]))
        rows.append({"context": context, "tpot_ms": round(ours, 3), "baseline_tpot_ms": round(base, 3),
                     "ratio": round(ours / base, 3), "same_tokens": same,
                     "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs[context, "ours"]), 1),
                     "baseline_ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs[context, "baseline"]), 1)})
    doc = {"artifact": args.artifact, "baseline": {"repo": repo, "artifact": base_artifact}, "threads": args.threads,
           "new_tokens": args.new_tokens, "rounds": args.rounds, "contexts": rows}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"time per output token, median of {args.rounds} rounds, {args.threads} thread(s), {args.new_tokens} tokens")
    print("context  ours ms  baseline ms  ours/baseline  same tokens  ttft ours ms  ttft baseline ms")
    for r in rows:
        print(f"{r['context']:>7}  {r['tpot_ms']:>7}  {r['baseline_tpot_ms']:>11}  {r['ratio']:>13}  "
              f"{str(r['same_tokens']):>11}  {r['ttft_ms']:>12}  {r['baseline_ttft_ms']:>16}")


if __name__ == "__main__":
    main()
