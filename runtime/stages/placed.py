"""A pipeline model from `--placement` and `--ray`: the stages parsed or made, each checked against its device's
memory for its weights plus its layers' share of the cache's page pool (on its own host), then loaded here or on
Ray actors."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess

from ...core.cache_format import CacheFormat
from ...core.errors import K2Error
from ...core.placement import USABLE_FRACTION, Stage, auto_placement, format_bytes, parse_placement
from .pipeline import LocalStages, PipelineModel

FLOAT32_BYTES = 4


def load_placed(manifest, placement: str | None, ray: str | None, provider: str, threads: int | None,
                cache_tokens: int, compiled: bool = True, driver_stage: bool = True,
                decode: str = "auto") -> PipelineModel:
    """The artifact as stages; placement None or "auto": one cpu stage on the cpu provider, else one stage per
    visible GPU, balanced by bytes. compiled False: Ray stages step through tasks, not a compiled graph;
    driver_stage False: every stage on a Ray actor, the first too (`ray_stages.RayStages`). decode: the kernels of
    each cpu stage (the native step where it runs, `native.choice.load_stage`)."""
    if ray is not None:
        from .ray_stages import connect

        connect(ray)
    layers = len(manifest.graphs["layers"])
    weights = _stage_weights(manifest)
    cache_per_layer = cache_tokens * CacheFormat.from_manifest(manifest.kv_cache).bytes_per_token_per_layer
    if placement in (None, "auto"):
        stages = _auto(weights, cache_per_layer, layers, provider, ray is not None)
    else:
        stages = parse_placement(placement, layers)
    if provider == "cpu" and any(s.device != "cpu" for s in stages):
        raise K2Error("--placement puts stages on GPUs but --provider is cpu; pass --provider cuda (or tensorrt)")
    check = functools.partial(check_memory, weights=weights, cache_per_layer=cache_per_layer, tokens=cache_tokens)
    if ray is not None:
        from .ray_stages import RayStages

        config = manifest.config
        row_bytes = FLOAT32_BYTES * max(config.hidden_size, config.vocab_size)
        return PipelineModel(manifest, RayStages(str(manifest.root), stages, provider, threads, check, row_bytes,
                                                 compiled, driver_stage, decode), stages)
    if any(s.host for s in stages):
        raise K2Error("--placement names hosts other than h0; stages on several hosts run on Ray: pass --ray ADDRESS")
    for i, stage in enumerate(stages):
        check(i, stage)
    return PipelineModel(manifest, LocalStages(str(manifest.root), stages, provider, threads, decode), stages)


def _stage_weights(manifest) -> dict:
    """Bytes of the artifact's graph files: per decoder layer, the embedding and the head."""
    files = manifest.data["files"]

    def size(entry: dict) -> int:
        return files[entry["file"]]["bytes"] + files[entry["data"]]["bytes"]

    return {"layers": [size(e) for e in manifest.graphs["layers"]], "embed": size(manifest.graphs["embed"]),
            "head": size(manifest.graphs["head"])}


def _auto(weights: dict, cache_per_layer: int, layers: int, provider: str, on_ray: bool) -> list[Stage]:
    gpus = 0 if provider == "cpu" else _gpu_count(on_ray)
    if gpus == 0:
        return [Stage(0, layers, "cpu", 0, True, True)]
    capacity = min(_gpu_memory(i) or 0 for i in range(gpus)) or 10**15  # unknown memory: balance by bytes alone
    sizes = [w + cache_per_layer for w in weights["layers"]]
    return auto_placement(sizes, weights["embed"], weights["head"], min(gpus, layers), 1,
                          int(capacity * USABLE_FRACTION))


def check_memory(index: int, stage: Stage, weights: dict, cache_per_layer: int, tokens: int) -> None:
    """Run on the stage's own host (a Ray task there for Ray stages), which it names in a refusal."""
    held = sum(weights["layers"][stage.start:stage.stop]) + weights["embed"] * stage.first + weights["head"] * stage.last
    capacity = _memory(stage.device)
    if capacity is None:
        return
    usable = int(capacity * USABLE_FRACTION)
    need = held + cache_per_layer * stage.layers
    if need > usable:
        per_token = cache_per_layer // tokens * stage.layers
        fits = (usable - held) // per_token if usable > held else 0
        hint = (f"--max-total-tokens {fits} would fit" if fits else "its weights alone do not fit: give it fewer layers")
        raise K2Error(f"stage {index} (layers {stage.start}:{stage.stop} on {stage.name}) needs {format_bytes(need)} "
                      f"for weights and a cache of {tokens} tokens, its device on host {socket.gethostname()} offers "
                      f"{format_bytes(usable)} ({USABLE_FRACTION:.0%} of {format_bytes(capacity)}); {hint}")


def _memory(device: str) -> int | None:
    """Bytes of memory of a device on this host: RAM for cpu, the GPU's for cuda:N (None when unknown)."""
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return _gpu_memory(int(device.partition(":")[2] or 0))


@functools.cache
def _nvidia_smi(query: str) -> list[str]:
    """One nvidia-smi query per process: the GPUs do not change while stages are placed."""
    if shutil.which("nvidia-smi") is None:
        return []
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=20)
    return done.stdout.split() if done.returncode == 0 else []


def _gpu_memory(index: int) -> int | None:
    sizes = _nvidia_smi("memory.total")  # MiB per GPU
    return int(sizes[index]) << 20 if index < len(sizes) else None


def _gpu_count(on_ray: bool) -> int:
    if on_ray:
        import ray

        return int(ray.cluster_resources().get("GPU", 0))
    return len(_nvidia_smi("index"))
