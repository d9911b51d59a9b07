"""The runtime interface every backend implements, every method its callers use: ONNX Runtime
(`onnx.model.OrtModel`), the native step (`native.model.NativeModel`), TensorRT (`tensorrt.backend.TrtModel`)
and a pipeline of layer-range stages (`runtime/stages/pipeline.py` `PipelineModel`, in one process or on Ray
actors). `batch_forward.BatchForward` runs one forward of any of them; the step loop
(`step_loop.StepLoop`) drives it for generate, score, bench and serve.

Each backend has its cache (`cache.Cache`, the contract of caches and their views): a forward runs some of
its slots through a view, `cache.view(slots)`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ...core.config import ModelConfig
from ..cache.slots import Cache, SlotView


class Model(Protocol):
    config: ModelConfig
    kv_cache: dict  # the manifest's kv_cache entry
    stage_seconds: dict[str, float]  # cumulative seconds per stage (embed, layer_NNN or layers, head), for benchmarks
    threads: int | None  # the size of the host thread pool its graphs run on (None: none, e.g. TensorRT engines)
    num_layers: int  # the decoder layers it runs
    # (optional) exact_positions: True where a forward of several positions gives each the logits it gets alone, to
    # the bit (the native step): drafted tokens may then be checked in one forward (runtime/engine/speculation.py)

    def new_cache(self, batch: int, max_len: int, pages: int | None = None, prefix_cache: bool = True) -> Cache:
        """A cache of `batch` slots of up to `max_len` positions each over a pool of `pages` pages (default: every
        slot at its longest); `prefix_cache` False: no prefix reuse."""

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView) -> np.ndarray:
        """token_ids, positions, valid [b, s] (rows right-padded; row i's slot holds positions[i, 0] tokens and
        has pages reserved for the new ones) -> hidden [b, s, m] float32; the view's pages gain the valid entries
        (`BatchForward` then grows and commits the view)."""

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [b, s, m] -> logits [b, s, vocab] float32."""

    def forward_logits(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView,
                       last: np.ndarray | None) -> np.ndarray:
        """The forward and the logits at each row's position `last` [b, vocab] (at every position [b, s, vocab]
        where last is None), in one call: what the step loop runs (pipeline stages run the head on the last
        stage)."""

    def problem(self) -> str | None:
        """What is down (a pipeline's stage), in one line; None while everything runs."""

    def release_idle(self) -> None:
        """Lets go of what it holds only to step fast (Ray stages' compiled graph), after a pause in the work;
        the next forward takes it back."""


class InProcess:
    """Model's methods for a backend that runs every layer and the head in this process: forward_logits is its
    forward then its logits, nothing can be down, nothing is held for speed alone."""

    def forward_logits(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView,
                       last: np.ndarray | None) -> np.ndarray:
        return logits_at(self.logits, self.forward(token_ids, positions, valid, view), last)

    def problem(self) -> str | None:
        return None

    def release_idle(self) -> None:
        return None


def logits_at(head, hidden: np.ndarray, last: np.ndarray | None) -> np.ndarray:
    """head (hidden [b, s, m] -> logits [b, s, vocab]) at each row's position `last` -> [b, vocab], or with last
    None at every position -> [b, s, vocab]."""
    if last is None:
        return head(hidden)
    return head(hidden[np.arange(len(hidden)), last][:, None])[:, 0]
