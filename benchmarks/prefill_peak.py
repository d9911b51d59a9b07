"""Prefill and batched decode of a cpu-lowered artifact as a fraction of this host's int8 multiply-add peak.

    . .venv/bin/activate && python benchmarks/prefill_peak.py [ART] [--prompts 512,2048] [--threads 1,2]
        [--batches 1,4,16] [--context 128] [--isa native|all|LEVEL,...] [--rounds 3] [--json]
        [--llama-cpp BIN --gguf FILE]

(from the repository root; without ART, the `small` artifact that benchmarks/decode_latency.py writes under
/tmp/k2deploy-bench, made first if missing.)

The peak: each instruction-set level's build of the native step (runtime/backends/native/decode_step.c) runs
k2_dot4_peak, independent chains of its dot4 (isa.h: vpdpbusd on AVX-512 VNNI and AVX-VNNI, vpmaddubsw and
vpmaddwd on AVX2 and AVX-512BW, ...) on values in registers, on 1 thread and on each --threads count at once
(one OS thread each): the multiply-adds a second the level can issue, per thread and together.

Prefill: the time to first token of a prompt through the step loop `k2deploy generate` runs (Generator.generate with
--max-new-tokens 1, --decode native, N threads), in a fresh process: the first request (the weights' pages faulted in
as they are first read: the `first ms` column) and then the same prompt again into a new cache (no prefix kept), timed
as llama-bench times its prompts (after one untimed run of its own); batched decode: one native step of B sequences, each at --context cached positions,
then the head, timed alone (the median of 20 steps after 3 untimed ones). Work counts the int8 multiply-adds the
maths needs, from the artifact's config: every weight product a token makes (attention's q_a, q_b, kv_a, o and
absorbed W_UK and W_UV; the dense MLP, or the top-k routed experts and the shared one; the head once a sequence),
and the attention's over the cache: heads x 2 x kv_lora_rank a (query, cached position) pair (scores and values),
causal for a prompt. The rope scores (heads x qk_rope_head_dim float multiply-adds a pair) and the router (a float
product) are not counted. Each figure is the median of --rounds interleaved rounds; the fraction divides the
achieved multiply-adds a second by the level's measured peak at the same thread count.

With --llama-cpp (a folder holding llama.cpp's llama-bench and llama-batched-bench) and --gguf (the same weights as
a GGUF, such as Q8_0), llama.cpp runs each cell in the same rounds, right after ours: `llama-bench -p N -n 0 -t T`
for a prompt, `llama-batched-bench -npp CONTEXT -ntg 32 -npl B -t T` for a batch (its text-generation tokens a
second); the `x llama.cpp` column is its time over ours.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native.build import ISA_VARIABLE, host_levels
from thread_pools import counts, ensure_artifact, isa_levels

# argv: threads seconds; prints {"isa": ..., "per_thread": [GMAC/s ...]}
_PEAK = r"""
import ctypes, json, sys, threading, time
from k2deploy.runtime.backends.native.build import library
threads, seconds = int(sys.argv[1]), float(sys.argv[2])
lib = library()
lib.k2_dot4_peak.argtypes, lib.k2_dot4_peak.restype = [ctypes.c_long], ctypes.c_long
lib.k2_dot4_peak_width.restype = ctypes.c_long
width = lib.k2_dot4_peak_width()
rounds = 1000
started = time.perf_counter()
while time.perf_counter() - started < 0.05:  # size a call to about `seconds`
    lib.k2_dot4_peak(rounds)
    rounds *= 2
spent = time.perf_counter() - started
rounds = max(1000, int(rounds * seconds / spent))
rates = [0.0] * threads
def one(i):
    t = time.perf_counter()
    lib.k2_dot4_peak(rounds)  # ctypes lets go of the GIL: the threads run at once
    rates[i] = rounds * width / (time.perf_counter() - t) / 1e9
workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
print(json.dumps({"isa": lib.k2_isa().decode(), "per_thread": rates}))
"""

# argv: artifact threads batch context steps; prints {"step_ms": ms} (the step of all sequences and the head)
_BATCH = r"""
import json, sys, time
import numpy as np
from k2deploy.core.cache_format import PAGE_SIZE
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.onnx.host_pages import LatentPages
from k2deploy.runtime.backends.native.choice import load_model
artifact, threads, batch, context, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model = load_model(load_manifest(artifact), threads=threads, decode="native")
native, vocab = model.native, model.config.vocab_size
per = context // PAGE_SIZE + 1
store = LatentPages(model.kv_cache, model.num_layers, per * batch)
rng = np.random.default_rng(0)
store.arrays["latent"][...] = rng.integers(0, 256, store.arrays["latent"].shape)
store.arrays["latent_scale"][...] = rng.random(store.arrays["latent_scale"].shape) * 0.01
store.arrays["rope"][...] = rng.random(store.arrays["rope"].shape).astype(np.float16)
tables = np.arange(per * batch, dtype=np.int64).reshape(batch, per)
positions = np.full(batch, context)
times = []
for i in range(steps + 3):
    tokens = rng.integers(0, vocab, batch)
    started = time.perf_counter()
    native.logits(native.steps(tokens, positions, tables, store.arrays))
    if i >= 3:
        times.append((time.perf_counter() - started) * 1e3)
print(json.dumps({"step_ms": float(np.median(times))}))
"""


# argv: artifact threads ids (comma-separated); prints {"first_ms": ms, "ms": ms}: the first request's time to first
# token, then the same prompt's again (a new step loop and cache: nothing of the first is reused)
_PREFILL = r"""
import json, sys
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.engine.sampling import SamplingParams
artifact, threads, ids = sys.argv[1], int(sys.argv[2]), [int(i) for i in sys.argv[3].split(",")]
generator = Generator(load_model(load_manifest(artifact), threads=threads, decode="native"))
first, again = (generator.generate([ids], SamplingParams(max_new_tokens=1))[0].ttft_ms for _ in range(2))
print(json.dumps({"first_ms": first, "ms": again}))
"""


def token_macs(c) -> int:
    """int8 multiply-adds of one token's weight products, the head left out."""
    m, h, d, r, v, lat = (c.hidden_size, c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                          c.kv_lora_rank)
    attention = c.q_lora_rank * m + h * (d + r) * c.q_lora_rank + (lat + r) * m + m * h * v + h * d * lat + h * lat * v
    total = 0
    for layer in range(c.num_hidden_layers):
        if c.is_moe_layer(layer):
            mlp = (c.num_experts_per_tok + c.n_shared_experts) * 3 * c.moe_intermediate_size * m
        else:
            mlp = 3 * c.intermediate_size * m
        total += attention + mlp
    return total


def pair_macs(c) -> int:
    """int8 multiply-adds of one (query, cached position) pair over all layers: scores and values."""
    return c.num_hidden_layers * c.num_attention_heads * 2 * c.kv_lora_rank


def prefill_macs(c, tokens: int) -> int:
    return tokens * token_macs(c) + tokens * (tokens + 1) // 2 * pair_macs(c) + c.vocab_size * c.hidden_size


def batch_macs(c, batch: int, context: int) -> int:
    return batch * (token_macs(c) + (context + 1) * pair_macs(c) + c.vocab_size * c.hidden_size)


def _child(code_or_args: list[str], isa: str, what: str) -> dict:
    run = subprocess.run(code_or_args, capture_output=True, text=True, env={**os.environ, ISA_VARIABLE: isa},
                         timeout=3600)
    if run.returncode != 0:
        tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"prefill_peak.py: {what} failed: {tail}")
    return json.loads(run.stdout)


def peak(isa: str, threads: int) -> dict:
    return _child([sys.executable, "-c", _PEAK, str(threads), "0.5"], isa, f"the peak at level {isa}")


def prefill_ms(artifact: Path, isa: str, threads: int, prompt: list[int]) -> dict:
    """{"first_ms": the first request's time to first token, "ms": the same prompt's next time}"""
    return _child([sys.executable, "-c", _PREFILL, str(artifact), str(threads), ",".join(map(str, prompt))], isa,
                  f"the prefill of {len(prompt)} tokens on {threads} thread(s), level {isa}")


def batch_ms(artifact: Path, isa: str, threads: int, batch: int, context: int) -> float:
    got = _child([sys.executable, "-c", _BATCH, str(artifact), str(threads), str(batch), str(context), "20"], isa,
                 f"the decode of {batch} sequences on {threads} thread(s), level {isa}")
    return float(got["step_ms"])


def llama_prefill_ms(binaries: Path, gguf: Path, threads: int, tokens: int) -> float:
    """llama-bench's time for a prompt of `tokens` tokens (one repetition)."""
    run = subprocess.run([str(binaries / "llama-bench"), "-m", str(gguf), "-p", str(tokens), "-n", "0", "-t", str(threads),
                          "-r", "1", "-o", "json"], capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise SystemExit(f"prefill_peak.py: llama-bench failed: {(run.stderr.strip().splitlines() or ['?'])[-1]}")
    return tokens / float(json.loads(run.stdout)[0]["avg_ts"]) * 1e3


def llama_batch_ms(binaries: Path, gguf: Path, threads: int, batch: int, context: int) -> float:
    """llama-batched-bench's time for one decode step of `batch` sequences after `context` prompt tokens each."""
    run = subprocess.run([str(binaries / "llama-batched-bench"), "-m", str(gguf), "-c", str(batch * (context + 64)),
                          "-b", "2048", "-ub", "512", "-npp", str(context), "-ntg", "32", "-npl", str(batch), "-t",
                          str(threads), "--output-format", "jsonl"], capture_output=True, text=True, timeout=3600)
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not rows:
        raise SystemExit(f"prefill_peak.py: llama-batched-bench failed: "
                         f"{(run.stderr.strip().splitlines() or ['?'])[-1]}")
    return batch / float(rows[-1]["speed_tg"]) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", type=Path, help="a cpu-lowered artifact (default: decode_latency's small)")
    parser.add_argument("--prompts", default="512,2048", help="prompt lengths, comma-separated (default 512,2048)")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default 1,2)")
    parser.add_argument("--batches", default="1,4,16", help="decode batch sizes, comma-separated; 0: none "
                                                            "(default 1,4,16)")
    parser.add_argument("--context", type=int, default=128, help="cached positions of each decoded sequence "
                                                                  "(default 128)")
    parser.add_argument("--isa", default="native", help="instruction-set levels, comma-separated, or all: every "
                                                        "level this CPU runs (default native: -march=native)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--llama-cpp", type=Path, help="a folder holding llama.cpp's llama-bench and "
                                                       "llama-batched-bench: run each cell through them too")
    parser.add_argument("--gguf", type=Path, help="with --llama-cpp: the same weights as a GGUF")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if (args.llama_cpp is None) != (args.gguf is None):
        parser.error("--llama-cpp and --gguf go together")
    if args.llama_cpp is not None and not all((args.llama_cpp / name).is_file() for name in ("llama-bench",
                                                                                           "llama-batched-bench")):
        parser.error(f"--llama-cpp {args.llama_cpp}: holds no llama-bench and llama-batched-bench")
    if args.gguf is not None and not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf}: no such file")
    prompts, threads = counts(args.prompts, "prompts", parser), counts(args.threads, "threads", parser)
    batches = [] if args.batches.strip() == "0" else counts(args.batches, "batches", parser)
    if args.rounds < 1 or args.context < 0:
        parser.error("--rounds: give at least 1; --context: 0 or more")
    levels = isa_levels(args.isa, parser)
    artifact = ensure_artifact(args.artifact)
    config = load_manifest(artifact).config
    ids = [(i * 7919) % (config.vocab_size - 300) + 256 for i in range(max(prompts))]
    cells = ([("peak", isa, t, 0) for isa in levels for t in threads] +
             [("prefill", isa, t, n) for isa in levels for t in threads for n in prompts] +
             [("decode", isa, t, b) for isa in levels for t in threads for b in batches])
    runs: dict[tuple, list] = {cell: [] for cell in cells}
    llama: dict[tuple, list] = {cell: [] for cell in cells if cell[0] != "peak" and args.llama_cpp is not None}
    for round_ in range(args.rounds):
        for cell in cells:
            kind, isa, t, size = cell
            if kind == "peak":
                runs[cell].append(peak(isa, t))
            elif kind == "prefill":
                runs[cell].append(prefill_ms(artifact, isa, t, ids[:size]))
            else:
                runs[cell].append(batch_ms(artifact, isa, t, size, args.context))
            if cell in llama and kind == "prefill":
                llama[cell].append(llama_prefill_ms(args.llama_cpp, args.gguf, t, size))
            elif cell in llama:
                llama[cell].append(llama_batch_ms(args.llama_cpp, args.gguf, t, size, args.context))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    peaks = {(isa, t): {"isa": runs["peak", isa, t, 0][0]["isa"],
                        "per_thread_gmacs": statistics.median(min(r["per_thread"]) for r in runs["peak", isa, t, 0]),
                        "total_gmacs": statistics.median(sum(r["per_thread"]) for r in runs["peak", isa, t, 0])}
             for isa in levels for t in threads}
    rows = []
    for kind, isa, t, size in cells:
        if kind == "peak":
            continue
        got = runs[kind, isa, t, size]
        ms = statistics.median(r["ms"] for r in got) if kind == "prefill" else statistics.median(got)
        work = prefill_macs(config, size) if kind == "prefill" else batch_macs(config, size, args.context)
        rate = work / (ms / 1e3) / 1e9
        tokens = size / (ms / 1e3)
        rows.append({"kind": kind, "level": isa, "isa": peaks[isa, t]["isa"], "threads": t,
                     "tokens" if kind == "prefill" else "batch": size, "ms": round(ms, 2),
                     "tokens_per_s": round(tokens, 1), "gmacs": round(rate, 1),
                     "of_peak": round(rate / peaks[isa, t]["total_gmacs"], 3)})
        if kind == "prefill":
            rows[-1]["first_ms"] = round(statistics.median(r["first_ms"] for r in got), 2)
        if (kind, isa, t, size) in llama:
            theirs = statistics.median(llama[kind, isa, t, size])
            rows[-1].update(llama_cpp_ms=round(theirs, 2), llama_cpp_over_ours=round(theirs / ms, 2))
    host = {"cpu": platform.processor() or platform.machine(), "levels": host_levels()}
    if args.json:
        print(json.dumps({"artifact": str(artifact), "host": host, "context": args.context, "rounds": args.rounds,
                          "peak": [{"level": isa, "threads": t, **p} for (isa, t), p in peaks.items()],
                          "runs": rows}, indent=1))
        return 0
    print(f"{artifact.name}: int8 multiply-add peak, median of {args.rounds} rounds")
    print(f"{'isa':>12} {'threads':>7} {'GMAC/s a thread':>16} {'GMAC/s':>8}")
    for (isa, t), p in peaks.items():
        print(f"{p['isa']:>12} {t:>7} {p['per_thread_gmacs']:>16.1f} {p['total_gmacs']:>8.1f}")
    print(f"\nprefill (time to first token; first ms: a fresh process's first request) and batched decode at "
          f"{args.context} cached positions")
    print(f"{'':>8} {'isa':>12} {'threads':>7} {'size':>6} {'first ms':>9} {'ms':>9} {'tokens/s':>9} {'GMAC/s':>8} "
          f"{'of peak':>8}" + (f" {'llama.cpp ms':>12} {'x llama.cpp':>11}" if llama else ""))
    for row in rows:
        size = row.get("tokens", row.get("batch"))
        first = f"{row['first_ms']:>9.1f}" if "first_ms" in row else f"{'':>9}"
        print(f"{row['kind']:>8} {row['isa']:>12} {row['threads']:>7} {size:>6} {first} {row['ms']:>9.1f} "
              f"{row['tokens_per_s']:>9.1f} {row['gmacs']:>8.1f} {row['of_peak']:>8.1%}"
              + (f" {row['llama_cpp_ms']:>12.1f} {row['llama_cpp_over_ours']:>10.2f}x" if "llama_cpp_ms" in row else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
