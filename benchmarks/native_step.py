"""The native decode step alone (runtime/backends/native/decode_step.c), by context length, thread count and instruction-set
level: how a step's time and its speed-up over threads change as the attention's share grows, and what each level's
products give.

    . .venv/bin/activate && python benchmarks/native_step.py [ART] [--contexts 576,2048,8000] [--threads 1,2]
        [--isa native|all|LEVEL,...] [--steps 200] [--rounds 3] [--json]

--isa all: every level this host's CPU can execute (runtime/backends/native/build.py host_levels: plain, ssse3, avx2,
avx-vnni, avx512bw, avx512-vnni on x86-64; plain, neon, neon-dotprod on ARM), each built with its own -march and
loaded through K2DEPLOY_NATIVE_ISA, side by side in the same rounds; speed-ups are against the first row.

(from the repository root; without ART, the `small` artifact that benchmarks/decode_latency.py writes under
/tmp/k2deploy-bench, made first if missing). Each thread count runs in a process of its own (the native pool is
sized once a process), in --rounds interleaved rounds. A process fills a cache with random int8 latents, scales
and rope keys (the step's cost does not depend on their values) and, for each context T, times --steps steps
of one sequence at position T (T cached positions before it), each a different token, so that the routed experts
change as in decode, after 10 untimed ones; then the final norm and the head alone. The table gives the median over
rounds of each process's median, and each thread count's speed-up against the first.

At a short context a step is mostly weight products, bounded by what the memory system gives the threads
(benchmarks/stream_bound.py); at a long one mostly attention over the cache, which is arithmetic, each thread
taking its share of the positions: the speed-up over threads grows with the context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
from pathlib import Path

from k2deploy.runtime.backends.native.build import ISA_VARIABLE
from thread_pools import counts, ensure_artifact, isa_levels

# argv: artifact threads steps contexts(comma-separated); prints {"step_ms": {T: ms}, "head_ms": ms}
_CHILD = r"""
import json, sys, time
import numpy as np
from k2deploy.core.cache_format import PAGE_SIZE
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.onnx.host_pages import LatentPages
from k2deploy.runtime.backends.native.choice import load_model

artifact, threads, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
contexts = [int(t) for t in sys.argv[4].split(",")]
model = load_model(load_manifest(artifact), threads=threads, decode="native")
native, vocab = model.native, model.config.vocab_size
result = {"isa": native.isa, "step_ms": {}}
pages = max(contexts) // PAGE_SIZE + 1
store = LatentPages(model.kv_cache, model.num_layers, pages)
rng = np.random.default_rng(0)
store.arrays["latent"][...] = rng.integers(0, 256, store.arrays["latent"].shape)
store.arrays["latent_scale"][...] = rng.random(store.arrays["latent_scale"].shape) * 0.01
store.arrays["rope"][...] = rng.random(store.arrays["rope"].shape).astype(np.float16)
table = np.arange(pages, dtype=np.int64)
tokens = rng.integers(0, vocab, steps + 10)
for context in contexts:
    times = []
    for i, token in enumerate(tokens):
        started = time.perf_counter()
        hidden = native.step(int(token), context, table, store.arrays)
        if i >= 10:
            times.append((time.perf_counter() - started) * 1e3)
    result["step_ms"][context] = float(np.median(times))
times = []
for _ in range(steps):
    started = time.perf_counter()
    native.logits(hidden)
    times.append((time.perf_counter() - started) * 1e3)
result["head_ms"] = float(np.median(times))
print(json.dumps(result))
"""


def measure(artifact: Path, isa: str, threads: int, steps: int, contexts: list[int]) -> dict:
    run = subprocess.run([sys.executable, "-c", _CHILD, str(artifact), str(threads), str(steps),
                          ",".join(map(str, contexts))], capture_output=True, text=True,
                         env={**os.environ, ISA_VARIABLE: isa})
    if run.returncode != 0:
        tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"native_step.py: the step at {threads} thread(s), level {isa}, failed: {tail}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", type=Path, help="a cpu-lowered artifact (default: decode_latency's small)")
    parser.add_argument("--contexts", default="576,2048,8000", help="cached positions, comma-separated "
                                                                    "(default 576,2048,8000)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--isa", default="native",
                        help="instruction-set levels, comma-separated, or all: every level this CPU runs "
                             "(default native: -march=native)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per context (default 200)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the thread counts (default 3)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    contexts, threads = counts(args.contexts, "contexts", parser), counts(args.threads, "threads", parser)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds: give at least 1")
    levels = isa_levels(args.isa, parser)
    artifact = ensure_artifact(args.artifact)
    configs = [(isa, t) for isa in levels for t in threads]
    runs = {config: [] for config in configs}
    for round_ in range(args.rounds):
        for isa, t in configs:
            runs[isa, t].append(measure(artifact, isa, t, args.steps, contexts))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    rows = []
    for (isa, t), got in runs.items():
        step = {c: statistics.median(r["step_ms"][str(c)] for r in got) for c in contexts}
        rows.append({"isa": got[0]["isa"], "level": isa, "threads": t, "step_ms": step,
                     "head_ms": statistics.median(r["head_ms"] for r in got)})
    base = rows[0]
    for row in rows:
        row["step_speedup"] = {c: base["step_ms"][c] / row["step_ms"][c] for c in contexts}
        row["head_speedup"] = base["head_ms"] / row["head_ms"]
    if args.json:
        print(json.dumps({"artifact": str(artifact), "steps": args.steps, "rounds": args.rounds, "rows": rows}, indent=2))
        return 0
    print(f"{artifact.name}: native step of one sequence, median of {args.rounds} rounds of {args.steps} steps; "
          f"speed-ups against the first row")
    print(f"{'isa':>12} {'threads':>7} " + " ".join(f"{f'T={c} ms':>11} {'x':>6}" for c in contexts)
          + f" {'head ms':>8} {'x':>6}")
    for row in rows:
        cells = " ".join(f"{row['step_ms'][c]:>11.3f} {row['step_speedup'][c]:>5.2f}x" for c in contexts)
        print(f"{row['isa']:>12} {row['threads']:>7} {cells} {row['head_ms']:>8.3f} {row['head_speedup']:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
