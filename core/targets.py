"""What an artifact is lowered for, and which runtimes may run it.

- cpu:      ONNX Runtime's CPU provider. FP8 linears, the BF16 head and the routed experts are
            re-quantised to int8 blocks (`com.microsoft` MatMulNBits and QMoE, int8 compute):
            about one byte per weight, read once per step. Lossy; its error is stated in the README.
- cuda:     ONNX Runtime's CUDA provider. FP8 stays FP8 (the exact graph).
- tensorrt: TensorRT engines (`k2deploy build-engines`). FP8 stays FP8; the TensorRT copy turns it
            into Q/DQ and the plugin ops into plugins.

The FP8 graph of cuda and tensorrt artifacts is also what ONNX Runtime's CPU provider runs when a
check needs the exact weights (parity against the eager reference), so it is accepted there; the
int8 graph of a cpu artifact runs on nothing but the CPU provider.
"""

from __future__ import annotations

import importlib.util

from .errors import K2Error

TARGETS = ("cpu", "cuda", "tensorrt")
EXACT_TARGETS = ("cuda", "tensorrt")  # FP8 weights as the checkpoint holds them
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


def check_target(name: str) -> str:
    if name not in TARGETS:
        raise K2Error(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    return name


def artifact_target(manifest_data: dict) -> str:
    return manifest_data.get("target", LEGACY_TARGET)


def check_runnable(target: str, backend: str, provider: str = "cpu") -> None:
    """A one-line K2Error when an artifact lowered for `target` cannot run on this backend and provider."""
    if target == "cpu" and (backend != "onnxruntime" or provider != "cpu"):
        runner = "TensorRT" if backend == "tensorrt" else f"ONNX Runtime's {provider} provider"
        raise K2Error(f"this artifact was lowered for --target cpu (int8 weights for ONNX Runtime's CPU provider) and "
                      f"cannot run on {runner}; export it again with --target {'tensorrt' if backend == 'tensorrt' else provider}")
