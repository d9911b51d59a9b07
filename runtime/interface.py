"""The runtime interface every backend implements: ONNX Runtime (`ort_backend.OrtModel`), TensorRT
(`tensorrt.backend.TrtModel`) and a pipeline of layer-range stages (`pipeline.PipelineModel`, in one process
or on Ray actors). The step loop (`steps.Steps`) drives any of them; generate, score, bench and serve go
through it.

A forward runs some slots of a cache, in the order of its batch, through a view (`cache.rows(slots)`):
it reads their past entries, writes the new ones into their slots and leaves the grown lengths in the
view; only `view.commit()` makes them the cache's. So a forward that fails half-way leaves the cache's
lengths as they were, and its slots' stale entries stay masked.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..core.config import ModelConfig


def grown_lengths(lengths: np.ndarray, positions: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """lengths [rows] after a forward wrote the valid positions [rows, s]: what a forward leaves in its view."""
    return np.maximum(lengths, np.where(valid, positions + 1, 0).max(axis=1))


class CacheView(Protocol):
    lengths: np.ndarray  # [rows] int64: tokens each row holds; a forward leaves them grown

    def commit(self) -> None:
        """After a forward: the slots hold the tokens it added."""


class Cache(Protocol):
    lengths: np.ndarray  # [slots] int64: tokens each slot holds
    nbytes: int

    def rows(self, slots: list[int]) -> CacheView:
        """The slots one forward runs, in its batch's order."""

    def release(self, slot: int) -> None:
        """Frees a slot for the next sequence (its stale entries stay masked: length 0)."""


class Model(Protocol):
    config: ModelConfig
    kv_cache: dict  # the manifest's kv_cache entry
    stage_seconds: dict[str, float]  # cumulative seconds per stage (embed, layer_NNN or layers, head), for benchmarks
    threads: int | None  # the size of the host thread pool its graphs run on (None: none, e.g. TensorRT engines)
    num_layers: int  # the decoder layers it runs

    def new_cache(self, batch: int, max_len: int) -> Cache:
        """A cache of `batch` slots of `max_len` positions each."""

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, rows: CacheView) -> np.ndarray:
        """token_ids, positions, valid [b, s] (rows right-padded; row i's slot holds positions[i, 0] tokens) ->
        hidden [b, s, m] float32; the rows' slots gain the valid entries, `rows.lengths` the grown lengths."""

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [b, s, m] -> logits [b, s, vocab] float32."""
