"""Decode and prefill latency of the exported artifact against the eager reference and transformers.

    . .venv/bin/activate && python benchmarks/decode_latency.py [--json]

(from the repository root; the defaults are `--preset small --contexts 128,2048 --threads 1
--steps 20 --prefill-repeats 3 --prefill-budget 30 --moe-experts 16,384 --moe-steps 60
--work /tmp/k2deploy-bench`. The first run writes three checkpoints and exports them, about
40-60 s; later runs reuse them. A whole run then takes about 2.5-4 minutes on 2 shared AMD EPYC
cores, most of it the 2048-token prefills of the eager reference and transformers, so the
prefill repeats are capped by time (--prefill-budget). Raise --steps / --prefill-budget for
tighter medians, or pass --layers 2 to halve the model.)

Part 1, the whole model at batch 1, for each context length T (default 128 and 2048):
  ours       the exported artifact (ONNX Runtime, CPU, FP8 latent cache) through
             k2deploy.runtime (load_model + Generator), the way the server runs it;
  reference  the eager float32 PyTorch reference (k2deploy.export.reference, naive MLA,
             MoE that runs every expert densely, head over every prompt position at prefill);
  hf         Hugging Face transformers' DeepseekV3ForCausalLM (float32, eager attention and
             experts, its own DynamicCache, head over the last position only), built from the
             same checkpoint by k2deploy.export.hf_deepseek; skipped with a note when transformers is absent.
  prefill    time to first token: a prompt of T random token ids into an empty cache, to the
             argmax of the last position's logits. One untimed warm-up round per T
             (--prefill-warmup: the first 2048-token run of ONNX Runtime was measured up to 2x
             slower, its arena growing), then the median of up to --prefill-repeats (default 3)
             timed rounds, with no new round once that T's timed rounds have taken
             --prefill-budget seconds (default 30). A 2048-token prefill takes 5-20 s per backend
             here, so T=2048 gets one or two timed rounds and T=128 three; the table gives n.
  decode     one token into a cache holding exactly T tokens, to the argmax of its logits. After
             each timed step the cache is rolled back to T tokens (outside the timer), so every
             step is measured at context T; the fed tokens vary from step to step (they
             choose different experts) and are the same for all three. Median over --steps
             (default 20) after --warmup (default 3) untimed steps.
  The three run interleaved, step by step, in a rotating order, so that the machine's noise
  falls on all of them alike; ratios (reference/ours, hf/ours) are of the medians.
  torch and ONNX Runtime use the same number of intra-op threads, --threads, default 1. On a
  shared machine more threads than free cores make every parallel region wait for a
  descheduled partner thread: measured on this 2-core box under load, --threads 2 made every
  backend 2-10x slower and erratic (transformers' 128-token prefill 0.6-15 s from one run to the
  next, against a steady 0.2 s on one thread), and not evenly, so it distorted the ratios.
  Pass --threads 2 (or more) on a dedicated machine.

Part 2, one MoE decoder layer graph alone (`k2deploy export --layers 1:2`, FP8 cache) with the
preset's dimensions and 16 or 384 routed experts (--moe-experts), top-k unchanged: decode of
one token at context --moe-context (default 128), inputs bound with IOBinding as the runtime
binds them, cache filled with random FP8 latents, a different random hidden state each step.
The graphs run interleaved, step by step. The 384/16 ratio shows whether the decode cost
follows the k chosen experts or the expert count. The preset's own MoE layer (layer 1 of the
Part 1 artifact, 64 experts) is timed alongside as a third point.

Everything built lives under --work: checkpoints in WORK/checkpoints/NAME, artifacts in
WORK/artifacts/NAME (the name spells preset, layers, experts and seed); present ones are
reused when their config matches (a mismatched one is rebuilt).

Timings are wall clock (time.perf_counter) on a shared machine: absolute figures move from run
to run, the side-by-side ratios much less. Peak memory on `small`: about 6 GB (three models in
memory, float32 for the two torch ones, plus the 2048-token prefills' activations).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from k2deploy.bench.device import cpu_model
from k2deploy.core.targets import TARGETS


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summary(samples_s: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples_s)
    if not ms:
        return {}
    q = lambda p: ms[min(len(ms) - 1, round(p * (len(ms) - 1)))]  # noqa: E731
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "p10_ms": q(0.1), "p90_ms": q(0.9), "n": len(ms)}


# -- building the checkpoints and artifacts -------------------------------------------------------------


def ensure_checkpoint(work: Path, preset: str, layers: int | None, overrides: list[str], seed: int):
    from k2deploy.core.checkpoint.presets import SHARD_BYTES, preset_config
    from k2deploy.core.checkpoint.reader import Checkpoint
    from k2deploy.core.checkpoint.synthetic import write_checkpoint

    config = preset_config(preset, layers=layers, overrides=overrides)
    name = f"{preset}-L{config.num_hidden_layers}-e{config.n_routed_experts}-h{config.num_attention_heads}-seed{seed}"
    path = work / "checkpoints" / name
    if path.exists():
        try:
            with Checkpoint.open(path) as existing:
                if existing.config == config:
                    log(f"reusing checkpoint {path}")
                    return path, config
        except Exception as error:  # unreadable: rebuild
            log(f"{path}: {error}")
        log(f"{path} does not match the requested config; rewriting it")
    log(f"writing checkpoint {path}")
    started = time.perf_counter()
    write_checkpoint(path, config, seed=seed, shard_bytes=SHARD_BYTES.get(preset, 1 << 28), force=True)
    log(f"  written in {time.perf_counter() - started:.1f} s")
    return path, config


def ensure_artifact(work: Path, checkpoint: Path, config, layers: tuple[int, int] | None, target: str) -> Path:
    from k2deploy.export.exporter import ExportOptions, export_artifact
    from k2deploy.export.passes import weight_layout
    from k2deploy.core.manifest import MANIFEST_FILE

    cache = TARGETS[target].default_cache
    suffix = "" if layers is None else f"-layers{layers[0]}_{layers[1]}"
    out = work / "artifacts" / f"{checkpoint.name}-{target}-{cache}{suffix}"
    manifest = out / MANIFEST_FILE
    if manifest.exists():
        data = json.loads(manifest.read_text())
        expected_range = list(layers or (0, config.num_hidden_layers))
        index = checkpoint / "model.safetensors.index.json"
        same_weights = (index.exists() and (data.get("checkpoint") or {}).get("index_sha256")
                        == hashlib.sha256(index.read_bytes()).hexdigest())
        if (same_weights and data.get("model_config") == config.to_dict()
                and data.get("kv_cache", {}).get("format") == cache and data.get("target") == target
                and data.get("weight_layout") == weight_layout(target)
                and data.get("graphs", {}).get("layer_range") == expected_range):
            log(f"reusing artifact {out}")
            return out
        log(f"{out} does not match; exporting again")
    log(f"exporting {checkpoint.name} (layers {layers or 'all'}) to {out}")
    started = time.perf_counter()
    export_artifact(ExportOptions(str(checkpoint), kv_cache=cache, layers=layers, target=target), out, force=True)
    log(f"  exported in {time.perf_counter() - started:.1f} s")
    return out


# -- Part 1: the whole model -----------------------------------------------------------------------------


class Timed:
    """A backend's prefill or decode call, timed where it runs."""

    def timed(self, op: str, arg) -> tuple[int, float]:
        started = time.perf_counter()
        token = getattr(self, op)(arg)
        return token, time.perf_counter() - started


def _serve_ours(conn, artifact: str, threads: int) -> None:
    """A child process's loop: the artifact on a pool of `threads` (one pool per process, so one child per thread
    count); each request is timed here, so the pipe's latency is not in the figures."""
    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.engine.generator import Generator
    from k2deploy.runtime.backends.native.choice import load_model

    model = load_model(load_manifest(artifact), threads=threads)
    gen = Generator(model)
    cache, context = None, 0
    conn.send(model.threads)
    while True:
        op, arg = conn.recv()
        started = time.perf_counter()
        if op == "prefill":
            cache = model.new_cache(1, len(arg) + 1)
            token = int(gen.prefill([arg], cache)[0].argmax())
            context = len(arg)
        elif op == "decode":
            token = int(gen.decode(np.array([arg], dtype=np.int64), np.array([True]), cache)[0].argmax())
        elif op == "rollback":
            cache.lengths[:] = context  # the slot past T is simply overwritten by the next step
            token = None
        elif op == "stages":
            token = dict(model.stage_seconds)
            if arg:
                model.stage_seconds.clear()
        else:
            return
        conn.send((token, time.perf_counter() - started))


class OursBackend:
    """The exported artifact (load_model + Generator, the way the server runs it) in a child process of its own, on
    an intra-op pool of `threads`: a process has one pool, so each thread count runs in its own process."""

    def __init__(self, artifact: Path, threads: int, name: str = "ours"):
        import multiprocessing

        self.name = name
        self.threads = threads
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve_ours, args=(child, str(artifact), threads), daemon=True)
        self.process.start()
        self.pool_threads = self.conn.recv()

    def _call(self, op: str, arg=None):
        self.conn.send((op, arg))
        return self.conn.recv()

    def timed(self, op: str, arg) -> tuple[int, float]:
        return self._call(op, arg)

    def rollback(self) -> None:
        self._call("rollback")

    def stage_seconds(self, clear: bool = False) -> dict[str, float]:
        return self._call("stages", clear)[0]

    def close(self) -> None:
        self.conn.send(("close", None))
        self.process.join(timeout=10)


class ReferenceBackend(Timed):
    name = "reference"

    def __init__(self, checkpoint: Path):
        import torch

        from k2deploy.core.checkpoint.reader import Checkpoint
        from k2deploy.export import reference
        from k2deploy.export.weights import load_transformer

        self.torch, self.reference = torch, reference
        with Checkpoint.open(checkpoint) as ckpt:
            self.model = load_transformer(ckpt)
        self.cache = None
        self.context = 0

    def prefill(self, prompt: list[int]) -> int:
        with self.torch.inference_mode():
            self.cache = self.reference.LatentCache(self.model, 1)
            logits = self.reference.forward(self.model, self.torch.tensor([prompt]), self.cache)
            self.context = len(prompt)
            return int(logits[0, -1].argmax())

    def decode(self, token: int) -> int:
        with self.torch.inference_mode():
            logits = self.reference.forward(self.model, self.torch.tensor([[token]]), self.cache)
            return int(logits[0, -1].argmax())

    def rollback(self) -> None:
        self.cache.latent = [t[:, : self.context] for t in self.cache.latent]
        self.cache.rope = [t[:, : self.context] for t in self.cache.rope]


class HfBackend(Timed):
    name = "hf"

    def __init__(self, checkpoint: Path):
        import torch
        from transformers import DynamicCache

        from k2deploy.core.checkpoint.reader import Checkpoint
        from k2deploy.export.hf_deepseek import build_hf_model

        self.torch, self.DynamicCache = torch, DynamicCache
        with Checkpoint.open(checkpoint) as ckpt:
            self.model = build_hf_model(ckpt)
        self.cache = None
        self.context = 0

    def prefill(self, prompt: list[int]) -> int:
        with self.torch.inference_mode():
            self.cache = self.DynamicCache(config=self.model.config)
            out = self.model(self.torch.tensor([prompt]), cache=self.cache, use_cache=True, logits_to_keep=1)
            self.context = len(prompt)
            return int(out.logits[0, -1].argmax())

    def decode(self, token: int) -> int:
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([[token]]), cache=self.cache, use_cache=True, logits_to_keep=1)
            return int(out.logits[0, -1].argmax())

    def rollback(self) -> None:
        extra = self.cache.get_seq_length() - self.context
        if extra:
            self.cache.crop(-extra)  # transformers 5: a negative count of tokens to drop


def bench_model(backends: list, contexts: list[int], vocab: int, args) -> dict:
    rng = np.random.default_rng(args.seed)
    results = {}
    ours = next((b for b in backends if b.name == "ours"), None)
    ours_all = [b for b in backends if isinstance(b, OursBackend)]
    for context in contexts:
        prompt = rng.integers(0, vocab, size=context).tolist()
        feed = rng.integers(0, vocab, size=args.warmup + args.steps).tolist()
        warmup = args.prefill_warmup  # per context: ONNX Runtime's arena grows on the first run of a larger shape
        prefill_runs = warmup + args.prefill_repeats
        # prefill, interleaved; the last one leaves each backend's cache holding the prompt
        prefill = {b.name: [] for b in backends}
        first_tokens = {}
        timed_seconds = 0.0
        for run in range(prefill_runs):
            if run > warmup and timed_seconds >= args.prefill_budget:
                break  # enough: one more round of long prefills would add little but minutes
            order = backends[run % len(backends):] + backends[: run % len(backends)]
            seen = {}
            for backend in order:  # each prefill starts from an empty cache of its own
                gc.collect()
                first_tokens[backend.name], elapsed = backend.timed("prefill", prompt)
                seen[backend.name] = elapsed
                if run >= warmup:
                    prefill[backend.name].append(elapsed)
                    timed_seconds += elapsed
            log(f"  T={context} prefill run {run + 1}/{prefill_runs}{' (warm-up)' if run < warmup else ''}: "
                + ", ".join(f"{name} {seen[name] * 1e3:.0f} ms" for name in (b.name for b in backends)))
        # decode at exactly T cached tokens, interleaved
        decode = {b.name: [] for b in backends}
        agree = {b.name: 0 for b in backends}
        for step, token in enumerate(feed):
            order = backends[step % len(backends):] + backends[: step % len(backends)]
            picks = {}
            for backend in order:
                picks[backend.name], elapsed = backend.timed("decode", token)
                backend.rollback()
                if step >= args.warmup:
                    decode[backend.name].append(elapsed)
                if step == args.warmup - 1 and backend in ours_all:
                    backend.stage_seconds(clear=True)  # count the timed steps only
            if step >= args.warmup and ours is not None:
                for name, pick in picks.items():
                    agree[name] += pick == picks["ours"]
        entry = {"context": context, "prefill": {}, "decode": {}, "first_token": first_tokens}
        for backend in backends:
            entry["prefill"][backend.name] = summary(prefill[backend.name])
            entry["decode"][backend.name] = summary(decode[backend.name])
        if ours is not None:
            for backend in backends:
                if backend is ours:
                    continue
                for part in ("prefill", "decode"):
                    mine = prefill if part == "prefill" else decode
                    theirs = mine[backend.name]
                    entry[part][f"{backend.name}/ours"] = (statistics.median(theirs) / statistics.median(mine["ours"]))
                    # the same ratio taken step by step (each pair ran back to back), then its median
                    entry[part][f"{backend.name}/ours_paired_median"] = statistics.median(
                        t / o for t, o in zip(theirs, mine["ours"]))
                entry["decode"][f"{backend.name}_argmax_agreement_with_ours"] = agree[backend.name] / args.steps
            steps = max(len(decode["ours"]), 1)
            for backend in ours_all:
                entry[f"{backend.name}_decode_stage_ms"] = {stage: round(seconds * 1e3 / steps, 3)
                                                            for stage, seconds in sorted(backend.stage_seconds().items())}
            if len(ours_all) > 1:  # the thread counts side by side: time at the first count over time at each
                entry["thread_scaling"] = {
                    str(b.threads): {part: statistics.median(times["ours"]) / statistics.median(times[b.name])
                                     for part, times in (("decode", decode), ("prefill", prefill))}
                    for b in ours_all}
        results[str(context)] = entry
        log(f"  T={context} decode median: "
            + ", ".join(f"{b.name} {entry['decode'][b.name]['median_ms']:.2f} ms" for b in backends))
    return results


# -- Part 2: one MoE layer graph -------------------------------------------------------------------------


class LayerGraph:
    """One exported decoder layer, run alone at batch 1 over a random latent cache of `context` tokens in the
    artifact's cache format, bound the way the runtime binds it."""

    def __init__(self, onnx_path: Path, kv_cache: dict, context: int, threads: int, seed: int):
        import onnxruntime as ort

        from k2deploy.core.cache_format import PAGE_SIZE
        from k2deploy.runtime.backends.onnx.host_pages import LatentPages
        from k2deploy.runtime.backends.onnx.thread_pool import session_options

        self.ort = ort
        self.session = ort.InferenceSession(str(onnx_path), session_options(threads), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(seed)
        pages = -(-(context + 1) // PAGE_SIZE)
        store = LatentPages(kv_cache, 1, pages)
        latent = store.arrays["latent"]
        codes = rng.integers(28, 228, latent.shape) if store.format.name == "int8" else \
            rng.integers(0, 1 << (8 * latent.itemsize), latent.shape) & 0x3F3F
        latent[:] = codes.astype(latent.dtype)  # finite codes of every format
        store.arrays["rope"][:] = rng.standard_normal(store.arrays["rope"].shape).astype(np.float16)
        if "latent_scale" in store.arrays:
            store.arrays["latent_scale"][:] = 1 / 100
        self.cache = store.view(np.arange(pages)[None])  # one row holding every page
        self.context = context
        self.positions = np.array([[context]], dtype=np.int64)

    def step(self, hidden: np.ndarray) -> float:
        started = time.perf_counter()
        binding = self.session.io_binding()
        binding.bind_cpu_input("hidden", hidden)
        binding.bind_cpu_input("positions", self.positions)
        new_entries = self.cache.new_entries(self.positions)
        for name, value in self.cache.past_inputs(0).items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output("hidden_out", self.ort.OrtValue.ortvalue_from_numpy(np.empty_like(hidden)))
        for name, value in new_entries.items():
            binding.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(binding)
        return time.perf_counter() - started


def bench_moe_layers(graphs: dict[str, tuple[Path, object]], args) -> dict:
    rng = np.random.default_rng(args.seed + 1)
    any_config = next(iter(graphs.values()))[1]
    hiddens = rng.standard_normal((args.moe_warmup + args.moe_steps, 1, 1, any_config.hidden_size)).astype(np.float32)
    runners = {}
    for label, (path, config) in graphs.items():
        started = time.perf_counter()
        kv_cache = json.loads((path.parents[1] / "manifest.json").read_text())["kv_cache"]
        runners[label] = LayerGraph(path, kv_cache, args.moe_context, args.thread_list[0], args.seed)
        log(f"  session for {label} experts loaded in {time.perf_counter() - started:.1f} s")
    labels = list(runners)
    times = {label: [] for label in labels}
    for step, hidden in enumerate(hiddens):
        order = labels[step % len(labels):] + labels[: step % len(labels)]
        for label in order:
            elapsed = runners[label].step(hidden)
            if step >= args.moe_warmup:
                times[label].append(elapsed)
    result = {"context": args.moe_context, "layers": {}}
    for label in labels:
        path, config = graphs[label]
        data = path.with_suffix(".data")
        result["layers"][label] = {
            "n_routed_experts": config.n_routed_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "graph_weight_bytes": data.stat().st_size if data.exists() else None,
            **summary(times[label]),
        }
    small, large = (str(e) for e in (min(args.moe_experts), max(args.moe_experts)))
    if small in times and large in times and small != large:
        result["ratio"] = {
            "experts": f"{large}/{small}",
            "expert_count_ratio": int(large) / int(small),
            "weight_bytes_ratio": result["layers"][large]["graph_weight_bytes"] / result["layers"][small]["graph_weight_bytes"],
            "decode_ms_ratio": statistics.median(times[large]) / statistics.median(times[small]),
            "decode_ms_ratio_paired_median": statistics.median(a / b for a, b in zip(times[large], times[small])),
            "decode_p10_ratio": result["layers"][large]["p10_ms"] / result["layers"][small]["p10_ms"],
        }
    del runners
    gc.collect()
    return result


# -- the bandwidth bound and the runtime's memory ----------------------------------------------------------


def bandwidth_bound(config, artifact: Path, contexts: list[int], model: dict) -> dict:
    """Bytes one decode step must read (k2deploy.core.bound: FP8 at one byte per weight, BF16 head and
    embedding at two, the cache at the artifact's bytes per token) over the copy bandwidth measured now."""
    from k2deploy.bench import bandwidth
    from k2deploy.core.bound import decode_step_bytes

    log("measuring the memory bandwidth (numpy copy, child process)")
    gbps = statistics.median(bandwidth.measure_in_child())
    per_token_layer = json.loads((artifact / "manifest.json").read_text())["kv_cache"]["bytes_per_token_per_layer"]
    rows = {}
    for context in contexts:
        step = decode_step_bytes(config, per_token_layer, 1, context)
        bound_ms = step["total"] / (gbps * 1e9) * 1e3
        ours = (model.get(context) or model.get(str(context)) or {}).get("decode", {}).get("ours", {})
        rows[context] = {"bytes": step["total"], "bound_ms": bound_ms,
                         "ours/bound": ours["median_ms"] / bound_ms if ours else None}
    return {"bandwidth_gbps": gbps, "method": bandwidth.METHOD, "contexts": rows}


def generate_memory(artifact: Path, threads: int, prompt_len: int = 128, new_tokens: int = 32) -> dict:
    """Peak resident memory of `k2deploy generate` on the artifact in a child process (what /usr/bin/time -v
    reports as its maximum resident set), against 1.3 x (weight bytes + cache bytes) + 200 MB; and the most threads
    the process held (its /proc status, read every 5 ms)."""
    import shutil
    import subprocess
    import tempfile

    from k2deploy.core.manifest import load_manifest
    from k2deploy.core.cache_format import PAGE_SIZE
    from k2deploy.runtime.backends.onnx.host_pages import LatentPages

    manifest = load_manifest(artifact, verify_hashes=False)
    weights = sum(r["bytes"] for f, r in manifest.data["files"].items() if f.endswith(".data"))
    # the native decode step (a cpu artifact with the int8 cache) reads the layer and head weight files into memory
    # of its own, beside ONNX Runtime's copy
    native = manifest.data.get("target") == "cpu" and manifest.kv_cache.get("format") == "int8"
    mapped = sum(r["bytes"] for f, r in manifest.data["files"].items()
                 if native and f.endswith(".data") and not f.endswith("embed.data"))
    pages = -(-(prompt_len + new_tokens) // PAGE_SIZE)
    cache = LatentPages(manifest.kv_cache, manifest.config.num_hidden_layers, pages).nbytes
    prompt = ",".join(str(i % 1000 + 1) for i in range(prompt_len))
    command = [sys.executable, "-m", "k2deploy", "generate",
               str(artifact), "--prompt-ids", prompt, "--max-new-tokens", str(new_tokens), "--threads", str(threads),
               "--json"]
    timer = shutil.which("time", path="/usr/bin")  # GNU time: the child's own maximum resident set
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen(([timer, "-v"] if timer else []) + command, stdout=subprocess.DEVNULL, stderr=errors)
        threads_held = _most_threads(child.pid, timer is not None)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        errors.seek(0)
        message = errors.read().decode(errors="replace").strip()
    if child.returncode != 0:
        return {"error": message.splitlines()[-1] if message else f"exit {child.returncode}"}
    reported = [line for line in message.splitlines() if "Maximum resident set size" in line]
    # without GNU time, wait4's figure also counts the pages the child shared with this process before exec
    usage_kb = int(reported[0].rsplit(":", 1)[1]) if reported else usage.ru_maxrss
    peak = usage_kb * 1024
    bound = 1.3 * (weights + cache) + mapped + 200e6
    return {"command": f"k2deploy generate ART --prompt-ids <{prompt_len} ids> --max-new-tokens {new_tokens} "
                       f"--threads {threads}", "threads_held": threads_held, "peak_rss_bytes": peak, "weight_bytes": weights, "cache_bytes": cache,
            "mapped_bytes": mapped, "bound_bytes": bound, "within_bound": peak <= bound,
            "measured_by": "/usr/bin/time -v" if reported else "wait4 rusage (an upper bound: it counts pages shared "
                                                                 "with the benchmark process before exec)"}


def _most_threads(pid: int, under_time: bool) -> int:
    """The most threads the process (or, under GNU time, its one child) held until it exited."""
    most = 0
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return most  # exited, not yet waited for
            target = pid
            if under_time:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                if not children:
                    time.sleep(0.005)
                    continue
                target = int(children[0])
            status = Path(f"/proc/{target}/status").read_text()
        except (OSError, ValueError, IndexError):
            return most
        most = max(most, int(status.split("Threads:", 1)[1].split()[0]))
        time.sleep(0.005)


# -- output ----------------------------------------------------------------------------------------------


def print_table(report: dict) -> None:
    meta = report["setup"]
    print(f"k2deploy decode latency  preset={meta['preset']} layers={meta['layers']} experts={meta['n_routed_experts']} "
          f"top-k={meta['num_experts_per_tok']}  batch 1  threads={meta['threads']} (ORT intra-op = torch)")
    print(f"machine: {meta['cpu']}, {meta['cpus']} CPUs;  onnxruntime {meta['versions']['onnxruntime']}, "
          f"torch {meta['versions']['torch'] or 'not used'}, transformers {meta['versions']['transformers'] or 'not used'}")
    print(f"decode: median of {meta['steps']} steps after {meta['warmup']} warm-up, each at exactly T cached tokens; "
          f"prefill (TTFT): median of n <= {meta['prefill_repeats']} after {meta['prefill_warmup']} warm-up")
    for note in report["notes"]:
        print(f"note: {note}")
    model = report.get("model")
    if model:
        first = next(iter(model.values()))["decode"]
        names = [n for n, v in first.items() if isinstance(v, dict) and "median_ms" in v]
        print()
        print(f"Whole model (ours = the artifact lowered for --target {meta.get('target', 'cpu')}, ONNX Runtime, "
              f"{meta['threads'][0]} thread{'s' * (meta['threads'][0] > 1)}; ours_Nt: on N threads)")
        header = f"{'T':>6} {'':12}" + "".join(f"{n + ' ms':>14}" for n in names)
        ratios = [n for n in names if n in ("reference", "hf")]
        header += "".join(f"{n + '/ours':>16}" for n in ratios)
        print(header)
        for context, entry in model.items():
            for part in ("decode", "prefill"):
                label = "decode/tok" if part == "decode" else f"prefill n={entry['prefill']['ours']['n']}"
                row = f"{context:>6} {label:<12}"
                row += "".join(f"{entry[part][n]['median_ms']:>14.2f}" for n in names)
                row += "".join(f"{entry[part][n + '/ours']:>15.2f}x" for n in ratios)
                print(row)
        scaling = [(context, entry["thread_scaling"]) for context, entry in model.items() if "thread_scaling" in entry]
        if scaling:
            print(f"thread scaling (time on {meta['threads'][0]} over time on N, same run):")
            for context, by_threads in scaling:
                print(f"  T={context}: " + "; ".join(f"{n} threads decode {r['decode']:.2f}x, prefill {r['prefill']:.2f}x"
                                                   for n, r in by_threads.items() if int(n) != meta["threads"][0]))
        stage_lines = []
        for context, entry in model.items():
            for name in (n for n in names if n.startswith("ours")):
                stages = entry.get(f"{name}_decode_stage_ms")
                if not stages:
                    continue
                layers = sum(v for k, v in stages.items() if k.startswith("layer_"))
                per_layer = " ".join(f"{v:.2f}" for k, v in stages.items() if k.startswith("layer_"))
                if "native_step" in stages:  # the native decode step: the embedding and every layer in one call
                    stage_lines.append(f"  {name} T={context}: native step (embedding and layers) "
                                       f"{stages['native_step']:.2f}, head {stages.get('head', 0):.2f} ms/token")
                    continue
                stage_lines.append(f"  {name} T={context}: embed {stages.get('embed', 0):.2f}, layers {layers:.2f} "
                                   f"[{per_layer}], head {stages.get('head', 0):.2f} ms/token")
        if stage_lines:
            print("ours, decode time by stage (layer 0 dense, the rest MoE):")
            print("\n".join(stage_lines))
        for context, entry in model.items():
            agreement = {k.removesuffix("_argmax_agreement_with_ours"): v for k, v in entry["decode"].items()
                         if k.endswith("agreement_with_ours")}
            if agreement:
                print(f"  T={context}: decode argmax agreement with ours: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in agreement.items()))
    moe = report.get("moe_layer")
    if moe:
        print()
        print(f"One MoE layer graph alone (ONNX Runtime, --target {meta.get('target', 'cpu')}), decode at T={moe['context']}, "
              f"median of {meta['moe_steps']} steps after {meta['moe_warmup']} warm-up")
        print(f"{'experts':>8} {'top-k':>6} {'weights MB':>11} {'ms/token':>10} {'p10':>8} {'p90':>8}")
        for label, row in moe["layers"].items():
            print(f"{label:>8} {row['num_experts_per_tok']:>6} {row['graph_weight_bytes'] / 1e6:>11.1f} "
                  f"{row['median_ms']:>10.3f} {row['p10_ms']:>8.3f} {row['p90_ms']:>8.3f}")
        ratio = moe.get("ratio")
        if ratio:
            print(f"{ratio['experts']}: {ratio['expert_count_ratio']:.0f}x the experts, "
                  f"{ratio['weight_bytes_ratio']:.1f}x the layer's weight bytes, "
                  f"{ratio['decode_ms_ratio']:.2f}x the decode time "
                  f"(paired per-step median {ratio['decode_ms_ratio_paired_median']:.2f}x, "
                  f"p10 {ratio['decode_p10_ratio']:.2f}x)")
    bound = report.get("bound")
    if bound:
        print()
        print(f"bandwidth bound: {bound['bandwidth_gbps']:.1f} GB/s measured ({bound['method']})")
        for context, row in bound["contexts"].items():
            ratio = f", ours {row['ours/bound']:.2f}x the bound" if row["ours/bound"] else ""
            print(f"  T={context}: {row['bytes'] / 1e6:.1f} MB per decode step -> {row['bound_ms']:.2f} ms{ratio}")
    for threads, memory in report.get("generate_memory", {}).items():
        if "error" in memory:
            print(f"generate memory ({threads} threads): failed ({memory['error']})")
        else:
            mapped = memory.get("mapped_bytes", 0)
            print(f"peak RSS of `{memory['command']}`: {memory['peak_rss_bytes'] / 1e6:.0f} MB; bound 1.3 x (weights "
                  f"{memory['weight_bytes'] / 1e6:.0f} MB + cache {memory['cache_bytes'] / 1e6:.1f} MB) + 200 MB"
                  + (f" + {mapped / 1e6:.0f} MB of weights the native decode step holds" if mapped else "") + " = "
                  f"{memory['bound_bytes'] / 1e6:.0f} MB ({'within' if memory['within_bound'] else 'OVER'}); "
                  f"{memory['threads_held']} threads held at most")
    print()
    print(f"wall time {report['wall_seconds']:.0f} s (build {report['build_seconds']:.0f} s), "
          f"peak RSS {report['peak_rss_mb']:.0f} MB")


# -- main ------------------------------------------------------------------------------------------------


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="checkpoint preset (default: small)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of the Part 1 model (default: the preset's, 4 for small: 1 dense + 3 MoE)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the Part 1 model, e.g. --set num_attention_heads=16 (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="checkpoint weights and prompt seed (default 0)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/k2deploy-bench"),
                        help="where checkpoints and artifacts are written and reused (default /tmp/k2deploy-bench)")
    parser.add_argument("--contexts", default="128,2048", help="context lengths T, comma-separated (default 128,2048)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per context and backend (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first, per context (default 3)")
    parser.add_argument("--prefill-repeats", type=int, default=3,
                        help="at most this many timed prefills per context and backend (default 3)")
    parser.add_argument("--prefill-budget", type=float, default=30.0,
                        help="no further prefill round once a context's timed prefills (all backends) have taken "
                             "this many seconds (default 30)")
    parser.add_argument("--prefill-warmup", type=int, default=1,
                        help="untimed prefills before the timed ones, per context (default 1)")
    parser.add_argument("--threads", default="1",
                        help="thread counts of ours, comma-separated, each a process with one intra-op pool of that "
                             "size, timed side by side (e.g. 1,2); torch (reference, hf) and Part 2 use the first "
                             f"(default 1: steady on a shared machine; this one has {available_cpus()} CPUs)")
    parser.add_argument("--no-reference", action="store_true", help="skip the eager reference")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--moe-experts", default="16,384",
                        help="routed-expert counts of the Part 2 single-layer graphs (default 16,384; empty: skip Part 2)")
    parser.add_argument("--moe-context", type=int, default=128, help="context of the Part 2 decode steps (default 128)")
    parser.add_argument("--moe-steps", type=int, default=60, help="timed steps per Part 2 graph (default 60)")
    parser.add_argument("--moe-warmup", type=int, default=5, help="untimed steps per Part 2 graph first (default 5)")
    parser.add_argument("--skip-model", action="store_true", help="skip Part 1 (the whole-model comparison)")
    parser.add_argument("--target", choices=list(TARGETS), default="cpu",
                        help="the lowering of `ours` (default cpu: int8 weights and cache; cuda: the exact FP8 graph)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = parser.parse_args(argv)
    args.context_list = [int(x) for x in args.contexts.split(",") if x.strip()]
    args.moe_experts = [int(x) for x in args.moe_experts.split(",") if x.strip()]
    try:
        args.thread_list = list(dict.fromkeys(int(x) for x in args.threads.split(",") if x.strip()))
    except ValueError:
        parser.error(f"--threads {args.threads}: give thread counts separated by commas, e.g. 1,2")
    if not args.thread_list or min(args.thread_list) < 1:
        parser.error("--threads: give at least one thread count, each at least 1")
    if args.steps < 1 or args.prefill_repeats < 1 or args.moe_steps < 1:
        parser.error("--steps, --prefill-repeats and --moe-steps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    import onnxruntime

    from k2deploy.core.checkpoint.presets import preset_config

    notes = []
    load_at_start = os.getloadavg()[0]
    if load_at_start > available_cpus() / 2:
        notes.append(f"load average {load_at_start:.1f} on {available_cpus()} CPUs at the start: other processes "
                     f"compete for the cores, expect run-to-run spread in absolute times")
    torch = None
    if not (args.no_reference and args.no_hf) and not args.skip_model:
        import torch

        torch.set_num_threads(args.thread_list[0])
    have_hf = importlib.util.find_spec("transformers") is not None
    if not have_hf and not args.no_hf:
        notes.append("transformers is not installed: the hf column is skipped")
    want_hf = have_hf and not args.no_hf and not args.skip_model

    args.work.mkdir(parents=True, exist_ok=True)
    config = preset_config(args.preset, layers=args.layers, overrides=args.set)
    for context in args.context_list:
        if context + 1 > config.max_position_embeddings:
            raise SystemExit(f"context {context} exceeds the model's {config.max_position_embeddings} positions")
    # build (or reuse) everything first
    model_ckpt = model_art = None
    if not args.skip_model or args.moe_experts:
        model_ckpt, config = ensure_checkpoint(args.work, args.preset, args.layers, args.set, args.seed)
        model_art = ensure_artifact(args.work, model_ckpt, config, None, args.target)
    moe_graphs = {}
    if args.moe_experts:
        if config.num_hidden_layers < 2 or not config.is_moe_layer(1):
            raise SystemExit("Part 2 needs layer 1 to be an MoE layer")
        for experts in sorted(set(args.moe_experts)):
            if experts == config.n_routed_experts:
                moe_graphs[str(experts)] = (model_art / "graphs" / "layer_001.onnx", config)
                continue
            ckpt, moe_config = ensure_checkpoint(args.work, args.preset, 2, [f"n_routed_experts={experts}"], args.seed)
            art = ensure_artifact(args.work, ckpt, moe_config, (1, 2), args.target)
            moe_graphs[str(experts)] = (art / "graphs" / "layer_001.onnx", moe_config)
        if str(config.n_routed_experts) not in moe_graphs:  # the preset's own MoE layer, a third point
            moe_graphs[str(config.n_routed_experts)] = (model_art / "graphs" / "layer_001.onnx", config)
        moe_graphs = dict(sorted(moe_graphs.items(), key=lambda kv: int(kv[0])))
    build_seconds = time.perf_counter() - started

    report = {
        "setup": {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "preset": args.preset, "overrides": args.set, "layers": config.num_hidden_layers, "n_routed_experts": config.n_routed_experts,
            "num_experts_per_tok": config.num_experts_per_tok, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "target": args.target, "batch": 1, "threads": args.thread_list,
            "contexts": args.context_list, "steps": args.steps, "warmup": args.warmup,
            "prefill_repeats": args.prefill_repeats, "prefill_warmup": args.prefill_warmup,
            "prefill_budget_s": args.prefill_budget,
            "moe_steps": args.moe_steps, "moe_warmup": args.moe_warmup,
            "cpu": cpu_model(), "cpus": available_cpus(), "load_average_at_start": round(load_at_start, 2),
            "work": str(args.work),
            "checkpoint": str(model_ckpt) if model_ckpt else None, "artifact": str(model_art) if model_art else None,
            "versions": {"python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
                         "torch": torch.__version__ if torch else None,
                         "transformers": importlib.import_module("transformers").__version__ if want_hf else None,
                         "numpy": np.__version__},
        },
        "notes": notes,
    }

    if args.moe_experts:
        log(f"Part 2: one MoE layer graph with {', '.join(moe_graphs)} experts at T={args.moe_context}")
        report["moe_layer"] = bench_moe_layers(moe_graphs, args)

    if not args.skip_model:
        log("Part 1: loading the backends")
        backends = [OursBackend(model_art, n, "ours" if i == 0 else f"ours_{n}t") for i, n in enumerate(args.thread_list)]
        if not args.no_reference:
            t0 = time.perf_counter()
            backends.append(ReferenceBackend(model_ckpt))
            log(f"  reference loaded in {time.perf_counter() - t0:.1f} s")
        if want_hf:
            t0 = time.perf_counter()
            try:
                backends.append(HfBackend(model_ckpt))
                log(f"  transformers model built in {time.perf_counter() - t0:.1f} s")
            except Exception as error:  # an incompatible transformers: report, keep the rest
                notes.append(f"transformers model could not be built ({type(error).__name__}: {error}); hf skipped")
        gc.collect()
        log(f"Part 1: {', '.join(b.name for b in backends)} at T = {args.contexts}")
        report["model"] = bench_model(backends, args.context_list, config.vocab_size, args)
        for backend in backends:
            if isinstance(backend, OursBackend):
                backend.close()
        del backends
        gc.collect()

    if not args.skip_model:
        report["generate_memory"] = {str(n): generate_memory(model_art, n) for n in args.thread_list}
        report["bound"] = bandwidth_bound(config, model_art, args.context_list, report.get("model", {}))

    report["build_seconds"] = build_seconds
    report["wall_seconds"] = time.perf_counter() - started
    report["peak_rss_mb"] = peak_rss_mb()
    report["setup"]["load_average_at_end"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(report, indent=2, default=float))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
