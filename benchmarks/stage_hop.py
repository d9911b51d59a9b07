"""What a pipeline stage hop costs per decoded token: the same artifact decoded unplaced (one process), as
stages in one process, and as stages on Ray actors (a local Ray started here), at the same thread count.

    python benchmarks/stage_hop.py [--preset small] [--stages 2,3] [--context 128] [--steps 40] [--threads 1]

Per placement, the best of --rounds interleaved rounds: the median decode step (one token, batch 1, after a prompt of --context tokens), its ratio
to the unplaced step, and the cost per hop ((placed - unplaced) / hops; a decode step crosses each
boundary once and returns the last hidden state for the head). Checkpoints and artifacts are made
once under --work and reused, as benchmarks/decode_latency.py makes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from decode_latency import ensure_artifact, ensure_checkpoint, log  # noqa: E402


def even_placement(layers: int, stages: int) -> str:
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return ",".join(f"{a}:{b}@cpu" for a, b in zip(bounds, bounds[1:]))


def time_decode(model, context: int, steps: int, warmup: int, seed: int) -> list[float]:
    """Seconds per decode step (batch 1) after a prompt of `context` tokens, through the step loop."""
    from k2deploy.runtime.batch_forward import BatchForward

    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.config.vocab_size, context).tolist()
    cache = model.new_cache(1, context + warmup + steps + 1)
    run = BatchForward(model, cache)
    token = int(run.prefill([0], [prompt]).argmax())
    samples = []
    for step in range(warmup + steps):
        started = time.perf_counter()
        token = int(run.decode([0], np.array([token])).argmax())
        if step >= warmup:
            samples.append(time.perf_counter() - started)
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="checkpoint preset (default: small)")
    parser.add_argument("--target", choices=["cpu", "cuda"], default="cpu", help="the artifact's lowering (default cpu)")
    parser.add_argument("--stages", default="2,3", help="stage counts to time, comma-separated (default 2,3)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps (default 128)")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed decode steps first (default 5)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all runs, models kept loaded; each run's best round counts (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads, per stage too (default 1)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/k2deploy-bench"), help="where models are kept")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    import ray

    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.ort_backend import OrtModel
    from k2deploy.runtime.backends import load_backend

    checkpoint, config = ensure_checkpoint(args.work, args.preset, None, [], 0)
    artifact = ensure_artifact(args.work, checkpoint, config, None, args.target)
    manifest = load_manifest(artifact)
    layers = config.num_hidden_layers
    ray.init(include_dashboard=False, namespace="k2deploy", log_to_driver=False)
    runs = {"unplaced": lambda: OrtModel(manifest, threads=args.threads)}
    for count in (int(n) for n in args.stages.split(",")):
        text = even_placement(layers, count)
        runs[f"{count} stages, one process"] = lambda text=text: load_backend("onnxruntime", manifest, threads=args.threads,
                                                                             placement=text)
        runs[f"{count} stages, Ray actors"] = lambda text=text: load_backend("onnxruntime", manifest, threads=args.threads,
                                                                            placement=text, ray="auto")
    models = {}
    for name, make in runs.items():
        log(f"loading {name}")
        models[name] = make()
    rows = {}
    for round_ in range(args.rounds):  # interleaved, so that a slow spell of a shared machine hits every run
        for name, model in models.items():
            samples = time_decode(model, args.context, args.steps, args.warmup, seed=round_)
            row = {"hops": len(getattr(model, "placements", [None])) - 1,
                   "median_ms": statistics.median(samples) * 1e3, "p90_ms": float(np.percentile(samples, 90)) * 1e3}
            if name not in rows or row["median_ms"] < rows[name]["median_ms"]:
                rows[name] = row
    base = rows["unplaced"]["median_ms"]
    for row in rows.values():
        row["ratio"] = row["median_ms"] / base
        row["ms_per_hop"] = (row["median_ms"] - base) / row["hops"] if row["hops"] else None
    report = {"preset": args.preset, "target": args.target, "context": args.context, "threads": args.threads,
              "steps": args.steps, "rounds": args.rounds, "runs": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.preset} ({args.target}), decode after {args.context} tokens, batch 1, {args.threads} thread(s) "
          f"per stage, median of {args.steps} steps, best of {args.rounds} rounds")
    print(f"{'run':<26} {'hops':>4} {'ms/token':>9} {'p90':>8} {'x unplaced':>10} {'ms/hop':>7}")
    for name, row in rows.items():
        hop = f"{row['ms_per_hop']:.2f}" if row["ms_per_hop"] is not None else "-"
        print(f"{name:<26} {row['hops']:>4} {row['median_ms']:>9.2f} {row['p90_ms']:>8.2f} {row['ratio']:>10.2f} "
              f"{hop:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
