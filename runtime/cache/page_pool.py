"""The latent cache's pages, as bookkeeping: which are free, who holds each, and which full pages a later request
may reuse. The entries themselves live where the layers run (host arrays, device memory, a pipeline's stages);
this is the same for all of them.

Prefix reuse: a full page is known by the hash of its tokens chained to the hash of the page before it (and
the artifact's digest, `salt`), so a hash names the whole prefix up to the end of its page. A request takes
the longest chain of cached pages its prompt starts with and holds them read-only (it writes only pages of
its own: only full pages are shared). A page nobody holds keeps its entries and stays findable until it is
needed for new entries: then the least recently released goes first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from ...core.errors import K2Error


class PoolFull(K2Error):
    """No free page and no cached page to evict: a forward needs more pages than the pool has left."""


def chain_hashes(tokens: Sequence[int], page_size: int, salt: bytes, previous: bytes | None = None) -> list[bytes]:
    """The chained hash of each full page of `tokens` (after the page whose hash is `previous`)."""
    hashes, last = [], previous if previous is not None else salt
    ids = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(ids) - page_size + 1, page_size):
        last = hashlib.blake2b(last + ids[start: start + page_size].tobytes(), digest_size=16).digest()
        hashes.append(last)
    return hashes


class PagePool:
    """`pages` pages of `page_size` tokens; with `prefix_cache`, released full pages stay findable by their hash."""

    def __init__(self, pages: int, page_size: int, prefix_cache: bool = True):
        if pages < 1:
            raise K2Error(f"a cache of {pages} pages holds nothing; give it at least one page of {page_size} tokens")
        self.pages, self.page_size, self.prefix_cache = pages, page_size, prefix_cache
        self.free: deque[int] = deque(range(pages))
        self.holders = [0] * pages  # page -> how many requests hold it
        self.hash_of: dict[int, bytes] = {}  # cached page -> its chain hash
        self.page_of: dict[bytes, int] = {}  # chain hash -> the page holding that prefix
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached pages nobody holds, least recently released first
        self.evicted = 0  # cached pages given up for new entries

    @property
    def available(self) -> int:
        """Pages a request can take now: free ones and cached ones nobody holds."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        """Pages some request holds."""
        return self.pages - self.available

    @property
    def cached(self) -> int:
        """Pages findable by their prefix (held or not)."""
        return len(self.hash_of)

    def take(self) -> int:
        """A page for new entries: a free one, else the least recently released cached one (forgotten) -> its id;
        PoolFull when every page is held."""
        if self.free:
            page = self.free.popleft()
        elif self.idle:
            page, _ = self.idle.popitem(last=False)
            del self.page_of[self.hash_of.pop(page)]
            self.evicted += 1
        else:
            raise PoolFull(f"the cache's {self.pages} pages of {self.page_size} tokens are all in use")
        self.holders[page] = 1
        return page

    def reuse(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest cached chain `hashes` starts with, now held by the caller too."""
        found = []
        for digest in hashes:
            page = self.page_of.get(digest)
            if page is None:
                break
            found.append(page)
        for page in found:
            self.holders[page] += 1
            self.idle.pop(page, None)
        return found

    def publish(self, page: int, digest: bytes) -> None:
        """A page its holder has filled, findable by its chain hash from now on (unless another page holds the
        same prefix already, or prefix reuse is off)."""
        if self.prefix_cache and digest not in self.page_of and page not in self.hash_of:
            self.page_of[digest], self.hash_of[page] = page, digest

    def drop(self, pages: Sequence[int]) -> None:
        """The caller holds these pages no more: cached ones nobody holds wait to be reused, the others are free."""
        for page in pages:
            self.holders[page] -= 1
            if self.holders[page] == 0:
                if page in self.hash_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def forget(self) -> None:
        """No page is findable any more (their entries may be gone: a pipeline stage restarted); idle ones are free."""
        self.free.extend(self.idle)
        self.idle.clear()
        self.hash_of.clear()
        self.page_of.clear()
