"""One place that picks the runtime backend: ONNX Runtime or TensorRT, behind the interface of `OrtModel`
(config, kv_cache, num_layers, new_cache(batch, max_len), forward(...), logits(hidden), stage_seconds)."""

from __future__ import annotations

from ...errors import K2Error
from ...targets import artifact_target, check_runnable
from .environment import require_tensorrt

BACKENDS = ("onnxruntime", "tensorrt")


def load_backend(name: str, manifest, provider: str = "cpu", threads: int | None = None):
    """The model of an artifact on backend `name`. provider and threads apply to ONNX Runtime; TensorRT runs
    the engines `k2deploy build-engines` built for this GPU (a K2Error says how to build or install them)."""
    if name == "onnxruntime":
        from ..ort_backend import OrtModel

        return OrtModel(manifest, provider=provider, threads=threads)
    if name == "tensorrt":
        check_runnable(artifact_target(manifest.data), "tensorrt")
        require_tensorrt()
        from .backend import TrtModel

        return TrtModel(manifest)
    raise K2Error(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
