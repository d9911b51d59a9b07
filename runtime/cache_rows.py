"""Some rows (slots) of a LatentCache, in the order of one forward's batch: `LatentCache.rows(slots)`.

`OrtModel.forward` runs every row of the cache it is given: a layer graph reads the first t
positions of every row. Running the whole slot table each step would put the idle slots
through attention and MoE routing too (on `small`, 16 rows route 128 token-expert pairs, which
turns a lone request's decode from its 8 chosen experts into all 64). So each forward gets only
the rows of the requests it runs: this object answers the calls forward makes on a cache
(`lengths`, `past_inputs`, `new_entry_buffers`, `ortvalue`, `store`) for those rows. Their past
entries are gathered into one contiguous block per layer (a copy, unless the rows are the whole
cache in order); the new entries are written back into the slots. `commit` records the new
lengths in the cache.
"""

from __future__ import annotations

import numpy as np
from onnxruntime import OrtValue

from .kv_cache import LatentCache


class CacheRows:
    def __init__(self, cache: LatentCache, slots: list[int]):
        self.cache = cache
        self.slots = np.asarray(slots, dtype=np.int64)
        self.whole = np.array_equal(self.slots, np.arange(len(cache.lengths)))
        self.lengths = cache.lengths[self.slots]  # a copy; forward replaces it with the grown lengths

    def past_inputs(self, layer: int, past: int) -> dict[str, OrtValue]:
        if self.whole:
            return self.cache.past_inputs(layer, past)
        cache = self.cache

        def gathered(array: np.ndarray) -> np.ndarray:  # [past, rows, ...], contiguous (OrtValues ignore strides)
            return np.ascontiguousarray(array[layer, :past][:, self.slots])

        inputs = {
            "past_latent": OrtValue.ortvalue_from_numpy_with_onnx_type(gathered(cache.latent), cache.latent_type),
            "past_rope": OrtValue.ortvalue_from_numpy(gathered(cache.rope)),
        }
        if cache.latent_scale is not None:
            inputs["past_latent_scale"] = OrtValue.ortvalue_from_numpy(gathered(cache.latent_scale))
        return inputs

    def new_entry_buffers(self, batch: int, seq: int) -> dict[str, np.ndarray]:
        return self.cache.new_entry_buffers(batch, seq)

    def ortvalue(self, name: str, array: np.ndarray) -> OrtValue:
        return self.cache.ortvalue(name, array)

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray, entries: dict[str, np.ndarray]) -> None:
        if self.whole:
            self.cache.store(layer, positions, valid, entries)
            return
        rows = len(self.cache.lengths)

        def scattered(array: np.ndarray) -> np.ndarray:  # batch rows -> their slots in a [rows, ...] array
            out = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
            out[self.slots] = array
            return out

        self.cache.store(layer, scattered(positions), scattered(valid),
                         {name: scattered(array) for name, array in entries.items()})

    def commit(self) -> None:
        """After a forward: the slots hold the tokens it added."""
        self.cache.lengths[self.slots] = self.lengths
