"""The preallocated latent KV cache: what MLA keeps per token and layer, in the artifact's format.

One allocation per array for all layers, sliced per layer (arrays [layers, max_len, batch, ...]).
Time-major, so a layer's first t positions for every row are one contiguous block: the
sessions read it in place through zero-copy OrtValues, without copying the cache each step.
The layout of each format is `k2deploy.core.cache_format.CacheFormat`'s: latent bits [L, T, B, c]
(uint8 for fp8 and int8, uint16 for bf16), rope [L, T, B, r] float16 and, for the scaled
formats, latent_scale [L, T, B, c / group] float32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from onnxruntime import OrtValue

from ..core.cache_format import CacheFormat
from ..core.errors import K2Error

if TYPE_CHECKING:
    from .cache_rows import CacheRows

# ONNX TensorProto element types by name (onnx itself is not needed at run time)
ONNX_ELEMENT_TYPES = {"UINT8": 2, "BFLOAT16": 16, "FLOAT8E4M3FN": 17}


class LatentCache:
    def __init__(self, kv_cache: dict, layers: int, batch: int, max_len: int):
        fmt = CacheFormat.from_manifest(kv_cache)
        self.format = fmt.name
        self.max_len = max_len
        self.latent_type = ONNX_ELEMENT_TYPES[fmt.latent_type]
        storage = np.uint8 if fmt.scaled else np.uint16  # one byte per latent value, or bfloat16 bits
        self.latent = np.zeros((layers, max_len, batch, fmt.latent_dim), dtype=storage)
        self.rope = np.zeros((layers, max_len, batch, fmt.rope_dim), dtype=np.float16)
        self.latent_scale = (np.zeros((layers, max_len, batch, fmt.scales_per_token), dtype=np.float32)
                             if fmt.scaled else None)
        self.lengths = np.zeros(batch, dtype=np.int64)  # tokens held per row

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.latent, self.rope, self.latent_scale) if a is not None)

    def bytes_per_token_per_layer(self) -> int:
        layers, max_len, batch = self.latent.shape[:3]
        return self.nbytes // (layers * max_len * batch)

    def past_inputs(self, layer: int, past: int) -> dict[str, OrtValue]:
        """Zero-copy views of the first `past` positions of one layer, as the layer graph's inputs."""
        inputs = {
            "past_latent": OrtValue.ortvalue_from_numpy_with_onnx_type(self.latent[layer, :past], self.latent_type),
            "past_rope": OrtValue.ortvalue_from_numpy(self.rope[layer, :past]),
        }
        if self.latent_scale is not None:
            inputs["past_latent_scale"] = OrtValue.ortvalue_from_numpy(self.latent_scale[layer, :past])
        return inputs

    def new_entry_buffers(self, batch: int, seq: int) -> dict[str, np.ndarray]:
        """Buffers the layer graph writes its s new entries into: new_latent, new_rope[, new_latent_scale]."""
        buffers = {
            "new_latent": np.empty((batch, seq, self.latent.shape[-1]), dtype=self.latent.dtype),
            "new_rope": np.empty((batch, seq, self.rope.shape[-1]), dtype=np.float16),
        }
        if self.latent_scale is not None:
            buffers["new_latent_scale"] = np.empty((batch, seq, self.latent_scale.shape[-1]), dtype=np.float32)
        return buffers

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray, entries: dict[str, np.ndarray]) -> None:
        """Writes the valid new entries [b, s, ...] of one layer at their positions [b, s]."""
        rows, steps = np.nonzero(valid)
        slots = positions[rows, steps]
        if slots.size and slots.max() >= self.max_len:
            raise K2Error(f"sequence reaches position {int(slots.max())}, past the cache's {self.max_len} positions")
        self.latent[layer, slots, rows] = entries["new_latent"][rows, steps]
        self.rope[layer, slots, rows] = entries["new_rope"][rows, steps]
        if self.latent_scale is not None:
            self.latent_scale[layer, slots, rows] = entries["new_latent_scale"][rows, steps]

    def rows(self, slots: list[int]) -> CacheRows:
        """The cache as one forward over the given slots (in that order) sees it."""
        from .cache_rows import CacheRows

        return CacheRows(self, slots)

    def release(self, row: int) -> None:
        """Frees a row's slots for the next sequence (its stale entries stay masked: length 0)."""
        self.lengths[row] = 0

    def ortvalue(self, name: str, array: np.ndarray) -> OrtValue:
        """An output buffer as an OrtValue of the graph's own type (e4m3 and bf16 bits have no numpy type)."""
        if name == "new_latent":
            return OrtValue.ortvalue_from_numpy_with_onnx_type(array, self.latent_type)
        return OrtValue.ortvalue_from_numpy(array)
