"""The whole model of a cpu-target artifact through the native step (runtime/backends/native/decoder.py): the backend that
`--decode auto` (where it measured no slower than the graphs, runtime/backends/native/choice.py) and `--decode native` give.

Every valid token of a forward, a prompt's or decode's one a row, is one entry of a batch of native steps,
STEP_BATCH at a time, each with its row's pages: each layer stores every entry before its attention, which reads
positions up to its own, so a prompt's tokens see each other causally. Each token's result is the one it gets
alone, whatever else is in the batch and however a prompt is chunked (batch-invariant: a request's tokens and
logprobs do not depend on the other requests of its steps). The layer graphs are not loaded: the process holds
the weights once, in the native step's tiles. As a pipeline stage (runtime/stages/pipeline.py) it runs its
NativeDecoder's range of layers: from token ids where the range starts at layer 0, else from the previous stage's
hidden state; the head where it ends at the last.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from ....core.manifest import Manifest
from ...cache.slots import CacheView, SlotView
from ..interface import InProcess
from ..onnx.host_pages import HostCache, LatentPagesView
from .decoder import STEP_BATCH, NativeDecoder


class NativeModel(HostCache, InProcess):
    """An artifact's embedding, decoder layers and head through one NativeDecoder (runtime/backends/interface.py's
    Model), or a stage's range of them."""

    prefill_scores_budget = None  # its attention takes a prompt's chunk in row tiles of fixed scratch, however long
    exact_positions = True  # a forward of several positions gives each the logits it gets alone (drafts are exact)

    def __init__(self, manifest: Manifest, native: NativeDecoder, decode_kernels: str):
        """decode_kernels: which kernels run it and why, as `generate`, `bench` and `serve` report it."""
        self.manifest, self.native, self.decode_kernels = manifest, native, decode_kernels
        self.config, self.kv_cache = manifest.config, manifest.kv_cache
        self.threads = native.threads
        self.layers, self.first, self.last = native.layer_range, native.first, native.last
        self.num_layers = len(native.layer_range)
        self.stage_seconds: dict[str, float] = defaultdict(float)  # cumulative time per stage, for benchmarks
        self.salt = manifest.digest.encode()  # keys the cache's prefix hashes to this artifact

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView) -> np.ndarray:
        """token_ids, positions, valid [b, s] (rows right-padded) -> hidden [b, s, m]; the view's rows gain the
        valid entries (each row holds exactly positions[i, 0] tokens; its pages are reserved for the new ones)."""
        return self.run(token_ids, positions, valid, view.entries())

    def run(self, inputs: np.ndarray, positions: np.ndarray, valid: np.ndarray, entries: CacheView) -> np.ndarray:
        """As forward, through the entries' view (host pages); a stage that does not start at layer 0 takes the
        previous stage's hidden [b, s, m] in place of token ids. Masked tokens leave their pages alone (their hidden
        rows are zeros)."""
        if not isinstance(entries, LatentPagesView):
            raise TypeError(f"the native step runs over a cache in host memory, not {type(entries).__name__}")
        started = time.perf_counter()
        rows, cols = np.nonzero(valid)
        hidden = np.zeros((*positions.shape, self.config.hidden_size), np.float32)
        for at in range(0, len(rows), STEP_BATCH):
            r, c = rows[at:at + STEP_BATCH], cols[at:at + STEP_BATCH]
            tables, arrays = entries.page_table[r], entries.pages.arrays
            hidden[r, c] = (self.native.steps(inputs[r, c], positions[r, c], tables, arrays) if self.first else
                            self.native.layer_steps(inputs[r, c], positions[r, c], tables, arrays))
        self.stage_seconds["native_step" if positions.shape[1] == 1 else "native_prefill"] += time.perf_counter() - started
        return hidden

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [b, s, m] -> logits [b, s, vocab] float32: the final norm and the head."""
        started = time.perf_counter()
        logits = self.native.logits(hidden)
        self.stage_seconds["head"] += time.perf_counter() - started
        return logits
