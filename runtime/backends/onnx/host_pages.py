"""The latent cache's pages in host memory (`cache.EntryStore`), and their view for one forward.

One allocation per array of the artifact's `CacheFormat` (latent, rope[, latent_scale]) for all layers:
[layers, pages, PAGE_SIZE, width], in the dtype that stores the graphs' element type. A layer's pool
[pages, PAGE_SIZE, width] is one contiguous block that the sessions take in place, as a zero-copy OrtValue,
with the forward's page table: the graph gathers its rows' pages itself. Only the new entries are copied,
into their pages, after each layer.
"""

from __future__ import annotations

import numpy as np
from onnxruntime import OrtValue

from ....core.cache_format import PAGE_SIZE, CacheFormat
from ...cache.slots import Cache, CacheView, EntryStore, pages_for


class LatentPages(EntryStore):
    """`arrays`: array name -> [layers, pages, PAGE_SIZE, width], zeroed."""

    def __init__(self, kv_cache: dict, layers: int, pages: int):
        self.format = CacheFormat.from_manifest(kv_cache)
        self.arrays = {spec.name: np.zeros((layers, pages, PAGE_SIZE, spec.width), dtype=spec.element.storage)
                       for spec in self.format.arrays}

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays.values())

    def view(self, page_table: np.ndarray) -> LatentPagesView:
        return LatentPagesView(self, page_table)

    def copy_page(self, source: int, target: int) -> bool:
        for array in self.arrays.values():
            array[:, target] = array[:, source]
        return True


class LatentPagesView(CacheView):
    """Rows of a LatentPages through their page table; its inputs and outputs are OrtValues."""

    def __init__(self, store: LatentPages, page_table: np.ndarray):
        super().__init__(page_table)
        self.pages = store
        self.table_input: OrtValue | None = None  # past_table, once new_entries has set it
        self.entries: dict[str, np.ndarray] = {}  # array name -> this forward's new entries [rows, s, width]

    def past_inputs(self, layer: int) -> dict[str, OrtValue]:
        inputs = {"page_table": self.table_input}
        for spec in self.pages.format.arrays:
            inputs[f"{spec.name}_pages"] = OrtValue.ortvalue_from_numpy_with_onnx_type(
                self.pages.arrays[spec.name][layer], spec.pages_element.number)  # [pages, PAGE_SIZE, width]
        return inputs

    def new_entries(self, positions: np.ndarray) -> dict[str, OrtValue]:
        self.hold_past(positions)
        self.table_input = OrtValue.ortvalue_from_numpy(self.past_table)
        seq, specs = positions.shape[1], self.pages.format.arrays
        rows = len(self.page_table)
        self.entries = {spec.name: np.empty((rows, seq, spec.width), dtype=spec.element.storage) for spec in specs}
        return {f"new_{spec.name}": OrtValue.ortvalue_from_numpy_with_onnx_type(self.entries[spec.name],
                                                                                spec.element.number)
                for spec in specs}

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray) -> None:
        rows, steps = np.nonzero(valid)
        at = positions[rows, steps]
        pages, offsets = self.page_table[rows, at // PAGE_SIZE], at % PAGE_SIZE
        for name, array in self.pages.arrays.items():
            array[layer, pages, offsets] = self.entries[name][rows, steps]


class HostCache:
    """new_cache and new_store of a model whose cache lives in host memory (ONNX Runtime's graphs, the native
    step); the model has kv_cache, num_layers and salt (its artifact's digest, which keys the prefix hashes)."""

    kv_cache: dict
    num_layers: int
    salt: bytes

    def new_cache(self, batch: int, max_len: int, pages: int | None = None, prefix_cache: bool = True) -> Cache:
        """`batch` sequences of up to `max_len` positions over `pages` pages (default: enough for every sequence at
        its longest)."""
        pages = pages or batch * pages_for(max_len)
        return Cache(batch, max_len, pages, self.new_store(pages), prefix_cache, self.salt)

    def new_store(self, pages: int) -> LatentPages:
        """The entries of `pages` pages for this model's layers, in host memory."""
        return LatentPages(self.kv_cache, self.num_layers, pages)
