"""The safetensors file format, read and written without loading tensors.

A file is an 8-byte little-endian header length, a JSON header mapping each tensor name to
{dtype, shape, data_offsets: [begin, end)} relative to the data section, then the data.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

import ml_dtypes
import numpy as np

from ..errors import K2Error
from ..json_files import loads

NUMPY_DTYPES = {
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "U8": np.dtype(np.uint8),
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: Path
    begin: int  # absolute byte offsets in the shard file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parses one shard's header and checks that the file holds every byte it promises."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise K2Error(f"shard {path.name} is truncated: {size} bytes, shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise K2Error(f"shard {path.name} is truncated or not a safetensors file (header of {header_len} bytes in a {size}-byte file)")
            header = loads(f.read(header_len))
    except FileNotFoundError:
        raise K2Error(f"shard {path.name} is missing from {path.parent}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise K2Error(f"shard {path.name} has a garbled header; re-download it") from None
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise K2Error(f"shard {path.name}: header entry for {name} is malformed") from None
        if dtype not in NUMPY_DTYPES:
            raise K2Error(f"shard {path.name}: tensor {name} has unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * NUMPY_DTYPES[dtype].itemsize:
            raise K2Error(f"shard {path.name}: tensor {name} spans {end - begin} bytes, not what {dtype}{list(shape)} needs")
        if data_start + end > size:
            raise K2Error(
                f"shard {path.name} is truncated: tensor {name} needs bytes up to {data_start + end} "
                f"but the file has {size}; re-download or re-create the shard"
            )
        entries[name] = TensorEntry(name, dtype, shape, path, data_start + begin, data_start + end)
    return entries


def header_bytes(specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """The encoded header (length prefix included) for tensors laid out in the given order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * NUMPY_DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded


def write_array(f: BinaryIO, array: np.ndarray) -> None:
    f.write(np.ascontiguousarray(array).tobytes())
