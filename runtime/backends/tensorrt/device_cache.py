"""The latent cache's pages in device memory (`runtime.cache.EntryStore`), and their view for one forward, for the
TensorRT engines.

Layout as on the host (`kv_cache.LatentPages`): per array of the artifact's `CacheFormat` [layers, pages,
PAGE_SIZE, width], each layer's pool starting 256-byte aligned, as TensorRT wants its tensor addresses. An
engine takes a layer's pool whole, in place, with the forward's page table (copied to the device once per
forward) and gathers its rows' pages itself. New entries go from the layers' output buffers into their pages:
a run of consecutive positions inside one page of one row is one copy.
"""

from __future__ import annotations

import numpy as np

from ....core.cache_format import PAGE_SIZE, CacheFormat
from ...cache.slots import CacheView, EntryStore


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


class DevicePages(EntryStore):
    """Pools [layers, pages, PAGE_SIZE, width] per array in device memory, zeroed."""

    def __init__(self, kv_cache: dict, layers: int, pages: int, cuda, stream):
        self.format = CacheFormat.from_manifest(kv_cache)
        self.pages, self.cuda, self.stream = pages, cuda, stream
        self.token_bytes = {spec.name: spec.token_bytes for spec in self.format.arrays}  # per token
        # one layer's [pages, PAGE_SIZE, width] pool per array, padded so that every layer starts 256-byte aligned
        self.layer_bytes = {name: aligned(pages * PAGE_SIZE * w) for name, w in self.token_bytes.items()}
        self.buffers = {name: DeviceBuffer(cuda, layers * size) for name, size in self.layer_bytes.items()}
        for buffer in self.buffers.values():
            cuda.memset(buffer.pointer, buffer.nbytes, stream)
        # a view's scratch, kept here so that the server's steps reuse it (it grows to the largest need seen)
        # instead of allocating each step: the page table, and where the layers write their new entries
        self.table = DeviceBuffer(cuda)
        self.new = {name: DeviceBuffer(cuda) for name in self.token_bytes}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def layer_address(self, name: str, layer: int) -> int:
        """Device address of page 0, position 0 of one layer's pool."""
        return self.buffers[name].pointer + layer * self.layer_bytes[name]

    def view(self, page_table: np.ndarray) -> DevicePagesView:
        return DevicePagesView(self, page_table)


class DevicePagesView(CacheView):
    """Rows of a DevicePages through their page table; its inputs are (shape, device address) pairs, its outputs
    device addresses."""

    def __init__(self, store: DevicePages, page_table: np.ndarray):
        super().__init__(page_table)
        self.pages = store
        self.table_address = 0  # past_table on the device, once new_entries has put it there

    def past_inputs(self, layer: int) -> dict[str, tuple[tuple[int, ...], int]]:
        store = self.pages
        inputs = {"page_table": (self.past_table.shape, self.table_address)}
        for spec in store.format.arrays:
            inputs[f"{spec.name}_pages"] = ((store.pages, PAGE_SIZE, spec.width), store.layer_address(spec.name, layer))
        return inputs

    def new_entries(self, positions: np.ndarray) -> dict[str, int]:
        self.hold_past(positions)
        store = self.pages
        self.table_address = store.table.ensure(self.past_table.nbytes)
        if self.past_table.size:
            store.cuda.to_device(self.table_address, self.past_table, store.stream)
        rows, seq = positions.shape
        return {f"new_{name}": self.pages.new[name].ensure(rows * seq * width)
                for name, width in self.pages.token_bytes.items()}

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray) -> None:
        store = self.pages
        s = positions.shape[1]
        for row in range(len(self.page_table)):
            steps = np.flatnonzero(valid[row])
            if not steps.size:
                continue
            at = positions[row, steps]
            # runs of consecutive steps at consecutive positions inside one page: one copy each
            breaks = np.flatnonzero((np.diff(steps) != 1) | (np.diff(at) != 1) | (np.diff(at // PAGE_SIZE) != 0)) + 1
            for run in np.split(np.arange(len(steps)), breaks):
                first, count, position = int(steps[run[0]]), len(run), int(at[run[0]])
                slot = int(self.page_table[row, position // PAGE_SIZE]) * PAGE_SIZE + position % PAGE_SIZE
                for name, width in store.token_bytes.items():
                    dst = store.layer_address(name, layer) + slot * width
                    src = store.new[name].pointer + (row * s + first) * width
                    store.cuda.copy_2d(dst, width, src, width, width, count, store.stream)


__all__ = ["DeviceBuffer", "DevicePages", "DevicePagesView"]
