"""The TensorRT runtime backend: engines per graph, run from the artifact's engine folder for this GPU.

Nothing here imports TensorRT at import time. `backend` runs the engines (over `cuda`, the CUDA runtime calls, and
`device_cache`, the latent cache in device memory); finding TensorRT and the GPU, and the engine record checked on
load, are `core/tensorrt/`, which building them (offline work: `export/tensorrt_engines.py`) reads too; choosing
ONNX Runtime or TensorRT: `runtime/loading.py`.
"""
