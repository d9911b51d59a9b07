"""The cache contract: what the step loop and the backends ask of a KV cache, whoever holds its entries (host
memory, device memory, a pipeline's stages).

A cache is a pool of pages (core/cache_format.py PAGE_SIZE tokens each, `page_pool.PagePool`) and slots, one per
running sequence: a slot holds a page table, its pages in position order. A sequence takes a slot with
`admit` (which finds the pages of its prompt's longest cached prefix) and gives it back with `release`.
Before a forward, `reserve` gives each of its slots the pages its new positions need (PoolFull when the pool
has none left). A forward runs some slots, in the order of its batch, through a view (`cache.view(slots)`): its
page table [rows, n] (its first columns, those that hold the past) is what the layer graphs gather the past
from, and the store's view of it
(`view.entries()`) is what a backend binds; the grown lengths stay in the view until `view.commit(...)`
makes them the cache's and records the tokens, so that full pages become findable by their prefix. A
forward that fails half-way leaves the cache's lengths as they were; its stale entries stay masked.

Entries: per layer and token, the arrays of `core.cache_format.CacheFormat.arrays` (latent, rope[,
latent_scale]). A layer graph takes each array's pool whole as <name>_pages [pages, PAGE_SIZE, width] with
the view's `page_table`, and writes its new entries as new_<name> [rows, s, width].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...core.cache_format import PAGE_SIZE
from ...core.errors import K2Error
from .page_pool import PagePool, PoolFull, chain_hashes


def pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-int(tokens) // page_size)


class CacheView(ABC):
    """The entries of some rows, through their page table [rows, n]: what a backend binds for one forward.

    One forward: `new_entries(positions)` once, then per layer `past_inputs(layer)` and the graph's run into the
    new entries, then `store(layer, positions, valid)`.
    """

    def __init__(self, page_table: np.ndarray):
        self.page_table = np.ascontiguousarray(page_table, dtype=np.int64)  # [rows, n] page ids
        self.past_table = self.page_table  # [rows, n_past]: the columns a forward's graphs gather, new_entries sets

    def hold_past(self, positions: np.ndarray) -> None:
        """The page table's first columns that hold every row's past (row i holds positions[i, 0] entries) become
        `past_table` [rows, n_past]: what the layer graphs gather and attend over, masked past each row's own
        length; none for a first prompt chunk. The pages after them hold only this forward's new entries, which
        the graphs take from their own outputs: gathering them too doubled a first chunk's attention."""
        held = int(positions[:, 0].max(initial=0)) if positions.size else 0
        self.past_table = np.ascontiguousarray(self.page_table[:, :pages_for(held)])

    @abstractmethod
    def past_inputs(self, layer: int) -> dict[str, Any]:
        """One layer's pools (<name>_pages [pages, PAGE_SIZE, width]) and the past's page table (`past_table`),
        by graph input name, as the backend binds them (an OrtValue; a (shape, device address) pair)."""

    @abstractmethod
    def new_entries(self, positions: np.ndarray) -> dict[str, Any]:
        """For a forward at positions [rows, s] (`hold_past` first): where each layer writes its new entries, by
        graph output name (new_<name> [rows, s, width]), as the backend binds them; the same buffers for every
        layer."""

    @abstractmethod
    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray) -> None:
        """Writes the valid new entries a layer just wrote, at their positions [rows, s], into the rows' pages."""


class EntryStore(ABC):
    """Where the entries of a cache's pages live for the layers a process runs."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held for entries."""

    @abstractmethod
    def view(self, page_table: np.ndarray) -> CacheView:
        """The rows whose pages `page_table` [rows, n] lists."""

    def copy_page(self, source: int, target: int) -> bool:
        """Copies every layer's entries of page `source` into page `target` -> whether this store can (a store
        that cannot leaves the copy to a recompute)."""
        return False


class SlotView:
    """Some slots of a cache in the order of one forward's batch: their lengths and page table."""

    def __init__(self, cache: Cache, slots: Sequence[int]):
        self.slots = np.asarray(slots, dtype=np.int64)  # [rows]: row i of the batch is slot slots[i]
        capacity = len(cache.lengths)
        if len(set(self.slots.tolist())) != len(self.slots) or not all(0 <= s < capacity for s in self.slots):
            raise K2Error(f"a cache view of slots {self.slots.tolist()}: they are not distinct slots of a "
                          f"{capacity}-slot cache")
        self.lengths = cache.lengths[self.slots]  # [rows] int64, a copy; a forward leaves it grown
        self.cache = cache
        tables = [cache.tables[s] for s in self.slots.tolist()]
        self.page_table = np.zeros((len(tables), max(map(len, tables), default=0)), dtype=np.int64)  # [rows, n]
        for row, table in enumerate(tables):
            self.page_table[row, : len(table)] = table  # shorter rows padded with page 0, masked

    def entries(self) -> CacheView:
        """The store's view of these rows (for a cache whose entries this process holds)."""
        return self.cache.store.view(self.page_table)

    def grow(self, positions: np.ndarray, valid: np.ndarray) -> None:
        """After a forward wrote the valid positions [rows, s]: the rows' lengths grown (not yet the cache's)."""
        self.lengths = np.maximum(self.lengths, np.where(valid, positions + 1, 0).max(axis=1))

    def commit(self, token_ids: np.ndarray, valid: np.ndarray) -> None:
        """After a forward: the slots hold the tokens it added (token_ids, valid [rows, s]), and their pages
        filled by them become findable by their prefix."""
        for row, slot in enumerate(self.slots.tolist()):
            self.cache.record(slot, token_ids[row][valid[row]].tolist())
        self.cache.lengths[self.slots] = self.lengths


class Cache:
    """`slots` sequences of at most `max_len` positions each over a pool of `pages` pages; `store` holds the
    entries where this process runs the layers (None: a pipeline's stages hold them). `salt` (the artifact's
    digest) keys the prefix hashes; `prefix_cache` False turns reuse off."""

    def __init__(self, slots: int, max_len: int, pages: int, store: EntryStore | None, prefix_cache: bool = True,
                 salt: bytes = b""):
        self.lengths = np.zeros(slots, dtype=np.int64)  # [slots]: the tokens each slot holds
        self.max_len = max_len
        self.pool = PagePool(pages, PAGE_SIZE, prefix_cache)
        self.store = store
        self.salt = salt
        self.tables: list[list[int]] = [[] for _ in range(slots)]  # slot -> its pages in position order
        self.tokens: list[list[int]] = [[] for _ in range(slots)]  # slot -> the ids its entries hold
        self.hashes: list[list[bytes]] = [[] for _ in range(slots)]  # slot -> chain hashes of its full pages
        self.reused_tokens = 0  # prompt tokens found in the cache, over the cache's life

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds for its entries (in this process)."""
        return self.store.nbytes if self.store is not None else 0

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def view(self, slots: Sequence[int]) -> SlotView:
        """The slots one forward runs, in its batch's order."""
        return SlotView(self, slots)

    def admit(self, slot: int, tokens: Sequence[int]) -> int:
        """A sequence whose prompt is `tokens` takes a free slot -> how many of them it holds already: the full
        pages of the longest cached prefix, at most len(tokens) - 1 tokens (the last one runs, for its logits)."""
        self.release(slot)
        usable = (len(tokens) - 1) // self.page_size * self.page_size
        hashes = chain_hashes(tokens[:usable], self.page_size, self.salt) if self.pool.prefix_cache else []
        pages = self.pool.reuse(hashes)
        held = len(pages) * self.page_size
        self.tables[slot], self.hashes[slot] = pages, hashes[: len(pages)]
        self.tokens[slot] = list(tokens[:held])
        self.lengths[slot] = held
        self.reused_tokens += held
        return held

    def follow(self, slot: int, source: int, tokens: Sequence[int]) -> int:
        """After admit: a slot whose prompt `tokens` another slot (`source`, a choice of the same prompt) holds
        past the shared full pages takes a copy of that partial page -> the tokens it now holds (at most
        len(tokens) - 1: the last one runs, for its logits). Where the store cannot copy, nothing changes."""
        held, usable = int(self.lengths[slot]), len(tokens) - 1
        theirs = self.tokens[source]
        if (usable <= held or (usable - 1) // self.page_size != held // self.page_size or self.store is None
                or len(theirs) < usable or theirs[:usable] != list(tokens[:usable])):
            return held  # nothing to copy, more than one page of it (no prefix reuse), or another prompt
        try:
            page = self.pool.take()
        except PoolFull:
            return held
        if not self.store.copy_page(self.tables[source][held // self.page_size], page):
            self.pool.drop([page])
            return held
        self.tables[slot].append(page)
        self.tokens[slot] = list(tokens[:usable])
        self.lengths[slot] = usable
        return usable

    def pages_short(self, slots: Sequence[int], lengths: Sequence[int]) -> int:
        """How many pages more than the pool has left giving each slot its first `lengths` positions takes (0 or
        less: they fit)."""
        needed = sum(max(0, pages_for(int(length), self.page_size) - len(self.tables[slot]))
                     for slot, length in zip(slots, lengths))
        return needed - self.pool.available

    def reserve(self, slots: Sequence[int], lengths: Sequence[int]) -> None:
        """Gives each slot the pages for its first `lengths` positions; PoolFull when the pool runs out (the
        pages taken by then stay with their slots)."""
        for slot, length in zip(slots, lengths):
            if length > self.max_len:
                raise K2Error(f"sequence reaches position {int(length) - 1}, past the cache's {self.max_len} positions")
            table = self.tables[slot]
            while len(table) * self.page_size < length:
                table.append(self.pool.take())

    def record(self, slot: int, tokens: list[int]) -> None:
        """The slot's next entries hold `tokens`; the pages they fill are published by their prefix hash."""
        held = self.tokens[slot]
        held += tokens
        full, hashes = len(held) // self.page_size, self.hashes[slot]
        if self.pool.prefix_cache and full > len(hashes):
            first = len(hashes)
            hashes += chain_hashes(held[first * self.page_size: full * self.page_size], self.page_size, self.salt,
                                   hashes[-1] if hashes else None)
            for index in range(first, full):
                self.pool.publish(self.tables[slot][index], hashes[index])

    def keep(self, slot: int, tokens: list[int]) -> None:
        """After a forward that wrote more entries than the slot keeps (drafted tokens checked): it holds `tokens`
        past its length; the pages past them go back to the pool (never published: no prefix hash names them)."""
        self.record(slot, list(tokens))
        self.lengths[slot] += len(tokens)
        table, needed = self.tables[slot], pages_for(int(self.lengths[slot]), self.page_size)
        self.pool.drop(table[needed:][::-1])
        del table[needed:]

    def release(self, slot: int) -> None:
        """Frees a slot for the next sequence: its pages go back to the pool (full ones stay findable), last page
        first, so that a prefix loses its tail to eviction before its head."""
        self.pool.drop(self.tables[slot][::-1])
        self.tables[slot], self.tokens[slot], self.hashes[slot] = [], [], []
        self.lengths[slot] = 0
