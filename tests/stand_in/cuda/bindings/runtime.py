"""Stand-in for the cuda-python runtime calls k2deploy's TensorRT backend makes: "device" memory is
host memory (ctypes buffers), copies are memmove, the stream is synchronous, the GPU is an H200.
Calls return cuda-python's (error, value...) tuples; error 0 is success."""

import ctypes
import enum

_buffers: dict[int, ctypes.Array] = {}


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3


class _Properties:
    name = b"NVIDIA H200"
    major, minor = 9, 0


def cudaGetDeviceProperties(index):
    return (0, _Properties()) if index == 0 else (101, None)  # 101: cudaErrorInvalidDevice


def cudaSetDevice(index):
    return (0,) if index == 0 else (101,)


def cudaGetErrorName(error):
    return 0, f"cudaError{int(error)}".encode()


def cudaMalloc(nbytes):
    buffer = ctypes.create_string_buffer(int(nbytes) + 256)
    address = -(-ctypes.addressof(buffer) // 256) * 256  # cudaMalloc's addresses are 256-byte aligned
    _buffers[address] = buffer
    return 0, address


def cudaFree(address):
    _buffers.pop(int(address), None)
    return (0,)


def cudaDeviceSynchronize():
    return (0,)


def cudaStreamCreate():
    return 0, 1


def cudaStreamSynchronize(stream):
    return (0,)


def cudaMemsetAsync(address, value, nbytes, stream):
    ctypes.memset(address, value, nbytes)
    return (0,)


def cudaMemcpyAsync(dst, src, nbytes, kind, stream):
    ctypes.memmove(dst, src, nbytes)
    return (0,)


def cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, kind, stream):
    if width > dst_pitch or width > src_pitch:
        return (1,)  # cudaErrorInvalidValue, as the real call
    for row in range(height):
        ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)
    return (0,)
