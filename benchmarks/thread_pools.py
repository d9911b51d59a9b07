"""How a process's threads are organised, measured: one ONNX Runtime pool shared by every session with decode
through the native step (what the runtime does, `runtime/backends/onnx/thread_pool.py`, `runtime/backends/native/decoder.py`), the same
pool with decode through the graphs too, and a pool per session with its threads spinning between runs or not.

    . .venv/bin/activate && python benchmarks/thread_pools.py [ART] [--threads 1,2] [--rounds 3] [--json]

(from the repository root; without ART, the `small` artifact that benchmarks/decode_latency.py writes under
/tmp/k2deploy-bench, made first if missing). Each configuration and thread count runs in a process of its own (a
process's global pool is sized once) as `generate` runs: a prompt of --prompt-len tokens, then --new-tokens greedy
tokens, continuously, so a pool's threads stay as warm as in a server. Rounds go through every configuration in
turn, so the machine's noise falls on each; the table gives medians over rounds of time per output token (decode),
time to first token (prefill) and the most threads the process held.

--idle-ms N sleeps N ms before each decode step (timed without the sleep): a server between requests, or a
benchmark that runs other backends between this one's steps. A pool whose threads have gone to sleep pays for
waking them in every parallel region of the next step; `decode_latency.py --threads 1,2`, which runs the other
backends between steps, measures that case.

Unless --no-bound, each round also times `benchmarks/stream_bound.py`'s native kernel at every thread count (the
step's int8 weight products alone, each split over the threads, the threads spinning between products; context the
mean of the generation's, prompt-len + new-tokens / 2): how far a decode step of this model can scale on this host
whoever runs it. Its rows give its step time as TPOT and its speed-up against its own first thread count.

ONNX Runtime's Python API sizes the global pool but does not expose its spinning (its threads spin briefly before
they sleep, as a per-session pool's do by default); per-session pools take `session.intra_op.allow_spinning`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import stream_bound
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native.build import host_levels

CONFIGS = {
    "one pool": "one global pool shared by every session (the runtime's choice), decode through the native step",
    "one pool, onnx decode": "one global pool; decode through the graphs too (--decode onnx)",
    "per session, spinning": "a pool per session, threads spin between runs (ONNX Runtime's default before)",
    "per session, no spinning": "a pool per session, session.intra_op.allow_spinning = 0",
}
BOUND = "native kernel (bound)"  # stream_bound.py's rows
DEFAULT_ARTIFACT = Path("/tmp/k2deploy-bench/artifacts/small-L4-e64-h8-seed0-cpu-int8")

# One measurement in a fresh process: argv = artifact, config, threads, prompt_len, new_tokens, idle_ms -> one JSON line.
_CHILD = """
import json, statistics, sys, time
import numpy as np
import onnxruntime as ort
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native import choice
from k2deploy.runtime.backends.onnx import model as onnx_model, thread_pool
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.engine.sampling import SamplingParams

artifact, config = sys.argv[1], sys.argv[2]
threads, prompt_len, new_tokens, idle_ms = (int(a) for a in sys.argv[3:7])
if not config.startswith("one pool"):  # the sessions get pools of their own instead of the process's one
    def per_session(threads_asked, share=1):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.endswith(", spinning") else "0")
        return options
    onnx_model.session_options = per_session
    thread_pool._pool_threads = threads  # what the model reports; no global pool is made
model = choice.load_model(load_manifest(artifact), threads=threads,
                          decode="native" if config == "one pool" else "onnx")
generator = Generator(model)
prompt = [(i * 37) % 1000 + 3 for i in range(prompt_len)]
generator.generate([prompt], SamplingParams(max_new_tokens=4))  # warm-up: arenas, kernels
if idle_ms == 0:  # as generate runs: steps back to back
    result = generator.generate([prompt], SamplingParams(max_new_tokens=new_tokens))[0]
    tpot_ms, ttft_ms = result.tpot_ms, result.ttft_ms
else:  # each decode step after idle_ms of sleep, timed alone
    cache = model.new_cache(1, prompt_len + new_tokens)
    started = time.perf_counter()
    token = int(generator.prefill([prompt], cache)[0].argmax())
    ttft_ms = (time.perf_counter() - started) * 1e3
    steps = []
    for _ in range(new_tokens - 1):
        time.sleep(idle_ms / 1e3)
        started = time.perf_counter()
        token = int(generator.decode(np.array([token]), np.array([True]), cache)[0].argmax())
        steps.append((time.perf_counter() - started) * 1e3)
    tpot_ms = statistics.median(steps)
held = int(open("/proc/self/status").read().split("Threads:")[1].split()[0])
print(json.dumps({"tpot_ms": tpot_ms, "ttft_ms": ttft_ms, "threads_held": held}))
"""


def counts(text: str, what: str, parser: argparse.ArgumentParser) -> list[int]:
    """A comma-separated list of whole numbers of at least 1 (--threads 1,2), or the parser's one-line error."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        parser.error(f"--{what} {text!r}: give whole numbers of at least 1, comma-separated, such as 1,2")
    return values


def isa_levels(text: str, parser: argparse.ArgumentParser) -> list[str]:
    """--isa: native, all (every level this CPU runs) or levels comma-separated, or the parser's one-line error."""
    levels = host_levels() if text == "all" else [v.strip() for v in text.split(",") if v.strip()]
    if not levels or any(v != "native" and v not in host_levels() for v in levels):
        parser.error(f"--isa {text!r}: this CPU runs native, all or {', '.join(host_levels())}")
    return levels


def ensure_artifact(path: Path | None) -> Path:
    if path is not None:
        return path
    if not (DEFAULT_ARTIFACT / "manifest.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("decode_latency.py")), "--contexts", "128",
                        "--steps", "1", "--no-reference", "--no-hf", "--moe-experts", "", "--prefill-repeats", "1"],
                       check=True, stdout=subprocess.DEVNULL)
    return DEFAULT_ARTIFACT


def measure(artifact: Path, config: str, threads: int, prompt_len: int, new_tokens: int, idle_ms: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(artifact), config, str(threads), str(prompt_len),
                          str(new_tokens), str(idle_ms)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", type=Path, help="a cpu-lowered artifact (default: decode_latency's small)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over every configuration (default 3)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--new-tokens", type=int, default=128, help="generated tokens (default 128)")
    parser.add_argument("--idle-ms", type=int, default=0,
                        help="sleep this long before each decode step (default 0: steps back to back, as generate)")
    parser.add_argument("--configs", default=";".join(CONFIGS),
                        help=f"configurations, separated by ';' (default: all: {'; '.join(CONFIGS)})")
    parser.add_argument("--no-bound", action="store_true", help="leave out the native kernel's rows (stream_bound.py)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    threads = counts(args.threads, "threads", parser)
    artifact = ensure_artifact(args.artifact)
    configs = [c.strip() for c in args.configs.split(";") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "one pool" not in configs:
        parser.error(f"--configs: choose among {'; '.join(CONFIGS)} (separated by ';'), with 'one pool' (the "
                     f"speed-ups' base)")
    runs = {(c, t): [] for c in configs for t in threads}
    bound = {t: [] for t in threads} if not args.no_bound else {}
    products = (stream_bound.step_products(load_manifest(artifact, verify_hashes=False).config,
                                           args.prompt_len + args.new_tokens // 2) if bound else [])
    with tempfile.TemporaryDirectory(prefix="k2deploy-stream-bound-") as folder:
        kernel = stream_bound.compile_kernel(Path(folder)) if bound else None
        for round_ in range(args.rounds):
            for key in runs:
                runs[key].append(measure(artifact, *key, args.prompt_len, args.new_tokens, args.idle_ms))
            for t in bound:
                bound[t].append(stream_bound.run_kernel(kernel, products, t, 100, 5, seed=round_ + 1)["step_ms"])
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    rows = [{"config": c, "threads": t, **{k: statistics.median(r[k] for r in runs[(c, t)])
                                           for k in ("tpot_ms", "ttft_ms", "threads_held")}}
            for c, t in runs]
    one = {row["threads"]: row for row in rows if row["config"] == "one pool"}
    for row in rows:
        base = one[threads[0]]
        row["decode_speedup"] = base["tpot_ms"] / row["tpot_ms"]
        row["prefill_speedup"] = base["ttft_ms"] / row["ttft_ms"]
    for t, times in bound.items():
        rows.append({"config": BOUND, "threads": t, "tpot_ms": statistics.median(times), "ttft_ms": None,
                     "threads_held": t, "decode_speedup": statistics.median(bound[threads[0]]) / statistics.median(times),
                     "prefill_speedup": None})
    if args.json:
        print(json.dumps({"artifact": str(artifact), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                          "idle_ms": args.idle_ms, "rounds": args.rounds, "rows": rows}, indent=2))
        return 0
    idle = f", {args.idle_ms} ms idle before each decode step" if args.idle_ms else ""
    print(f"{artifact.name}: prompt {args.prompt_len}, {args.new_tokens} new tokens{idle}, median of {args.rounds} rounds; "
          f"speed-ups against one pool of {threads[0]} thread(s)")
    print(f"{'configuration':<26} {'threads':>7} {'TPOT ms':>8} {'TTFT ms':>8} {'decode x':>9} {'prefill x':>10} "
          f"{'threads held':>13}")
    for row in rows:
        if row["config"] == BOUND:
            print(f"{row['config']:<26} {row['threads']:>7} {row['tpot_ms']:>8.2f} {'-':>8} "
                  f"{row['decode_speedup']:>8.2f}x {'-':>10} {row['threads_held']:>13.0f}")
            continue
        print(f"{row['config']:<26} {row['threads']:>7} {row['tpot_ms']:>8.2f} {row['ttft_ms']:>8.0f} "
              f"{row['decode_speedup']:>8.2f}x {row['prefill_speedup']:>9.2f}x {row['threads_held']:>13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
