"""A real-size artifact through the runtime's default kernels (the native step where it runs): its start against
reading the artifact once, its time per token against the bytes a token reads over the host's bandwidth, its peak
resident memory against the artifact's bytes.

    . .venv/bin/activate && python benchmarks/native_at_size.py ART [--threads 2] [--prompt-len 128]
        [--new-tokens 16] [--cold] [--json]

ART: a cpu-target artifact, e.g. `k2deploy make-checkpoint K2 --preset k2 --layers 2 [--format int4]` then
`k2deploy export K2 --out ART --target cpu` (one dense layer and one 384-expert MoE layer at Kimi K2's size).
In order:

  read once    every file of the artifact read through (1 MiB reads), timed in one stream and in 8 streams side
               by side (each file in 8 contiguous runs: a disk serves several streams faster than one): with
               --cold (root only) after the page cache is dropped, so from the disk, as a first start reads it;
               else as the page cache has it. Read both ways again after generate, and the fastest of the four
               reads is the one the start is held to (a virtual disk's host cache can make a second read from
               "the disk" several times faster than the first, whichever comes second)
  bandwidth    the host's memory bandwidth (k2deploy.bench.bandwidth: a numpy copy in a child process)
  generate     `k2deploy generate ART --prompt-ids <prompt-len ids> --max-new-tokens N --threads T --json` in a
               child (after the page cache is dropped again with --cold): its wall time, TTFT, TPOT, the kernels
               it chose (decode_kernels) and its peak resident set (getrusage of the child, /usr/bin/time -v's
               figure)

and the ratios the runtime is held to: start to first token (wall time less the decode steps) over read once +
TTFT; TPOT over the bound (bytes a decode token reads / bandwidth: every weight of the layers and the head at its
artifact bytes, the routed experts k of e, one embedding row, the cache at the mean context); peak RSS over the
artifact's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from k2deploy.bench import bandwidth
from k2deploy.core.file_hashes import READS_IN_FLIGHT
from k2deploy.core.manifest import load_manifest
from k2deploy.core.onnx_wire import external_initializers

EXPERTS = ("mlp.experts_fc1_", "mlp.experts_fc2_")  # routed experts' tensors: a token reads k of e of each


def token_bytes(artifact: Path, context: float) -> dict:
    """Bytes one decode token reads from the artifact's weights and its cache at `context` cached tokens."""
    manifest = load_manifest(artifact, verify_hashes=False)
    c = manifest.config
    layers = [manifest.graph_file(f"layer_{i:03d}") for i in range(c.num_hidden_layers)]
    weights = 0.0
    for graph in [*layers, manifest.graph_file("head")]:
        for name, spec in external_initializers(graph).items():
            share = c.num_experts_per_tok / c.n_routed_experts if name.startswith(EXPERTS) else 1.0
            weights += spec.length * share
    embedding = c.hidden_size * 2  # one bfloat16 row
    cache = context * manifest.kv_cache["bytes_per_token_per_layer"] * c.num_hidden_layers
    return {"weights": weights + embedding, "cache": cache, "total": weights + embedding + cache}


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def read_once(artifact: Path, streams: int = 1, names: list[str] | None = None) -> float:
    """Seconds to read every file of the artifact (or files `names` of it) through, 1 MiB reads, each file in
    `streams` contiguous runs read side by side (a disk serves several streams faster than one)."""
    files = sorted(p for p in artifact.rglob("*") if p.is_file()) if names is None else [artifact / n for n in names]

    def read_run(path: Path, start: int, stop: int) -> None:
        with open(path, "rb", buffering=0) as handle:
            for offset in range(start, stop, 1 << 20):
                os.pread(handle.fileno(), min(1 << 20, stop - offset), offset)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        for path in files:
            size = path.stat().st_size
            cuts = [size * i // streams >> 20 << 20 for i in range(streams)] + [size]
            list(pool.map(lambda i: read_run(path, cuts[i], cuts[i + 1]), range(streams)))
    return time.perf_counter() - started


def timed_reads(artifact: Path, cold: bool) -> dict[str, float]:
    """read_once in one stream and in READS_IN_FLIGHT streams (the page cache dropped before each with `cold`)."""
    reads = {}
    for streams in (1, READS_IN_FLIGHT):
        if cold:
            drop_page_cache()
        reads[f"{streams} stream{'s' if streams > 1 else ''}"] = read_once(artifact, streams)
    return reads


def generate(artifact: Path, threads: int, prompt_len: int, new_tokens: int) -> dict:
    vocab = load_manifest(artifact, verify_hashes=False).config.vocab_size
    prompt = ",".join(str((i * 7919) % (vocab - 2) + 2) for i in range(prompt_len))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "k2deploy", "generate", str(artifact), "--prompt-ids", prompt,
                          "--max-new-tokens", str(new_tokens), "--threads", str(threads), "--json"],
                         capture_output=True, text=True)
    wall = time.perf_counter() - started
    if run.returncode != 0:
        raise SystemExit(f"native_at_size.py: generate failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = json.loads(run.stdout)
    return {"wall_s": wall, "ttft_ms": result["ttft_ms"], "tpot_ms": result["tpot_ms"],
            "tokens": len(result["token_ids"]), "decode_kernels": result["decode_kernels"],
            "peak_rss_bytes": peak_kib * 1024 if peak_kib > before else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="a cpu-target artifact")
    parser.add_argument("--threads", type=int, default=2, help="generate's --threads (default 2)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--new-tokens", type=int, default=16, help="generated tokens (default 16)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before the read and the generate "
                                                            "(root only): a first start, from the disk")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if not (args.artifact / "manifest.json").is_file():
        parser.error(f"{args.artifact}: not an artifact directory (no manifest.json)")
    if args.threads < 1 or args.prompt_len < 1 or args.new_tokens < 2:
        parser.error("--threads and --prompt-len: at least 1; --new-tokens: at least 2")
    if args.cold and os.geteuid() != 0:
        parser.error("--cold drops the page cache, which takes root")
    artifact_bytes = sum(p.stat().st_size for p in args.artifact.rglob("*") if p.is_file())
    before = timed_reads(args.artifact, args.cold)
    gbps = statistics.median(bandwidth.measure_in_child())
    if args.cold:
        drop_page_cache()
    run = generate(args.artifact, args.threads, args.prompt_len, args.new_tokens)
    after = timed_reads(args.artifact, args.cold)
    reads = {kind: [before[kind], after[kind]] for kind in before}
    read_s = min(min(times) for times in reads.values())
    step = token_bytes(args.artifact, args.prompt_len + args.new_tokens / 2)
    bound_ms = step["total"] / (gbps * 1e9) * 1e3
    first_token_s = run["wall_s"] - run["tpot_ms"] * (run["tokens"] - 1) / 1e3
    result = {
        "artifact": str(args.artifact), "artifact_bytes": artifact_bytes, "cold": args.cold,
        "read_once_s": read_s, "reads_s": reads, "read_gbps": artifact_bytes / read_s / 1e9, "bandwidth_gbps": gbps,
        "bandwidth_method": bandwidth.METHOD, **run, "token_read_bytes": step, "bound_ms": bound_ms,
        "start_to_first_token_s": first_token_s,
        "first_token_over_read_and_prefill": first_token_s / (read_s + run["ttft_ms"] / 1e3),
        "tpot_over_bound": run["tpot_ms"] / bound_ms,
        "peak_rss_over_artifact": run["peak_rss_bytes"] / artifact_bytes if run["peak_rss_bytes"] else None,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    gib = 2 ** 30
    print(f"{args.artifact.name}: {artifact_bytes / gib:.2f} GiB, {args.threads} thread(s), decode {run['decode_kernels']}")
    print(f"  read once ({'cold' if args.cold else 'page cache'}): {read_s:.1f} s ({result['read_gbps']:.2f} GB/s; "
          "reads before / after generate: " + ", ".join(f"{kind} {a:.1f} / {b:.1f} s" for kind, (a, b) in reads.items())
          + "); "
          f"memory bandwidth {gbps:.1f} GB/s (numpy copy)")
    print(f"  start to first token {first_token_s:.1f} s (TTFT {run['ttft_ms']:.0f} ms): "
          f"{result['first_token_over_read_and_prefill']:.2f}x read once + prefill")
    print(f"  TPOT {run['tpot_ms']:.1f} ms; a token reads {step['total'] / gib:.3f} GiB: bound {bound_ms:.1f} ms, "
          f"{result['tpot_over_bound']:.2f}x")
    if run["peak_rss_bytes"]:
        print(f"  peak RSS {run['peak_rss_bytes'] / gib:.2f} GiB: {result['peak_rss_over_artifact']:.2f}x the artifact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
