"""The runtime interface every backend implements: ONNX Runtime (`ort_backend.OrtModel`), TensorRT
(`tensorrt.backend.TrtModel`) and a pipeline of layer-range stages (`pipeline.PipelineModel`, in one process
or on Ray actors). `batch_forward.BatchForward` runs one forward of any of them; the step loop
(`step_loop.StepLoop`) drives it for generate, score, bench and serve.

Each backend has its cache (`cache.Cache`, the contract of caches and their views): a forward runs some of
its slots through a view, `cache.view(slots)`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..core.config import ModelConfig
from .cache import Cache, SlotView


class Model(Protocol):
    config: ModelConfig
    kv_cache: dict  # the manifest's kv_cache entry
    stage_seconds: dict[str, float]  # cumulative seconds per stage (embed, layer_NNN or layers, head), for benchmarks
    threads: int | None  # the size of the host thread pool its graphs run on (None: none, e.g. TensorRT engines)
    num_layers: int  # the decoder layers it runs

    def new_cache(self, batch: int, max_len: int, pages: int | None = None, prefix_cache: bool = True) -> Cache:
        """A cache of `batch` slots of up to `max_len` positions each over a pool of `pages` pages (default: every
        slot at its longest); `prefix_cache` False: no prefix reuse."""

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView) -> np.ndarray:
        """token_ids, positions, valid [b, s] (rows right-padded; row i's slot holds positions[i, 0] tokens and
        has pages reserved for the new ones) -> hidden [b, s, m] float32; the view's pages gain the valid entries
        (`BatchForward` then grows and commits the view)."""

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [b, s, m] -> logits [b, s, vocab] float32.

        Pipeline stages (`pipeline.PipelineModel`), whose head runs on the last stage, give in place of forward
        and logits `forward_logits(token_ids, positions, valid, view, last)`: the forward and the logits at each
        row's position `last` [b, vocab] (at every position [b, s, vocab] when last is None) in one call."""
