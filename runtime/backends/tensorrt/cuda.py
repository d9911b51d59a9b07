"""The few CUDA runtime calls the TensorRT backend makes, through cuda-python, with errors raised."""

from __future__ import annotations

import numpy as np

from ....core.errors import K2Error


class CudaRuntime:
    """The few CUDA runtime calls the backend makes, through cuda-python, with errors raised."""

    def __init__(self):
        try:
            try:
                from cuda.bindings import runtime as cudart
            except ImportError:
                from cuda import cudart
        except ImportError:
            raise K2Error("the TensorRT backend needs cuda-python: pip install cuda-python") from None
        self.rt = cudart
        kinds = cudart.cudaMemcpyKind
        self.h2d, self.d2h, self.d2d = (kinds.cudaMemcpyHostToDevice, kinds.cudaMemcpyDeviceToHost,
                                        kinds.cudaMemcpyDeviceToDevice)

    def call(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            name = self.rt.cudaGetErrorName(err)[1]
            raise K2Error(f"CUDA error {int(err)} ({name.decode() if isinstance(name, bytes) else name})")
        return rest[0] if len(rest) == 1 else rest

    def malloc(self, nbytes: int) -> int:
        return int(self.call(self.rt.cudaMalloc(max(int(nbytes), 1))))

    def free(self, pointer: int) -> None:
        self.rt.cudaFree(pointer)

    def set_device(self, index: int) -> None:
        """Makes CUDA device `index` current for this thread: streams, memory and engines land there."""
        self.call(self.rt.cudaSetDevice(index))

    def device_synchronize(self) -> None:
        self.call(self.rt.cudaDeviceSynchronize())

    def stream(self):
        return self.call(self.rt.cudaStreamCreate())

    def synchronize(self, stream) -> None:
        self.call(self.rt.cudaStreamSynchronize(stream))

    def memset(self, pointer: int, nbytes: int, stream) -> None:
        self.call(self.rt.cudaMemsetAsync(pointer, 0, nbytes, stream))

    def to_device(self, pointer: int, array: np.ndarray, stream) -> None:
        array = np.ascontiguousarray(array)
        self.call(self.rt.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, self.h2d, stream))

    def to_host(self, array: np.ndarray, pointer: int, stream) -> None:
        self.call(self.rt.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, self.d2h, stream))

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream) -> None:
        self.call(self.rt.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, self.d2d, stream))


def stream_handle(stream) -> int:
    """The integer handle TensorRT takes for a stream of cuda-python (cudaStream_t converts with int())."""
    return int(stream)
