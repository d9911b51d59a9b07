"""One place that picks the runtime backend: ONNX Runtime, TensorRT, or ONNX Runtime stages placed over devices
(in this process or on Ray), all behind the runtime interface (`runtime.interface.Model`)."""

from __future__ import annotations

from ..core.errors import K2Error
from ..core.targets import BACKENDS, artifact_target
from ..core.tensorrt.environment import require_tensorrt


def load_backend(name: str, manifest, provider: str = "cpu", threads: int | None = None, placement: str | None = None,
                 ray: str | None = None, cache_tokens: int | None = None, decode: str = "auto"):
    """The model of an artifact on backend `name`. provider and threads apply to ONNX Runtime; TensorRT runs
    the engines `k2deploy build-engines` built for this GPU (a K2Error says how to build or install them).
    A placement ("auto" or "0:31@cuda:0,31:61@cuda:1") or a Ray address runs ONNX Runtime stages, each checked
    against its device's memory for its share of a cache of `cache_tokens` tokens (default: one sequence of the
    model's whole context); decode names the kernels of the cpu provider, a whole model's or each cpu stage's."""
    if placement is not None or ray is not None:
        if name != "onnxruntime":
            raise K2Error("--placement and --ray run ONNX Runtime stages; drop --backend tensorrt")
        from .stages.placed import load_placed

        tokens = cache_tokens or manifest.config.max_position_embeddings
        return load_placed(manifest, placement, ray, provider, threads, tokens, decode=decode)
    if name == "onnxruntime":
        from .backends.native.choice import load_model

        return load_model(manifest, provider=provider, threads=threads, decode=decode)
    if name == "tensorrt":
        artifact_target(manifest.data).check_runnable("tensorrt")
        require_tensorrt()
        from .backends.tensorrt.backend import TrtModel

        return TrtModel(manifest)
    raise K2Error(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
