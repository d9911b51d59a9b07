"""The latent cache of `kv_cache.LatentCache` in device memory, and the rows of it one forward runs.

Layout as on the host, time-major: per array [layers, max_len, batch, width], so that the first
`past` positions of a layer are one contiguous [past, batch, width] block, which an engine reads
in place (each layer's block starts 256-byte aligned, as TensorRT wants its tensor addresses). Copies between positions and rows are cudaMemcpy2DAsync calls on the model's stream:
a run of consecutive positions of one row is one 2-D copy (rows are `batch * width` bytes apart).
"""

from __future__ import annotations

import numpy as np

from ...core.cache_format import CacheFormat
from ...core.errors import K2Error


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


def entry_widths(kv_cache: dict) -> dict[str, int]:
    """Bytes per token and row of each cache array: latent (e4m3 or bf16), rope (bf16), latent_scale (fp32)."""
    fmt = CacheFormat.from_manifest(kv_cache)
    widths = {"latent": fmt.latent_dim * (1 if fmt.scaled else 2), "rope": 2 * fmt.rope_dim}
    if fmt.scaled:
        widths["latent_scale"] = 4 * fmt.scales_per_token
    return widths


class DeviceLatentCache:
    """Arrays [layers, max_len, batch, ...] in device memory, zeroed; `lengths` [batch] on the host."""

    def __init__(self, kv_cache: dict, layers: int, batch: int, max_len: int, cuda, stream):
        self.format, self.max_len, self.batch, self.cuda, self.stream = kv_cache["format"], max_len, batch, cuda, stream
        self.widths = entry_widths(kv_cache)
        # one layer's [max_len, batch, width] block per array, padded so that every layer starts 256-byte aligned
        self.layer_bytes = {name: aligned(max_len * batch * w) for name, w in self.widths.items()}
        self.buffers = {name: DeviceBuffer(cuda, layers * size) for name, size in self.layer_bytes.items()}
        for buffer in self.buffers.values():
            cuda.memset(buffer.pointer, buffer.nbytes, stream)
        self.lengths = np.zeros(batch, dtype=np.int64)
        # where DeviceCacheRows gather some slots' past, one layer at a time: kept here, so that the server's
        # steps reuse them (they grow to the longest past seen) instead of allocating each step
        self.gathered = {name: DeviceBuffer(cuda) for name in self.widths}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def layer_address(self, name: str, layer: int) -> int:
        """Device address of position 0, row 0 of one layer's array."""
        return self.buffers[name].pointer + layer * self.layer_bytes[name]

    def past_address(self, name: str, layer: int, past: int) -> int:
        """Device address of a layer's first `past` positions: one contiguous [past, batch, ...] block."""
        return self.layer_address(name, layer)

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray, entries: dict[str, int],
              slots: np.ndarray | None = None) -> None:
        """Copies the valid new entries ([b, s, ...] device buffers) to their positions, on the device.
        Entry row i goes to cache row slots[i] (default: row i)."""
        b, s = positions.shape
        slots = np.arange(b) if slots is None else slots
        if np.any(valid & (positions >= self.max_len)):
            raise K2Error(f"sequence reaches position {int(positions[valid].max())}, past the cache's "
                          f"{self.max_len} positions")
        for row in range(b):
            steps = np.flatnonzero(valid[row])
            if not steps.size:
                continue
            # runs of consecutive steps at consecutive positions: one 2-D copy each
            breaks = np.flatnonzero((np.diff(steps) != 1) | (np.diff(positions[row, steps]) != 1)) + 1
            for run in np.split(steps, breaks):
                first, count, position = int(run[0]), len(run), int(positions[row, run[0]])
                for name, width in self.widths.items():
                    dst = self.layer_address(name, layer) + (position * self.batch + int(slots[row])) * width
                    src = entries[name] + (row * s + first) * width
                    self.cuda.copy_2d(dst, self.batch * width, src, width, width, count, self.stream)

    def rows(self, slots: list[int]) -> DeviceCacheRows:
        """The cache as one forward over the given slots (in that order) sees it."""
        return DeviceCacheRows(self, slots)

    def release(self, row: int) -> None:
        self.lengths[row] = 0


class DeviceCacheRows:
    """Some slots of a DeviceLatentCache as a cache of their own, for the server's forwards.

    An engine reads a layer's past as one contiguous [past, rows, ...] block, so the slots' past
    entries are gathered into a scratch buffer before each layer (one 2-D copy per slot and array),
    unless the slots are the whole cache in order; new entries go straight to their slots.
    `commit` records the grown lengths in the cache.
    """

    def __init__(self, cache: DeviceLatentCache, slots: list[int]):
        if len(set(slots)) != len(slots) or not all(0 <= s < cache.batch for s in slots):
            raise K2Error(f"cache rows {slots} are not distinct slots of a {cache.batch}-slot cache")
        self.cache, self.slots, self.batch = cache, np.asarray(slots, dtype=np.int64), len(slots)
        self.whole = np.array_equal(self.slots, np.arange(cache.batch))
        self.lengths = cache.lengths[self.slots]  # a copy; forward replaces it with the grown lengths

    def past_address(self, name: str, layer: int, past: int) -> int:
        if self.whole:
            return self.cache.past_address(name, layer, past)
        cache, width = self.cache, self.cache.widths[name]
        scratch = cache.gathered[name].ensure(past * self.batch * width)
        if past:
            for row, slot in enumerate(self.slots):
                cache.cuda.copy_2d(scratch + row * width, self.batch * width,
                                   cache.layer_address(name, layer) + int(slot) * width, cache.batch * width,
                                   width, past, cache.stream)
        return scratch

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray, entries: dict[str, int]) -> None:
        self.cache.store(layer, positions, valid, entries, slots=self.slots)

    def commit(self) -> None:
        """After a forward: the slots hold the tokens it added."""
        self.cache.lengths[self.slots] = self.lengths


__all__ = ["DeviceBuffer", "DeviceCacheRows", "DeviceLatentCache", "entry_widths"]
