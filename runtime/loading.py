"""One place that picks the runtime backend: ONNX Runtime, TensorRT, or ONNX Runtime stages placed over devices
(in this process or on Ray), all behind the runtime interface (`runtime.interface.Model`)."""

from __future__ import annotations

from ..core.errors import K2Error
from ..core.targets import BACKENDS, artifact_target
from ..core.tensorrt.environment import require_tensorrt
from .engine.config import EngineConfig


def load_backend(manifest, config: EngineConfig):
    """The model of an artifact as `config` runs it (runtime/engine/config.py). provider and threads apply to ONNX
    Runtime; TensorRT runs the engines `k2deploy build-engines` built for this GPU (a K2Error says how to build or
    install them). A placement ("auto" or "0:31@cuda:0,31:61@cuda:1") or a Ray address runs ONNX Runtime stages,
    each checked against its device's memory for its share of a cache of `config.cache_tokens_at_most` tokens;
    decode names the kernels of the cpu provider, a whole model's or each cpu stage's."""
    if config.placement is not None or config.ray is not None:
        if config.backend != "onnxruntime":
            raise K2Error("--placement and --ray run ONNX Runtime stages; drop --backend tensorrt")
        from .stages.placed import load_placed

        return load_placed(manifest, config.placement, config.ray, config.provider, config.threads,
                           config.cache_tokens_at_most, decode=config.decode)
    if config.backend == "onnxruntime":
        from .backends.native.choice import load_model

        return load_model(manifest, provider=config.provider, threads=config.threads, decode=config.decode)
    if config.backend == "tensorrt":
        artifact_target(manifest.data).check_runnable("tensorrt")
        require_tensorrt()
        from .backends.tensorrt.backend import TrtModel

        return TrtModel(manifest)
    raise K2Error(f"unknown backend {config.backend!r}; choose one of {', '.join(BACKENDS)}")
