"""The preallocated latent KV cache in host memory, and its view for one forward (`cache.Cache`'s contract).

One allocation per array of the artifact's `CacheFormat` (latent, rope[, latent_scale]) for all layers,
sliced per layer: [layers, max_len, batch, width], in the dtype that stores the graphs' element type.
Time-major, so a layer's first t positions for every row are one contiguous block: the sessions read
it in place through zero-copy OrtValues, without copying the cache each step.

A forward runs only the rows of the requests it serves, not the whole slot table (idle slots would go
through attention and MoE routing too: on `small`, 16 rows route 128 token-expert pairs, which turns a
lone request's decode from its 8 chosen experts into all 64). So unless a view is the whole cache in
order, its rows' past is gathered into one contiguous block per layer (a copy); new entries go back
into their slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnxruntime import OrtValue

from ..core.cache_format import CacheFormat
from .cache import Cache, CacheView, check_room


class LatentCache(Cache):
    """`arrays`: array name -> [layers, max_len, batch, width], zeroed; `lengths` [batch]."""

    def __init__(self, kv_cache: dict, layers: int, batch: int, max_len: int):
        super().__init__(batch)
        self.format = CacheFormat.from_manifest(kv_cache)
        self.max_len = max_len
        self.arrays = {spec.name: np.zeros((layers, max_len, batch, spec.width), dtype=spec.element.storage)
                       for spec in self.format.arrays}

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays.values())

    def view(self, slots: Sequence[int]) -> LatentCacheView:
        return LatentCacheView(self, slots)


class LatentCacheView(CacheView):
    """Some slots of a LatentCache, in the order of one forward's batch; its inputs and outputs are OrtValues."""

    cache: LatentCache

    def __init__(self, cache: LatentCache, slots: Sequence[int]):
        super().__init__(cache, slots)
        self.entries: dict[str, np.ndarray] = {}  # array name -> this forward's new entries [rows, s, width]

    def past_inputs(self, layer: int, past: int) -> dict[str, OrtValue]:
        inputs = {}
        for spec in self.cache.format.arrays:
            block = self.cache.arrays[spec.name][layer, :past]  # [past, batch, width], contiguous
            if not self.whole:
                block = np.ascontiguousarray(block[:, self.slots])  # [past, rows, width] (OrtValues ignore strides)
            inputs[f"past_{spec.name}"] = OrtValue.ortvalue_from_numpy_with_onnx_type(block, spec.element.number)
        return inputs

    def new_entries(self, seq: int) -> dict[str, OrtValue]:
        specs = self.cache.format.arrays
        self.entries = {spec.name: np.empty((len(self.slots), seq, spec.width), dtype=spec.element.storage)
                        for spec in specs}
        return {f"new_{spec.name}": OrtValue.ortvalue_from_numpy_with_onnx_type(self.entries[spec.name],
                                                                                spec.element.number)
                for spec in specs}

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray) -> None:
        check_room(positions, valid, self.cache.max_len)
        rows, steps = np.nonzero(valid)
        at, slots = positions[rows, steps], self.slots[rows]
        for name, array in self.cache.arrays.items():
            array[layer, at, slots] = self.entries[name][rows, steps]
