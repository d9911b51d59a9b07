"""What an artifact is lowered for, and what may run it: one `Target` record per target, read by the exporter
(weights, cache formats, lowering passes), the runtimes (which backend and provider may run an artifact),
bench, and every command's choices. A target's lowering is an ordered list of named passes (`export/passes.py`),
each applied to what the ones before it made. Adding a target is one record here and, when it needs a lowering
of its own, one named pass in `export/passes.py`.

- cpu:      ONNX Runtime's CPU provider. FP8 linears, the BF16 head and the routed experts are
            re-quantised to int8 blocks (`com.microsoft` MatMulNBits and QMoE, int8 compute):
            about one byte per weight, read once per step (int8_weights), then laid out in the native
            step's tiles (native_tiles). Lossy; its error is stated in docs/artifact.md.
- cuda:     ONNX Runtime's CUDA provider. FP8 stays FP8 (the exact graph).
- tensorrt: TensorRT engines (`k2deploy build-engines`). FP8 stays FP8; its TensorRT copy of each
            graph turns FP8 casts into Q/DQ and the plugin ops into plugins.

The exact FP8 graph of cuda and tensorrt artifacts is also what ONNX Runtime's CPU provider runs when a
check needs the exact weights (parity against the eager reference), so it is accepted there; the
int8 graph of a cpu artifact runs on nothing but the CPU provider.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from .errors import K2Error

BACKENDS = ("onnxruntime", "tensorrt")  # what runs an artifact: ONNX Runtime sessions, or TensorRT engines
PROVIDERS = ("cpu", "cuda", "tensorrt")  # ONNX Runtime's execution providers, by their short names
GPU_PROVIDERS = ("cuda", "tensorrt")
_EXACT_WEIGHTS = "as in the checkpoint: FP8 e4m3 with float32 128x128 block scales, BF16 norms, router, embedding and head"


@dataclass(frozen=True)
class Target:
    name: str
    weights: str  # the manifest's description of how the weights are stored
    caches: tuple[str, ...]  # the latent cache formats its graphs may use, the default first
    passes: tuple[str, ...]  # the lowering passes over the traced graphs, applied in this order (export/passes.py)
    runs_on: tuple[tuple[str, str | None], ...]  # (backend, ONNX Runtime provider or None) pairs that may run it
    advice: str  # what to export instead, when asked to run where it cannot

    @property
    def default_cache(self) -> str:
        return self.caches[0]

    def check_cache(self, cache: str) -> str:
        if cache not in self.caches:
            owners = [t.name for t in TARGETS.values() if cache in t.caches]
            raise K2Error(f"--kv-cache {cache} is the cache of --target {' or '.join(owners)}; --target {self.name} "
                          f"keeps {' or '.join(self.caches)}")
        return cache

    def check_runnable(self, backend: str, provider: str | None = "cpu") -> None:
        """A one-line K2Error when an artifact lowered for this target cannot run on this backend and provider."""
        if (backend, provider if backend == "onnxruntime" else None) in self.runs_on:
            return
        runner = "TensorRT" if backend == "tensorrt" else f"ONNX Runtime's {provider} provider"
        instead = "tensorrt" if backend == "tensorrt" else provider
        raise K2Error(f"this artifact was lowered for --target {self.name} ({self.advice}) and cannot run on "
                      f"{runner}; export it again with --target {instead}")


_ANY_ORT = tuple(("onnxruntime", p) for p in PROVIDERS)
TARGETS = {t.name: t for t in (
    Target("cpu",
           weights="dense linears, head and routed experts as int8 blocks along the input dim (uint8 codes - 128, "
                   "one float32 scale per block), re-quantised from the checkpoint's FP8 and BF16; com.microsoft "
                   "MatMulNBits and QMoE with int8 compute; with the int8 cache, kv_b_proj as int8 W_UK and W_UV (one "
                   "scale per output column) for MatMulInteger, else FP8; norms, router and embedding as in the "
                   "checkpoint",
           caches=("int8", "fp8", "bf16"), passes=("int8_weights", "native_tiles"), runs_on=(("onnxruntime", "cpu"),),
           advice="int8 weights for ONNX Runtime's CPU provider"),
    Target("cuda", weights=_EXACT_WEIGHTS, caches=("fp8", "bf16"), passes=(), runs_on=(*_ANY_ORT, ("tensorrt", None)),
           advice="the exact FP8 graph"),
    Target("tensorrt", weights=_EXACT_WEIGHTS, caches=("fp8", "bf16"), passes=("tensorrt_plugins",),
           runs_on=(*_ANY_ORT, ("tensorrt", None)), advice="the exact FP8 graph and its TensorRT copies"),
)}
LEGACY_TARGET = "cuda"  # artifacts written before targets were recorded hold the exact FP8 graph


def default_target() -> str:
    """tensorrt where TensorRT is installed, cuda where ONNX Runtime has its CUDA provider, else cpu."""
    if importlib.util.find_spec("tensorrt") is not None:
        return "tensorrt"
    try:
        import onnxruntime
    except ImportError:
        return "cpu"
    return "cuda" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "cpu"


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise K2Error(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


def artifact_target(manifest_data: dict) -> Target:
    """The target an artifact was lowered for (its manifest's `target`); a K2Error for one this version does not know."""
    name = manifest_data.get("target", LEGACY_TARGET)
    if not isinstance(name, str) or name not in TARGETS:
        raise K2Error(f"the artifact's manifest names target {name!r}, which this k2deploy does not know (it knows "
                      f"{', '.join(TARGETS)}); re-export the artifact")
    return TARGETS[name]
