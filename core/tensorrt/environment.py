"""Finding TensorRT and the GPU, and naming a GPU's engine folder. TensorRT is imported lazily."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from dataclasses import dataclass

from ..errors import K2Error

MIN_TENSORRT = (10, 9)  # the ONNX parser imports Python AOT plugins from 10.9 (quickly deployable ones from 10.6)
INSTALL_HINT = ("TensorRT is not installed: pip install tensorrt cuda-python (needs an NVIDIA GPU and driver; "
                "plugins also need torch with CUDA and triton)")


def tensorrt_available() -> bool:
    try:
        importlib.import_module("tensorrt")
        return True
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return False


def require_tensorrt():
    """The tensorrt module, or a K2Error saying in one line what to install."""
    try:
        trt = importlib.import_module("tensorrt")
    except Exception:  # noqa: BLE001
        raise K2Error(INSTALL_HINT) from None
    version = tuple(int(p) for p in re.findall(r"\d+", getattr(trt, "__version__", "0"))[:2])
    if version < MIN_TENSORRT:
        raise K2Error(f"TensorRT {trt.__version__} is too old: the plugins need TensorRT "
                      f"{'.'.join(map(str, MIN_TENSORRT))} or newer (pip install -U tensorrt)")
    return trt


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_capability: str  # "9.0"
    index: int = 0

    @property
    def slug(self) -> str:
        """The engine folder's name: the GPU's name and architecture, e.g. nvidia-h200-sm90."""
        name = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")
        return f"{name}-sm{self.compute_capability.replace('.', '')}"

    def to_dict(self) -> dict:
        return {"name": self.name, "compute_capability": self.compute_capability, "slug": self.slug}


def detect_gpu(index: int = 0) -> GpuInfo:
    """The name and compute capability of CUDA device `index`: through cuda-python, torch or nvidia-smi."""
    try:
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            from cuda import cudart  # cuda-python < 12.6
        err, props = cudart.cudaGetDeviceProperties(index)
        if int(err) == 0:
            name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
            return GpuInfo(name.strip("\x00").strip(), f"{props.major}.{props.minor}", index)
    except Exception:  # noqa: BLE001 - try the next way
        pass
    try:
        import torch

        if torch.cuda.is_available() and index < torch.cuda.device_count():
            major, minor = torch.cuda.get_device_capability(index)
            return GpuInfo(torch.cuda.get_device_name(index), f"{major}.{minor}", index)
    except Exception:  # noqa: BLE001
        pass
    if shutil.which("nvidia-smi"):
        try:
            lines = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
            if index < len(lines):
                name, cap = (part.strip() for part in lines[index].split(","))
                return GpuInfo(name, cap, index)
        except Exception:  # noqa: BLE001
            pass
    raise K2Error(f"no CUDA GPU {index} found (checked cuda-python, torch and nvidia-smi); TensorRT engines are "
                  f"built and run on an NVIDIA GPU")


def parse_gpu_option(text: str) -> int:
    """--gpu auto|N -> the CUDA device index."""
    if text == "auto":
        return 0
    try:
        index = int(text)
    except ValueError:
        raise K2Error(f"--gpu {text!r}: expected auto or a CUDA device index (0, 1, ...)") from None
    if index < 0:
        raise K2Error(f"--gpu {text!r}: a device index is 0 or more")
    return index
