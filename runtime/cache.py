"""The cache contract: what the step loop and the backends ask of a KV cache, whoever holds its entries (host
memory, device memory, a pipeline's stages; next, a paged token pool).

A cache has slots; a sequence takes one with `admit` and gives it back with `release`. A forward runs some
slots, in the order of its batch, through a view (`cache.view(slots)`): it reads their past entries, writes
the new ones into their slots and leaves the grown lengths in the view; only `view.commit()` makes them the
cache's. So a forward that fails half-way leaves the cache's lengths as they were, and its slots' stale
entries stay masked.

Entries: per layer and token, the arrays of `core.cache_format.CacheFormat.arrays` (latent, rope[,
latent_scale]). A layer graph reads its rows' past as past_<name> [past, rows, width] (time-major: one
contiguous block) and writes its new entries as new_<name> [rows, s, width].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.errors import K2Error


def check_room(positions: np.ndarray, valid: np.ndarray, max_len: int) -> None:
    """A K2Error when a valid position [rows, s] lies past the `max_len` positions a slot holds."""
    if np.any(valid & (positions >= max_len)):
        raise K2Error(f"sequence reaches position {int(positions[valid].max())}, past the cache's {max_len} positions")


class SlotView:
    """Some slots of a cache in the order of one forward's batch, and their lengths. On its own, the view of a
    cache whose entries live elsewhere (a pipeline's driver: its stages hold them)."""

    def __init__(self, cache: Cache, slots: Sequence[int]):
        self.slots = np.asarray(slots, dtype=np.int64)  # [rows]: row i of the batch is slot slots[i]
        capacity = len(cache.lengths)
        if len(set(self.slots.tolist())) != len(self.slots) or not all(0 <= s < capacity for s in self.slots):
            raise K2Error(f"a cache view of slots {self.slots.tolist()}: they are not distinct slots of a "
                          f"{capacity}-slot cache")
        # the whole cache in its own order: views bind its arrays in place, else they gather these rows
        self.whole = np.array_equal(self.slots, np.arange(capacity))
        self.lengths = cache.lengths[self.slots]  # [rows] int64, a copy; a forward leaves it grown
        self.cache = cache

    def grow(self, positions: np.ndarray, valid: np.ndarray) -> None:
        """After a forward wrote the valid positions [rows, s]: the rows' lengths grown (not yet the cache's)."""
        self.lengths = np.maximum(self.lengths, np.where(valid, positions + 1, 0).max(axis=1))

    def commit(self) -> None:
        """After a forward: the slots hold the tokens it added."""
        self.cache.lengths[self.slots] = self.lengths


class CacheView(SlotView, ABC):
    """The view of a cache that holds the entries of the layers this process runs: what a backend binds.

    One forward: `new_entries(s)` once, then per layer `past_inputs(layer, past)` and the graph's run into
    the new entries, then `store(layer, positions, valid)`; at the end `grow(positions, valid)`.
    """

    @abstractmethod
    def past_inputs(self, layer: int, past: int) -> dict[str, Any]:
        """The first `past` positions of one layer for these rows, by graph input name (past_<name>
        [past, rows, width]), as the backend binds them (an OrtValue; a (shape, device address) pair)."""

    @abstractmethod
    def new_entries(self, seq: int) -> dict[str, Any]:
        """Where each layer of this forward writes its new entries, by graph output name (new_<name>
        [rows, seq, width]), as the backend binds them; the same buffers for every layer."""

    @abstractmethod
    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray) -> None:
        """Writes the valid new entries a layer just wrote, at their positions [rows, s], into the rows' slots."""


class Cache(ABC):
    """`lengths` [slots] int64: the tokens each slot holds; stale entries past a slot's length stay masked."""

    def __init__(self, slots: int):
        self.lengths = np.zeros(slots, dtype=np.int64)

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the cache holds for its entries."""

    @abstractmethod
    def view(self, slots: Sequence[int]) -> SlotView:
        """The slots one forward runs, in its batch's order (a CacheView where this cache holds entries)."""

    def admit(self, slot: int, tokens: Sequence[int]) -> int:
        """A sequence whose prompt is `tokens` takes a free slot -> how many of them the slot already holds (a
        cache that reuses prefixes finds some, at most len(tokens) - 1; this one starts empty: 0)."""
        self.lengths[slot] = 0
        return 0

    def release(self, slot: int) -> None:
        """Frees a slot for the next sequence (its stale entries stay masked: length 0)."""
        self.lengths[slot] = 0
