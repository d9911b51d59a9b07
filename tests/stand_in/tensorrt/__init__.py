"""A stand-in for the parts of `tensorrt` that k2deploy's plugin registrations touch, so that their code
runs in tests where TensorRT cannot be installed. Modelled on TensorRT's documented Python API; it only
records and checks, it builds nothing. Put this folder first on sys.path to use it (tests only)."""

from enum import Enum

__version__ = "10.13.0+stand-in"


class DataType(Enum):  # names as in trt.DataType, which AutoTuneCombination strings use
    FLOAT = "FP32"
    HALF = "FP16"
    BF16 = "BF16"
    INT32 = "INT32"
    INT64 = "INT64"
    BOOL = "BOOL"
    UINT8 = "UINT8"
    FP8 = "FP8"


float32, float16, bfloat16, int32, int64, bool, uint8, fp8 = (  # noqa: A001 - trt's own names
    DataType.FLOAT, DataType.HALF, DataType.BF16, DataType.INT32, DataType.INT64, DataType.BOOL, DataType.UINT8,
    DataType.FP8)

from ._engine import Builder, Logger, MemoryPoolType, NetworkDefinitionCreationFlag, OnnxParser, Runtime  # noqa: E402,F401
