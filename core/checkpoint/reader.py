"""A lazy reader of Hugging Face Kimi K2 / DeepSeek-V3 checkpoint directories.

Opening reads config.json, the shard index and every shard's header, and checks them
against the layout the config implies; no tensor data is read until asked for. Tensors
are memory-mapped views, so reading one layer costs that layer's bytes and no more.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config import ModelConfig
from ..errors import K2Error
from ..json_files import loads
from .. import int4
from . import layout
from .fp8 import dequantize
from .safetensors_io import NUMPY_DTYPES, TensorEntry, read_header

INDEX_FILE = "model.safetensors.index.json"
SHAPE_DTYPES = ("I64", "I32")  # an INT4 weight_shape as compressed-tensors saves it (int64), or int32
SINGLE_FILE = "model.safetensors"


class Checkpoint:
    def __init__(self, root: Path, config: ModelConfig, entries: dict[str, TensorEntry]):
        self.root = root
        self.config = config
        self.entries = entries  # every tensor of every shard, by name
        self.bytes_read = 0  # tensor bytes handed out so far; lets callers check laziness
        self._maps: dict[Path, mmap.mmap] = {}

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> "Checkpoint":
        root = Path(path)
        if not root.exists():
            raise K2Error(f"{root}: no such directory")
        if not root.is_dir():
            raise K2Error(f"{root}: not a directory; pass the checkpoint directory that holds config.json")
        config = ModelConfig.from_file(root / "config.json")
        entries = _read_entries(root)
        checkpoint = cls(root, config, entries)
        if verify:
            checkpoint.verify()
        return checkpoint

    def verify(self) -> None:
        """Every tensor the config implies exists with its shape and dtype (extra tensors are allowed)."""
        for spec in layout.all_tensors(self.config):
            entry = self.entries.get(spec.name)
            if entry is None:
                raise K2Error(f"{self.root}: tensor {spec.name} is missing (no shard holds it)")
            if entry.shape != spec.shape:
                raise K2Error(
                    f"{self.root}: tensor {spec.name} in {entry.shard.name} has shape {list(entry.shape)}, "
                    f"the config implies {list(spec.shape)}"
                )
            if entry.dtype != spec.dtype and not (spec.role == "int4_shape" and entry.dtype in SHAPE_DTYPES):
                raise K2Error(f"{self.root}: tensor {spec.name} in {entry.shard.name} is {entry.dtype}, expected {spec.dtype}")

    # -- reading --------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only memory-mapped array (FP8 as ml_dtypes.float8_e4m3fn)."""
        entry = self.entries.get(name)
        if entry is None:
            raise K2Error(f"{self.root}: no tensor named {name}")
        buffer = self._map(entry.shard)
        self.bytes_read += entry.nbytes
        array = np.frombuffer(buffer, dtype=NUMPY_DTYPES[entry.dtype], count=int(np.prod(entry.shape)), offset=entry.begin)
        return array.reshape(entry.shape)

    def stream(self, name: str, chunk_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
        """The stored bytes of a tensor as uint8 chunks, read with pread: nothing stays mapped or resident,
        so copying a real-size layer costs one chunk of memory."""
        entry = self.entries.get(name)
        if entry is None:
            raise K2Error(f"{self.root}: no tensor named {name}")
        descriptor = os.open(entry.shard, os.O_RDONLY)
        try:
            for offset in range(entry.begin, entry.end, chunk_bytes):
                data = os.pread(descriptor, min(chunk_bytes, entry.end - offset), offset)
                self.bytes_read += len(data)
                yield np.frombuffer(data, dtype=np.uint8)
        finally:
            os.close(descriptor)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows start:stop (of the first dim; clipped to it) of a stored tensor of at least one dim, as a private
        array the file is read straight into (FP8 as ml_dtypes.float8_e4m3fn): nothing of the shard stays mapped,
        so re-quantising a real-size layer piece by piece holds one piece at a time."""
        entry = self.entries.get(name)
        if entry is None:
            raise K2Error(f"{self.root}: no tensor named {name}")
        count = entry.shape[0]
        stop = min(stop, count)
        start = min(max(start, 0), stop)
        row_bytes = entry.nbytes // count if count else 0
        out = np.empty((stop - start) * row_bytes, np.uint8)
        view, offset, done = memoryview(out), entry.begin + start * row_bytes, 0
        descriptor = os.open(entry.shard, os.O_RDONLY)
        try:
            while done < out.nbytes:
                got = os.preadv(descriptor, [view[done:]], offset + done)
                if got <= 0:
                    raise K2Error(f"{entry.shard}: ends inside tensor {name}; the shard is truncated")
                done += got
        finally:
            os.close(descriptor)
        self.bytes_read += out.nbytes
        return out.view(NUMPY_DTYPES[entry.dtype]).reshape((stop - start, *entry.shape[1:]))

    def read(self, name: str) -> np.ndarray:
        """The stored tensor as a private array read with pread (FP8 as ml_dtypes.float8_e4m3fn): nothing of the
        shard stays mapped, so reading every tensor of a real-size layer one by one holds one tensor at a time."""
        entry = self.entries.get(name)
        if entry is None:
            raise K2Error(f"{self.root}: no tensor named {name}")
        data = np.concatenate(list(self.stream(name))) if entry.nbytes else np.empty(0, np.uint8)
        return data.view(NUMPY_DTYPES[entry.dtype]).reshape(entry.shape)

    def float32(self, name: str) -> np.ndarray:
        """A tensor in float32; `*.weight` of an FP8 or INT4 projection comes back dequantised."""
        if name not in self.entries and self.config.int4 is not None and name + "_packed" in self.entries:
            return int4.dequantize(self.read(name + "_packed"), self.read(name + "_scale"), self.config.int4.group)
        array = self.raw(name)
        if array.dtype == NUMPY_DTYPES["F8_E4M3"]:
            scale_name = name + "_scale_inv"
            if scale_name not in self.entries or self.config.fp8_block is None:
                raise K2Error(f"{self.root}: FP8 tensor {name} has no {scale_name} or the config no weight_block_size")
            return dequantize(array, self.raw(scale_name), self.config.fp8_block)
        return array.astype(np.float32)

    def check_quantised(self, names: list[str]) -> None:
        """The scales among `names` are finite (FP8 block scales, INT4 group scales: a NaN or inf scale turns its
        whole block or group into NaN) and each INT4 `weight_shape` says the shape its codes have; a one-line
        K2Error naming the tensor."""
        for name in names:
            if name.endswith(("_scale_inv", ".weight_scale")) and not np.isfinite(self.read(name)).all():
                raise K2Error(f"{self.root}: {name} holds a non-finite scale (NaN or inf); the checkpoint is damaged")
            if name.endswith(".weight_shape"):
                rows, words = self.entries[name.removesuffix("_shape") + "_packed"].shape
                stated = [int(v) for v in self.read(name)]
                if stated != [rows, words * 8]:
                    raise K2Error(f"{self.root}: {name} says {stated}, but its weight_packed holds [{rows}, "
                                  f"{words * 8}] values; the checkpoint is damaged")

    def layer_names(self, layer: int) -> list[str]:
        return [spec.name for spec in layout.layer_tensors(self.config, layer)]

    def layer_bytes(self, layer: int) -> int:
        return sum(self.entries[name].nbytes for name in self.layer_names(layer))

    def shards(self) -> list[Path]:
        return sorted({entry.shard for entry in self.entries.values()})

    def close(self) -> None:
        for buffer in self._maps.values():
            buffer.close()
        self._maps.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _map(self, shard: Path) -> mmap.mmap:
        if shard not in self._maps:
            with open(shard, "rb") as f:
                self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[shard]


def _read_entries(root: Path) -> dict[str, TensorEntry]:
    index_path = root / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise K2Error(f"{index_path}: not a valid index (expected JSON with a 'weight_map' object)") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise K2Error(f"{index_path}: not a valid index ('weight_map' must map tensor names to shard file names)")
        shard_names = sorted(set(weight_map.values()))
        for shard_name in shard_names:  # files of this folder (a Hugging Face cache's links to its blobs are fine)
            if Path(shard_name).name != shard_name or shard_name in ("", ".", ".."):
                raise K2Error(f"{index_path}: shard {shard_name!r} is not a file of the checkpoint folder; refusing it")
    elif (root / SINGLE_FILE).exists():
        weight_map, shard_names = None, [SINGLE_FILE]
    else:
        raise K2Error(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE}; is this a Hugging Face checkpoint directory?")
    entries: dict[str, TensorEntry] = {}
    for shard_name in shard_names:
        shard = root / shard_name
        if shard.exists() and not shard.is_file():
            raise K2Error(f"{root}: shard {shard_name} is not a regular file")
        if not shard.exists():
            wanted = [n for n, s in weight_map.items() if s == shard_name]
            raise K2Error(f"shard {shard_name} is missing from {root} ({len(wanted)} tensors, e.g. {wanted[0]}, live in it)")
        entries.update(read_header(shard))
    if weight_map is not None:
        for name, shard_name in weight_map.items():
            if name not in entries or entries[name].shard.name != shard_name:
                raise K2Error(f"shard {shard_name} lacks tensor {name}, which {INDEX_FILE} says it holds")
    return entries
