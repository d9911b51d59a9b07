"""`k2deploy bench ART`: warm-up, then repeated runs of every (batch, prompt length) cell, ours
and the baseline interleaved, into one result document (see schema.py for its fields).

One run of a cell: `batch` random prompts of `prompt_len` tokens prefilled into an empty cache,
the first token sampled (time to first token), then `gen_len - 1` decode steps of one token per
row, each timed from the call into the runtime to the sampled tokens (greedy, the runtime's
sampling function). During each decode step OrtModel.stage_seconds collects the time of each
session (embedding, every layer, head); the sampling is timed here; the runtime's overhead
between sessions is the step's wall time less both. Each run gives one sample of every figure
(time per output token: the run's mean decode step; the stages: their mean per step), and the
medians and p90s are over the runs. Warm-up runs (prefill and 2 decode steps) come first and
are not kept.

Runs go pass by pass over all cells (warm-up passes first), and within a cell the baseline
(baseline.py, a child process) runs right beside ours, in alternating order (ours first, then
it first): a burst of load from elsewhere falls on one run of each cell and on both sides alike;
the ratios of the two are the figures that travel between machines. The memory bandwidth is
measured (bandwidth.py) before the first and after the last run.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import numpy as np

from ..core.errors import K2Error
from ..runtime.backends.onnx.thread_pool import default_threads
from ..runtime.engine.config import EngineConfig, resolve_engine_config
from ..core.targets import GPU_PROVIDERS, artifact_target
from . import bandwidth as bw
from .baseline import (KINDS, BaselineProcess, current_rss_bytes, peak_rss_bytes, prompts, reset_peak_rss,
                       unavailable)
from ..core.bound import decode_step_bytes
from .device import describe_device, gpu_memory_used
from .schema import SCHEMA_NAME, SCHEMA_VERSION
from .stats import ratio, summarize


WARMUP_GEN_LEN = 3  # a warm-up run: prefill and two decode steps


@dataclass
class BenchOptions:
    artifact: str
    batches: list[int] = field(default_factory=lambda: [1, 4])
    prompt_lens: list[int] = field(default_factory=lambda: [128, 512])
    gen_len: int = 8
    provider: str = "cpu"
    backend: str = "onnxruntime"
    placement: str | None = None  # pipeline stages ("auto" or ranges), in this process or on Ray
    ray: str | None = None  # a Ray address ("auto" or HOST:PORT): the stages run on Ray actors
    threads: int | None = None  # the intra-op thread pool (and torch's); None: this host's physical cores
    decode: str = "auto"  # one sequence's decode step: native, onnx or auto (runtime/backends/onnx/model.py)
    speculative: str = "auto"  # drafted tokens checked where they pay, or off (runtime/engine/speculation.py)
    baseline: str | None = None  # "eager", "hf", "none"; None: eager where it can run
    repeats: int = 3
    warmup: int = 1
    seed: int = 0
    bandwidth_bytes: int = bw.DEFAULT_BYTES
    bandwidth_repeats: int = bw.DEFAULT_REPEATS
    verify_hashes: bool = True
    command: str = ""

    def check(self, max_positions: int) -> None:
        if not self.batches or min(self.batches) < 1:
            raise K2Error(f"--batch {self.batches}: every batch size must be at least 1")
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise K2Error(f"--prompt-len {self.prompt_lens}: every prompt length must be at least 1")
        if self.gen_len < 2:
            raise K2Error(f"--gen-len {self.gen_len}: at least 2 (the first token, then one decode step)")
        if self.repeats < 1 or self.warmup < 0:
            raise K2Error(f"--repeats must be at least 1 and --warmup at least 0 (got {self.repeats}, {self.warmup})")
        if self.baseline not in (None, "none", *KINDS):
            raise K2Error(f"--baseline {self.baseline!r}: choose eager, hf or none")
        longest = max(self.prompt_lens) + self.gen_len
        if longest > max_positions:
            raise K2Error(f"prompt length {max(self.prompt_lens)} plus --gen-len {self.gen_len} exceeds the model's "
                          f"{max_positions} positions")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _resolve_baseline(options: BenchOptions, manifest, notes: list[str]) -> tuple[str | None, Path | None]:
    """(kind, checkpoint) of the baseline to run, or (None, None) with the reason in notes."""
    if options.baseline == "none":
        return None, None
    kind = options.baseline or "eager"
    why = unavailable(kind)
    if why:
        if options.baseline:
            raise K2Error(f"--baseline {kind}: {why}")
        notes.append(f"no baseline: {why}")
        return None, None
    recorded = manifest.data.get("checkpoint") or {}
    path = Path(recorded.get("path") or "")
    if not recorded.get("path") or not (path / "config.json").exists():
        why = f"the checkpoint the artifact was exported from ({recorded.get('path')}) is gone"
        if options.baseline:  # asked for by name: an error, not a silent "none"
            raise K2Error(f"--baseline {kind}: {why}; pass --baseline none to run without one")
        notes.append(f"no baseline: {why}")
        return None, None
    index = path / "model.safetensors.index.json"
    if recorded.get("index_sha256") and index.exists():
        import hashlib

        if hashlib.sha256(index.read_bytes()).hexdigest() != recorded["index_sha256"]:
            why = f"{path} is not the checkpoint the artifact was exported from (its index differs from the record)"
            if options.baseline:
                raise K2Error(f"--baseline {kind}: {why}; pass --baseline none to run without one")
            notes.append(f"no baseline: {why}")
            return None, None
    return kind, path


class _Ours:
    """The artifact through k2deploy.runtime, run the way `generate` runs it."""

    def __init__(self, manifest, config: EngineConfig):
        from ..runtime.loading import load_backend

        self.speculative = config.speculative
        rss = current_rss_bytes()
        started = time.perf_counter()
        self.model = load_backend(manifest, config)
        self.load_seconds = time.perf_counter() - started
        self.weights_rss_bytes = (current_rss_bytes() - rss) if rss is not None else None
        self.vocab = self.model.config.vocab_size

    def run(self, batch: int, prompt_len: int, gen_len: int, seed: int) -> dict:
        """One batch of greedy requests through the step loop, as `generate` and the server run them: its prefill
        forwards until every request has its first token, then decode forwards until each has gen_len tokens, each
        timed (gen_len - 1 of them, fewer where drafted tokens were accepted)."""
        from ..runtime.engine.requests import GenerationRequest
        from ..runtime.engine.sampling import SamplingParams
        from ..runtime.engine.step_loop import StepLoop

        model = self.model
        loop = StepLoop(model, batch, prompt_len + gen_len, max_queue=0, speculative=self.speculative)
        params = SamplingParams(temperature=0.0, max_new_tokens=gen_len)  # no stop ids: gen_len tokens each
        requests = [GenerationRequest(prompt, params, lambda update: None, row=row)
                    for row, prompt in enumerate(prompts(seed, batch, prompt_len, self.vocab).tolist())]
        for request in requests:
            loop.submit(request)
        reset_peak_rss()
        started = time.perf_counter()
        running = loop.admit()
        while any(r.prefilling and r.slot is not None for r in running):  # a failed request leaves its slot
            loop.prefill(running)
        ttft = time.perf_counter() - started
        prefill = ttft - loop.sampling_seconds
        steps, sampling, stages = [], [], []
        for _ in range(gen_len - 1):
            if all(r.done for r in running):  # drafts accepted: fewer forwards than tokens
                break
            model.stage_seconds.clear()
            sampled_before = loop.sampling_seconds
            started = time.perf_counter()
            loop.decode(running)
            steps.append(time.perf_counter() - started)
            sampling.append(loop.sampling_seconds - sampled_before)
            stages.append(dict(model.stage_seconds))  # this step's sessions: embed, layer_NNN (or native_step), head
        if any(r.error for r in running):
            raise K2Error(f"the benchmark's generation failed: {next(r.error for r in running if r.error)}")
        return {"ttft_s": ttft, "prefill_s": prefill, "step_s": steps, "sampling_s": sampling,
                "stages_s": stages, "kv_cache_bytes": loop.cache.nbytes, "peak_rss_bytes": peak_rss_bytes(),
                "speculative": {key: sum(getattr(r.speculation, key) for r in requests)
                                for key in ("draft_tokens", "accepted_tokens", "forward_steps")}}


def _ms(seconds) -> list[float]:
    return [s * 1e3 for s in seconds]


def _cell_result(batch: int, prompt_len: int, gen_len: int, ours: list[dict], base: list[dict] | None,
                 layers: int, bound_bytes: dict, bandwidth_gbps: float | None) -> dict:
    steps_per_run = gen_len - 1  # tokens a row after its first: one a decode step, or more with accepted drafts
    # per run, the mean per decode step of each stage; the medians and p90s are over the runs
    # the native step runs the embedding and every layer in one call: one stage of its own (native_step)
    stage_names = ["embed", *[f"layer_{i:03d}" for i in range(layers)], "native_step", "head"]
    per_run = {name: [] for name in [*stage_names, "sampling", "overhead", "step"]}
    for run in ours:
        totals = {name: sum(step.get(name, 0.0) for step in run["stages_s"]) for name in stage_names}
        step, sampling = sum(run["step_s"]), sum(run["sampling_s"])
        for name in stage_names:
            per_run[name].append(totals[name] / steps_per_run * 1e3)
        per_run["sampling"].append(sampling / steps_per_run * 1e3)
        per_run["step"].append(step / steps_per_run * 1e3)
        per_run["overhead"].append((step - sampling - sum(totals.values())) / steps_per_run * 1e3)
    breakdown = {
        "embed": summarize(per_run["embed"]),
        "layers": [summarize(per_run[f"layer_{i:03d}"]) for i in range(layers)],
        "head": summarize(per_run["head"]),
        "sampling": summarize(per_run["sampling"]),
        "overhead": summarize(per_run["overhead"]),
        "step": summarize(per_run["step"]),
    }
    if any(per_run["native_step"]):
        breakdown["native_step"] = summarize(per_run["native_step"])
    parts = (breakdown["embed"]["median"] + sum(s["median"] for s in breakdown["layers"]) + breakdown["head"]["median"]
             + breakdown["sampling"]["median"] + breakdown["overhead"]["median"]
             + breakdown.get("native_step", {"median": 0.0})["median"])
    tpot = breakdown["step"]  # time per output token: the mean decode step of each run
    bound_ms = bound_bytes["total"] / (bandwidth_gbps * 1e9) * 1e3 if bandwidth_gbps else None
    cell = {
        "batch": batch,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "ttft_ms": summarize(_ms(run["ttft_s"] for run in ours)),
        "tpot_ms": tpot,
        "prefill_tokens_per_s": summarize(batch * prompt_len / run["prefill_s"] for run in ours),
        "stream_tokens_per_s": summarize(steps_per_run / sum(run["step_s"]) for run in ours),
        "batch_tokens_per_s": summarize(batch * steps_per_run / sum(run["step_s"]) for run in ours),
        "decode_step_ms": breakdown,
        "speculative": {key: sum(run["speculative"][key] for run in ours)
                        for key in ("draft_tokens", "accepted_tokens", "forward_steps")},
        "breakdown_sum_ratio": parts / breakdown["step"]["median"],
        "kv_cache_bytes_allocated": ours[0]["kv_cache_bytes"],
        "peak_rss_bytes": max((run["peak_rss_bytes"] or 0) for run in ours) or None,
        "bound": {
            "context": prompt_len + gen_len / 2,
            "bytes_per_step": bound_bytes["total"],
            "weight_bytes_per_step": bound_bytes["weights"],
            "cache_bytes_per_step": bound_bytes["cache"],
            "experts_per_moe_layer": bound_bytes["experts_per_moe_layer"],
            "ms": bound_ms,
            "ratio": tpot["median"] / bound_ms if bound_ms else None,
        },
        "baseline": None,
    }
    if base:
        b_tpot = summarize(_ms(sum(run["step_s"]) / steps_per_run for run in base))
        b_ttft = summarize(_ms(run["ttft_s"] for run in base))
        cell["baseline"] = {
            "ttft_ms": b_ttft,
            "tpot_ms": b_tpot,
            "prefill_tokens_per_s": summarize(batch * prompt_len / run["ttft_s"] for run in base),
            "batch_tokens_per_s": summarize(batch * steps_per_run / sum(run["step_s"]) for run in base),
            "peak_rss_bytes": max((run["peak_rss_bytes"] or 0) for run in base) or None,
            "ttft_ratio": ratio(b_ttft, cell["ttft_ms"]),
            "tpot_ratio": ratio(b_tpot, tpot),
            # the same ratios run by run (each pair ran back to back): their spread is the ratio's
            "ttft_ratio_paired": summarize(b["ttft_s"] / o["ttft_s"] for b, o in zip(base, ours)),
            "tpot_ratio_paired": summarize(sum(b["step_s"]) / sum(o["step_s"]) for b, o in zip(base, ours)),
        }
    return cell


def run_bench(options: BenchOptions, bar=None, log=lambda message: None) -> dict:
    """Runs the benchmark; returns the result document. `bar`: a tqdm-like progress bar (total set here)."""
    from ..core.manifest import load_manifest

    wall_started = time.perf_counter()
    manifest = load_manifest(options.artifact, verify_hashes=options.verify_hashes)
    config = manifest.config
    options.check(config.max_position_embeddings)
    if not manifest.data.get("complete"):
        start, stop = manifest.graphs["layer_range"]
        raise K2Error(f"{manifest.root} holds only layers {start}:{stop}; export the whole model to benchmark it")
    engine = resolve_engine_config(manifest, options, max_batch=max(options.batches),
                                   max_context=max(options.prompt_lens) + options.gen_len)
    notes: list[str] = []
    on_gpu = engine.backend == "tensorrt" or engine.provider in GPU_PROVIDERS
    kind, checkpoint = _resolve_baseline(options, manifest, notes)
    threads = engine.threads or default_threads()  # the baseline's: what our pool will have
    base = BaselineProcess(kind, checkpoint, threads) if kind else None
    try:
        log(f"loading {manifest.root}" + (f"; the {kind} baseline loads alongside" if base else ""))
        ours = _Ours(manifest, engine)
        record = getattr(ours.model, "record", None)  # the TensorRT engines' record names their GPU
        device = describe_device("tensorrt" if engine.backend == "tensorrt" else engine.provider,
                                 gpu_name=record["gpu"]["name"] if record else None)
        baseline_info = None
        if base is not None:
            try:
                baseline_info = base.wait_ready()
            except K2Error as error:
                if options.baseline:  # asked for by name: its failure is the answer
                    raise
                notes.append(f"no baseline: {error}")
                base.close()
                base, kind, checkpoint = None, None, None
        cells = [(b, t) for b in options.batches for t in options.prompt_lens]
        runs_per_cell = (options.warmup + options.repeats) * (2 if base else 1)
        if bar is not None:
            bar.total = len(cells) * runs_per_cell
            bar.refresh()
        log("measuring memory bandwidth")
        bandwidth = bw.measure_in_child(options.bandwidth_bytes, options.bandwidth_repeats)
        device_memory = []
        kv_per_token_layer = manifest.kv_cache["bytes_per_token_per_layer"]
        kept = {cell: {"ours": [], "base": []} for cell in cells}
        # pass by pass over all cells (warm-up passes first), so that a burst of load from elsewhere
        # falls on one run of every cell, which the medians then set aside, not on every run of one
        for index in range(options.warmup + options.repeats):
            warm = index < options.warmup
            gen_len = min(options.gen_len, WARMUP_GEN_LEN) if warm else options.gen_len
            for number, (batch, prompt_len) in enumerate(cells):
                order = ["ours", "base"] if (index + number) % 2 == 0 else ["base", "ours"]
                for side in order:
                    if side == "base" and base is None:
                        continue
                    if bar is not None:
                        bar.set_description_str(f"{'warm-up' if warm else f'run {index - options.warmup + 1}'} "
                                                f"b={batch} T={prompt_len} {'ours' if side == 'ours' else kind}")
                    runner = ours if side == "ours" else base
                    result = runner.run(batch, prompt_len, gen_len, options.seed)
                    if not warm:
                        kept[(batch, prompt_len)][side].append(result)
                    if bar is not None:
                        bar.update(1)
                if on_gpu:
                    device_memory.append(gpu_memory_used())
        results = [(batch, prompt_len, kept[(batch, prompt_len)],
                    decode_step_bytes(config, kv_per_token_layer, batch, prompt_len + options.gen_len / 2))
                   for batch, prompt_len in cells]
        bandwidth += bw.measure_in_child(options.bandwidth_bytes, options.bandwidth_repeats)
    finally:
        if base is not None:
            base.close()
    bandwidth_summary = summarize(bandwidth)
    cells_out = [_cell_result(b, t, options.gen_len, runs["ours"], runs["base"] or None, ours.model.num_layers,
                              step_bytes, bandwidth_summary["median"])
                 for b, t, runs, step_bytes in results]
    graph_files = {f: r["bytes"] for f, r in manifest.data["files"].items() if f.startswith("graphs/")}
    peaks = [c["peak_rss_bytes"] for c in cells_out if c["peak_rss_bytes"]]
    used = [m for m in device_memory if m]
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": options.command,
        "wall_seconds": time.perf_counter() - wall_started,
        "device": device,
        "provider": engine.provider,
        "backend": engine.backend,
        "threads": ours.model.threads,
        "decode_kernels": getattr(ours.model, "decode_kernels", None),
        "speculative": engine.speculative,
        "versions": {"k2deploy": _version("k2deploy"), "onnxruntime": _version("onnxruntime"),
                     "numpy": np.__version__, "python": platform.python_version(),
                     **((baseline_info or {}).get("versions") or {})},
        "artifact": {
            "path": str(Path(options.artifact).resolve()),
            "manifest_sha256": manifest.digest,
            "format_version": manifest.data["format_version"],
            "model_type": config.model_type,
            "layers": config.num_hidden_layers,
            "layer_structures": [entry.get("structure", "") for entry in manifest.graphs["layers"]],
            "hidden_size": config.hidden_size,
            "n_routed_experts": config.n_routed_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "vocab_size": config.vocab_size,
            "kv_cache": manifest.kv_cache["format"],
            "target": artifact_target(manifest.data).name,
            "checkpoint": (manifest.data.get("checkpoint") or {}).get("path"),
        },
        "settings": {"batches": list(options.batches), "prompt_lens": list(options.prompt_lens),
                     "gen_len": options.gen_len, "repeats": options.repeats, "warmup": options.warmup,
                     "warmup_gen_len": min(options.gen_len, WARMUP_GEN_LEN), "seed": options.seed,
                     "sampling": "greedy", "baseline": kind or "none"},
        "bandwidth": {"method": bw.METHOD, "bytes_per_array": options.bandwidth_bytes,
                      "gb_per_s": bandwidth_summary},
        "memory": {
            "weights_bytes": sum(graph_files.values()),
            "weights_rss_bytes": ours.weights_rss_bytes,
            "kv_bytes_per_token_per_layer": kv_per_token_layer,
            "kv_bytes_per_token": kv_per_token_layer * ours.model.num_layers,
            "peak_rss_bytes": max(peaks) if peaks else peak_rss_bytes(),
            "device_memory_bytes": max(used) if used else None,
        },
        "baseline": None if not kind else {
            "kind": kind,
            "checkpoint": str(checkpoint),
            "threads": baseline_info.get("threads"),
            "load_seconds": baseline_info.get("load_seconds"),
            "peak_rss_bytes": max((c["baseline"]["peak_rss_bytes"] or 0) for c in cells_out) or None,
            "device": "cpu",
        },
        "load_seconds": ours.load_seconds,
        "cells": cells_out,
        "notes": notes,
    }
