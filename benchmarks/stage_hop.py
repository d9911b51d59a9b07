"""What a pipeline stage hop costs per decoded token: the same artifact decoded unplaced (one process), as
stages in one process, and as stages on Ray (a local Ray started here) stepped through tasks and through a
compiled graph, the latter with every stage on an actor ("all actors") and as the runtime places them (the first
stage in the driver, the others on actors), at the same thread count.

    python benchmarks/stage_hop.py [--preset small] [--stages 2,3] [--batch 1,4] [--context 128] [--steps 40]
        [--decode auto|native|onnx]

Per placement and batch, the best of --rounds interleaved rounds: the median decode step (one token per row,
after a prompt of --context tokens per row), its ratio to the unplaced step, the cost per hop ((placed -
unplaced) / hops; a decode step crosses each boundary once and the logits come back) and the tokens per second
(rows / step; with batch >= 2 Ray stages run one micro-batch per stage, in flight together). Checkpoints and
artifacts are made once under --work and reused, as benchmarks/decode_latency.py makes them.

The models stay loaded from round to round, but each compiled graph is released after its run (its actors poll a
core each while a graph is up, as a server's are until it has been idle for a while) and compiled again by its
next run's prompt, so that only the graph being timed polls, as in a process that runs one model.
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

from k2deploy.runtime.backends.native.decoder import DECODE_KERNELS  # noqa: E402


def even_placement(layers: int, stages: int) -> str:
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return ",".join(f"{a}:{b}@cpu" for a, b in zip(bounds, bounds[1:]))


def time_decode(model, batch: int, context: int, steps: int, warmup: int, seed: int) -> list[float]:
    """Seconds per decode step (one token for each of `batch` rows) after a prompt of `context` tokens per row,
    through the step loop's forward."""
    from k2deploy.runtime.engine.batch_forward import BatchForward

    rng = np.random.default_rng(seed)
    slots = list(range(batch))
    prompts = [rng.integers(0, model.config.vocab_size, context).tolist() for _ in slots]
    cache = model.new_cache(batch, context + warmup + steps + 1)
    run = BatchForward(model, cache)
    tokens = run.prefill(slots, prompts).argmax(axis=-1)
    samples = []
    for step in range(warmup + steps):
        started = time.perf_counter()
        tokens = run.decode(slots, tokens).argmax(axis=-1)
        if step >= warmup:
            samples.append(time.perf_counter() - started)
    return samples


def release(model):
    """Placed stages let go of their compiled graph (its actors stop polling) -> the model."""
    if hasattr(model, "release_idle"):
        model.release_idle()
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="checkpoint preset (default: small)")
    parser.add_argument("--target", choices=["cpu", "cuda"], default="cpu", help="the artifact's lowering (default cpu)")
    parser.add_argument("--stages", default="2,3", help="stage counts to time, comma-separated (default 2,3)")
    parser.add_argument("--batch", default="1,4", help="rows per decode step, comma-separated (default 1,4)")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps (default 128)")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per run (default 40)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed decode steps first (default 5)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all runs, models kept loaded; each run's best round counts (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="threads, per stage too (default 1)")
    parser.add_argument("--decode", choices=DECODE_KERNELS, default="auto",
                        help="the cpu provider's decode step, unplaced and in every stage (default auto: as generate's)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/k2deploy-bench"), help="where models are kept")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    import ray

    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.engine.config import resolve_engine_config
    from k2deploy.runtime.loading import load_backend
    from k2deploy.runtime.stages.placed import load_placed

    checkpoint, config = ensure_checkpoint(args.work, args.preset, None, [], 0)
    artifact = ensure_artifact(args.work, checkpoint, config, None, args.target)
    manifest = load_manifest(artifact)
    layers = config.num_hidden_layers
    batches = [int(n) for n in args.batch.split(",")]
    tokens = max(batches) * (args.context + args.warmup + args.steps + 1)
    ray.init(include_dashboard=False, namespace="k2deploy", log_to_driver=False)
    unplaced = resolve_engine_config(manifest, argparse.Namespace(threads=args.threads, decode=args.decode),
                                     cache_tokens=tokens)
    runs = {"unplaced": lambda: load_backend(manifest, unplaced)}
    for count in (int(n) for n in args.stages.split(",")):
        text = even_placement(layers, count)
        in_process = resolve_engine_config(manifest, argparse.Namespace(threads=args.threads, placement=text,
                                                                        decode=args.decode), cache_tokens=tokens)
        runs[f"{count} stages, one process"] = lambda engine=in_process: load_backend(manifest, engine)
        for compiled, driver_stage, how in ((False, True, "Ray tasks"), (True, False, "Ray compiled, all actors"),
                                            (True, True, "Ray compiled")):
            runs[f"{count} stages, {how}"] = lambda text=text, compiled=compiled, driver_stage=driver_stage: load_placed(
                manifest, text, "auto", "cpu", args.threads, tokens, compiled, driver_stage, decode=args.decode)
    models = {}
    for name, make in runs.items():
        log(f"loading {name}")
        models[name] = release(make())
    rows = {}
    for round_ in range(args.rounds):  # interleaved, so that a slow spell of a shared machine hits every run
        for batch in batches:
            for name, model in models.items():
                samples = time_decode(model, batch, args.context, args.steps, args.warmup, seed=round_)
                release(model)
                row = {"hops": len(getattr(model, "placements", [None])) - 1,
                       "median_ms": statistics.median(samples) * 1e3, "p90_ms": float(np.percentile(samples, 90)) * 1e3}
                if (batch, name) not in rows or row["median_ms"] < rows[batch, name]["median_ms"]:
                    rows[batch, name] = row
    for (batch, name), row in rows.items():
        base = rows[batch, "unplaced"]["median_ms"]
        row["ratio"] = row["median_ms"] / base
        row["ms_per_hop"] = (row["median_ms"] - base) / row["hops"] if row["hops"] else None
        row["tokens_per_s"] = batch / row["median_ms"] * 1e3
    report = {"preset": args.preset, "target": args.target, "context": args.context, "threads": args.threads,
              "steps": args.steps, "rounds": args.rounds,
              "runs": {f"batch {batch}, {name}": row for (batch, name), row in rows.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.preset} ({args.target}), decode after {args.context} tokens per row, {args.threads} thread(s) "
          f"per stage, median of {args.steps} steps, best of {args.rounds} rounds")
    print(f"{'batch':>5} {'run':<36} {'hops':>4} {'ms/step':>8} {'p90':>8} {'x unplaced':>10} {'ms/hop':>7} {'tok/s':>7}")
    for (batch, name), row in rows.items():
        hop = f"{row['ms_per_hop']:.2f}" if row["ms_per_hop"] is not None else "-"
        print(f"{batch:>5} {name:<36} {row['hops']:>4} {row['median_ms']:>8.2f} {row['p90_ms']:>8.2f} "
              f"{row['ratio']:>10.2f} {hop:>7} {row['tokens_per_s']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
