"""The TensorRT runtime backend: engines per graph, run from the artifact's engine folder for this GPU.

Nothing here imports TensorRT at import time. `environment` finds TensorRT and the GPU (and says
in one line what to install when TensorRT is missing), `record` is the engine record checked on
load, `backend` runs the engines (over `cuda`, the CUDA runtime calls, and `device_cache`, the latent
cache in device memory). Building them is offline work: `export/tensorrt_engines.py`; choosing
ONNX Runtime or TensorRT: `runtime/loading.py`.
"""

from .environment import INSTALL_HINT, GpuInfo, require_tensorrt, tensorrt_available

__all__ = ["INSTALL_HINT", "GpuInfo", "require_tensorrt", "tensorrt_available"]
