"""The `bench` subcommand: `k2deploy bench ART ...` runs the benchmark, `k2deploy bench compare
DIR ...` tabulates saved results. Registered in k2deploy's parser by add_bench_parser(); also
runnable alone as `python -m k2deploy.bench`.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..core.errors import K2Error
from .output_paths import check_output_folder, output_errors
from .runtime_options import add_runtime_options, add_speculative_option

USAGE = """k2deploy bench ART [--batch 1,4] [--prompt-len 128,512] [--gen-len 8] [--backend onnxruntime|tensorrt]
                      [--provider cpu|cuda|tensorrt] [--threads N] [--baseline eager|hf|none] [--repeats 3]
                      [--warmup 1] [--out DIR] [--json]
       k2deploy bench compare DIR [DIR ...] [--out DIR] [--markdown] [--json]"""

DEFAULT_OUT = "artifacts/bench"
DESCRIPTION = """\
bench ART: latency, throughput and memory of an exported artifact on this machine. Every
(batch, prompt length) cell runs --warmup untimed runs, then --repeats runs of prefill + first
token and --gen-len - 1 decode steps; the eager PyTorch reference (or transformers'
DeepseekV3) on the artifact's checkpoint runs interleaved with ours, in a child process, and is
reported as ratios (baseline / ours). Figures are medians with p90 and spread: time to first
token, time per output token, tokens/s per stream and per batch, prefill tokens/s, one decode
step by stage (embedding, each layer, head, sampling, overhead between sessions), weights and
KV-cache bytes, peak RSS; the memory bandwidth measured in the same run, and the decode step
against (bytes read per step) / bandwidth. Writes DIR/<device>/bench.json (schema.json beside
it), bench.csv, per_layer.png and tpot_vs_context.png.

bench compare DIR [DIR ...]: one table (text, or --markdown) and one plot (DIR/compare.png) over
saved results, e.g. two providers or two thread counts, from the files alone."""


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values:
        raise K2Error(f"{option} {text!r}: expected comma-separated integers, e.g. 1,8")
    return values


def cmd_bench(args: argparse.Namespace) -> None:
    targets = args.target
    if targets[0] == "compare":
        return _compare(args, targets[1:])
    if len(targets) != 1:
        raise K2Error(f"expected one artifact directory, got {len(targets)} ({' '.join(targets)}); "
                      f"to compare saved results: k2deploy bench compare DIR [DIR ...]")
    return _run(args, targets[0])


def _run(args: argparse.Namespace, artifact: str) -> None:
    from tqdm import tqdm

    from ..bench.bandwidth import DEFAULT_BYTES
    from ..bench.report import format_result, write_result
    from ..bench.run import BenchOptions, run_bench

    out = args.out or DEFAULT_OUT
    check_output_folder(out, "--out")  # before the runs
    options = BenchOptions(
        artifact=artifact, batches=_int_list(args.batch, "--batch"), prompt_lens=_int_list(args.prompt_len, "--prompt-len"),
        gen_len=args.gen_len, provider=args.provider, backend=args.backend, placement=args.placement, ray=args.ray,
        threads=args.threads, decode=args.decode, speculative=args.speculative, baseline=args.baseline,
        repeats=args.repeats, warmup=args.warmup, seed=args.seed,
        bandwidth_bytes=args.bandwidth_mib << 20 if args.bandwidth_mib else DEFAULT_BYTES,
        verify_hashes=not args.no_verify, command=" ".join(["k2deploy", "bench", *sys.argv[2:]]))
    with tqdm(unit="run", desc="bench", disable=args.json or None, file=sys.stderr) as bar:
        doc = run_bench(options, bar=bar, log=lambda message: bar.set_description_str(message))
    with output_errors(out, "--out"):
        paths = write_result(doc, out)
    if args.json:
        print(json.dumps({**doc, "files": {k: str(v) for k, v in paths.items()}}, indent=2))
    else:
        print(format_result(doc, markdown=args.markdown))
        print(f"wrote {paths['json'].parent}/: {', '.join(p.name for p in paths.values())} "
              f"in {doc['wall_seconds']:.0f} s")


def _compare(args: argparse.Namespace, dirs: list[str]) -> None:
    from ..bench.compare import format_compare, run_compare

    if not dirs:
        raise K2Error("compare needs at least one results directory: k2deploy bench compare DIR [DIR ...]")
    check_output_folder(args.out or dirs[0], "--out")
    summary = run_compare(dirs, args.out or dirs[0])
    results = summary.pop("_results")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_compare(results, markdown=args.markdown))
        for note in summary["notes"]:
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {summary['markdown']}" + (f" and {summary['plot']}" if summary["plot"] else ""), file=sys.stderr)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `bench` to a parser's subcommands (from argparse's add_subparsers())."""
    bench = subparsers.add_parser("bench", help="benchmark an artifact on this machine, or compare saved results",
                                  usage=USAGE, description=DESCRIPTION,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("target", nargs="+", metavar="ART | compare DIR",
                       help="an artifact directory to benchmark, or the word `compare` and result directories")
    run = bench.add_argument_group("bench ART")
    run.add_argument("--batch", default="1,4", help="batch sizes, comma-separated (default: 1,4)")
    run.add_argument("--prompt-len", default="128,512", help="prompt lengths, comma-separated (default: 128,512)")
    run.add_argument("--gen-len", type=int, default=8,
                     help="tokens generated per row and run: the first, then gen-len - 1 timed decode steps (default: 8)")
    add_runtime_options(run, threads_help="; the baseline's torch threads alike")
    add_speculative_option(run)
    run.add_argument("--baseline", choices=["eager", "hf", "none"],
                     help="eager: the PyTorch reference on the artifact's checkpoint; hf: transformers' DeepseekV3 "
                          "(needs transformers); none (default: eager where torch and the checkpoint are present)")
    run.add_argument("--repeats", type=int, default=3, help="timed runs per cell and side (default: 3)")
    run.add_argument("--warmup", type=int, default=1, help="untimed runs per cell and side first (default: 1)")
    run.add_argument("--seed", type=int, default=0, help="prompt ids seed (default: 0)")
    run.add_argument("--bandwidth-mib", type=int, default=0, help="array size of the bandwidth copy (default: 256)")
    run.add_argument("--no-verify", action="store_true",
                     help="skip checking the artifact's files against the manifest's digests")
    both = bench.add_argument_group("both")
    both.add_argument("--out", help="bench: results folder, written to OUT/<device>/ (default: artifacts/bench); "
                                    "compare: where compare.md and compare.png go (default: the first DIR)")
    both.add_argument("--markdown", action="store_true", help="print the table as markdown")
    both.add_argument("--json", action="store_true", help="print the result as JSON")
    bench.set_defaults(func=cmd_bench)
    return bench
