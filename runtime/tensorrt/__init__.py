"""The TensorRT path: engines per graph, built from the artifact's TensorRT copies, and a runtime backend.

Nothing here imports TensorRT at import time. `environment` finds TensorRT and the GPU (and says
in one line what to install when TensorRT is missing), `record` is the engine record checked on
load, `builder` builds the engines, `backend` runs them (over `cuda`, the CUDA runtime calls, and
`device_cache`, the latent cache in device memory), `factory.load_backend` picks ONNX
Runtime or TensorRT behind one interface, `cli` holds the `build-engines` command.
"""

from .environment import INSTALL_HINT, GpuInfo, require_tensorrt, tensorrt_available
from .factory import BACKENDS, load_backend

__all__ = ["BACKENDS", "INSTALL_HINT", "GpuInfo", "load_backend", "require_tensorrt", "tensorrt_available"]
