"""The latent cache in device memory, and its view for one forward (`runtime.cache.Cache`'s contract), for the
TensorRT engines.

Layout as on the host (`kv_cache.LatentCache`), time-major: per array of the artifact's `CacheFormat`
[layers, max_len, batch, width], so that the first `past` positions of a layer are one contiguous
[past, batch, width] block, which an engine reads in place (each layer's block starts 256-byte aligned,
as TensorRT wants its tensor addresses). Copies between positions and rows are cudaMemcpy2DAsync calls
on the model's stream: a run of consecutive positions of one row is one 2-D copy (rows are
`batch * token_bytes` bytes apart).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...core.cache_format import CacheFormat
from ..cache import Cache, CacheView, check_room


ALIGN = 256  # TensorRT wants every tensor address 256-byte aligned (and non-null, even when empty)


def aligned(nbytes: int) -> int:
    return -(-int(nbytes) // ALIGN) * ALIGN


class DeviceBuffer:
    """A growable device allocation, never empty (so its address is never null)."""

    def __init__(self, cuda, nbytes: int = 0):
        self.cuda, self.nbytes, self.pointer = cuda, 0, 0
        self.ensure(nbytes)

    def ensure(self, nbytes: int) -> int:
        nbytes = max(aligned(nbytes), ALIGN)
        if nbytes > self.nbytes:
            if self.pointer:
                self.cuda.device_synchronize()  # queued work may still read the old allocation
                self.cuda.free(self.pointer)
            self.pointer, self.nbytes = self.cuda.malloc(nbytes), nbytes
        return self.pointer

    def __del__(self):
        if getattr(self, "pointer", 0):
            try:
                self.cuda.free(self.pointer)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class DeviceLatentCache(Cache):
    """Arrays [layers, max_len, batch, width] in device memory, zeroed; `lengths` [batch] on the host."""

    def __init__(self, kv_cache: dict, layers: int, batch: int, max_len: int, cuda, stream):
        super().__init__(batch)
        self.format = CacheFormat.from_manifest(kv_cache)
        self.max_len, self.batch, self.cuda, self.stream = max_len, batch, cuda, stream
        self.token_bytes = {spec.name: spec.token_bytes for spec in self.format.arrays}  # per token and row
        # one layer's [max_len, batch, width] block per array, padded so that every layer starts 256-byte aligned
        self.layer_bytes = {name: aligned(max_len * batch * w) for name, w in self.token_bytes.items()}
        self.buffers = {name: DeviceBuffer(cuda, layers * size) for name, size in self.layer_bytes.items()}
        for buffer in self.buffers.values():
            cuda.memset(buffer.pointer, buffer.nbytes, stream)
        # a view's scratch, kept here so that the server's steps reuse it (it grows to the largest need seen)
        # instead of allocating each step: where some slots' past is gathered, one layer at a time, and where the
        # layers write their new entries
        self.gathered = {name: DeviceBuffer(cuda) for name in self.token_bytes}
        self.new = {name: DeviceBuffer(cuda) for name in self.token_bytes}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def layer_address(self, name: str, layer: int) -> int:
        """Device address of position 0, row 0 of one layer's array."""
        return self.buffers[name].pointer + layer * self.layer_bytes[name]

    def view(self, slots: Sequence[int]) -> DeviceCacheView:
        return DeviceCacheView(self, slots)


class DeviceCacheView(CacheView):
    """Some slots of a DeviceLatentCache, in the order of one forward's batch; its inputs are (shape, device
    address) pairs, its outputs device addresses.

    An engine reads a layer's past as one contiguous [past, rows, width] block: the whole cache in order is
    read in place, else the slots' past is gathered into scratch before each layer (one 2-D copy per slot and
    array). New entries go from the layers' output buffers straight to their slots.
    """

    cache: DeviceLatentCache

    def past_inputs(self, layer: int, past: int) -> dict[str, tuple[tuple[int, ...], int]]:
        return {f"past_{spec.name}": ((past, len(self.slots), spec.width), self._past_address(spec.name, layer, past))
                for spec in self.cache.format.arrays}

    def _past_address(self, name: str, layer: int, past: int) -> int:
        cache, width, rows = self.cache, self.cache.token_bytes[name], len(self.slots)
        if self.whole:
            return cache.layer_address(name, layer)
        scratch = cache.gathered[name].ensure(past * rows * width)
        if past:
            for row, slot in enumerate(self.slots):
                cache.cuda.copy_2d(scratch + row * width, rows * width,
                                   cache.layer_address(name, layer) + int(slot) * width, cache.batch * width,
                                   width, past, cache.stream)
        return scratch

    def new_entries(self, seq: int) -> dict[str, int]:
        return {f"new_{name}": self.cache.new[name].ensure(len(self.slots) * seq * width)
                for name, width in self.cache.token_bytes.items()}

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray) -> None:
        cache = self.cache
        check_room(positions, valid, cache.max_len)
        s = positions.shape[1]
        for row, slot in enumerate(self.slots):
            steps = np.flatnonzero(valid[row])
            if not steps.size:
                continue
            # runs of consecutive steps at consecutive positions: one 2-D copy each
            breaks = np.flatnonzero((np.diff(steps) != 1) | (np.diff(positions[row, steps]) != 1)) + 1
            for run in np.split(steps, breaks):
                first, count, position = int(run[0]), len(run), int(positions[row, run[0]])
                for name, width in cache.token_bytes.items():
                    dst = cache.layer_address(name, layer) + (position * cache.batch + int(slot)) * width
                    src = cache.new[name].pointer + (row * s + first) * width
                    cache.cuda.copy_2d(dst, cache.batch * width, src, width, width, count, cache.stream)


__all__ = ["DeviceBuffer", "DeviceCacheView", "DeviceLatentCache"]
