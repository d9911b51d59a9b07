"""One forward of the step loop, for generate, score, bench and serve: a prompt chunk or a decode token for
some slots of a cache, padded into one batch, run through a view of those slots, committed, and the logits
the caller samples from."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..cache.slots import Cache
from ..backends.interface import Model


class BatchForward:
    def __init__(self, model: Model, cache: Cache):
        self.model = model
        self.cache = cache

    def prefill(self, slots: Sequence[int], chunks: list[list[int]], every_position: bool = False) -> np.ndarray:
        """Each slot's next prompt chunk after what it holds (rows right-padded to the longest) -> logits at each
        row's last chunk token [rows, vocab], or with `every_position` at every position [rows, s, vocab]."""
        lengths = np.array([len(c) for c in chunks])
        token_ids = np.zeros((len(chunks), int(lengths.max())), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            token_ids[row, : len(chunk)] = chunk
        steps = np.arange(token_ids.shape[1], dtype=np.int64)
        positions = self.cache.lengths[slots][:, None] + steps  # [rows, s]: after what each slot holds
        return self._run(slots, token_ids, positions, steps < lengths[:, None], None if every_position else lengths - 1)

    def decode(self, slots: Sequence[int], tokens: np.ndarray, active: np.ndarray | None = None) -> np.ndarray:
        """One token per slot [rows] after what it holds -> logits [rows, vocab]; inactive rows (a static batch's
        finished sequences) run masked and leave their slots alone."""
        token_ids = np.asarray(tokens, dtype=np.int64)[:, None]
        positions = self.cache.lengths[slots][:, None].copy()
        valid = np.ones_like(token_ids, dtype=bool) if active is None else np.asarray(active)[:, None]
        return self._run(slots, token_ids, positions, valid, np.zeros(len(slots), dtype=np.int64))

    def verify(self, slots: Sequence[int], chunks: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Each slot's last token and its drafted ones, after what it holds (rows right-padded) -> (logits at every
        position [rows, s, vocab], positions [rows, s]); nothing is committed: `keep` then keeps each row's
        accepted part."""
        lengths = np.array([len(c) for c in chunks])
        token_ids = np.zeros((len(chunks), int(lengths.max())), dtype=np.int64)
        for row, chunk in enumerate(chunks):
            token_ids[row, : len(chunk)] = chunk
        steps = np.arange(token_ids.shape[1], dtype=np.int64)
        positions = self.cache.lengths[slots][:, None] + steps
        valid = steps < lengths[:, None]
        self.cache.reserve(slots, np.where(valid, positions + 1, 0).max(axis=1))
        return self.model.forward_logits(token_ids, positions, valid, self.cache.view(slots), None), positions

    def keep(self, slot: int, tokens: list[int]) -> None:
        """After `verify`: the slot holds `tokens` (its last token and the accepted drafts) past what it held; the
        entries of rejected drafts are dropped with any page only they filled."""
        self.cache.keep(slot, tokens)

    def _run(self, slots: Sequence[int], token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray,
             last: np.ndarray | None) -> np.ndarray:
        self.cache.reserve(slots, np.where(valid, positions + 1, 0).max(axis=1))
        view = self.cache.view(slots)
        logits = self.model.forward_logits(token_ids, positions, valid, view, last)
        view.grow(positions, valid)
        view.commit(token_ids, valid)
        return logits
