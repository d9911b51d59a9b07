"""Who runs in the next step: a first-come queue of waiting requests and the cache slots of the running ones (a
request is admitted when a slot is free and the cache has pages for its prompt; a preempted one waits first in
line), which prompt chunks run together and how long they are, who waits for another's prefill to share its
pages, and whom to preempt when pages run out.

The HTTP side submits and cancels from the event loop; the engine thread admits, and lets
requests leave, at step boundaries. One lock guards the queue and the slot table.
"""

from __future__ import annotations

import threading
from collections import deque

from ...core.sizes import ATTENTION_SCORES_BYTES, MIN_PREFILL_CHUNK, prefill_chunk
from ..cache.slots import Cache, pages_for
from .requests import GenerationRequest


class QueueFull(Exception):
    """Every slot is taken and the queue holds --max-queue requests already."""


class Scheduler:
    def __init__(self, slots: int, max_queue: int, cache: Cache | None = None, heads: int = 1,
                 scores_budget: int | None = ATTENTION_SCORES_BYTES):
        """cache: the pool the slots' pages come from (None: admission does not check pages); heads: the model's
        attention heads (prefill chunks are sized to keep their scores within scores_budget; None: the model's
        attention takes any chunk in the same memory)."""
        self.max_queue = max_queue
        self.cache, self.heads, self.scores_budget = cache, heads, scores_budget
        self.slots: list[GenerationRequest | None] = [None] * slots  # slot -> the request holding it
        self.waiting: deque[GenerationRequest] = deque()
        self.lock = threading.Condition()

    def submit(self, request: GenerationRequest) -> None:
        """Queues a request; QueueFull when the free slots and the queue's room are both used up."""
        with self.lock:
            if len(self.waiting) >= self.free_slots() + self.max_queue:
                raise QueueFull()
            self.waiting.append(request)
            self.lock.notify()

    def wait_for_work(self, timeout: float) -> bool:
        """Blocks until a request waits or runs (True) or the timeout passes (False)."""
        with self.lock:
            return self.lock.wait_for(lambda: self.waiting or any(self.slots), timeout)

    def admit(self) -> list[GenerationRequest]:
        """Moves waiting requests, first come first served, into free slots (lowest first) while the next one
        `fits` (the cache has the pages for it); drops cancelled ones. A request that waits for another's prefill
        (its `after`: another choice of its prompt, or the `leader` still prefilling its prompt's first page)
        keeps its place while later ones are admitted."""
        with self.lock:
            pending = deque(r for r in self.waiting if not r.cancelled)
            free = [slot for slot, holder in enumerate(self.slots) if holder is None]
            admitted, skipped = [], deque()
            while pending and free:
                request = pending[0]
                if request.after is None:
                    request.after = self.leader(request)
                if not request.ready:
                    skipped.append(pending.popleft())
                    continue
                if not self.fits(request):
                    break
                pending.popleft()
                request.slot = free.pop(0)
                self.slots[request.slot] = request
                admitted.append(request)
            skipped.extend(pending)
            self.waiting = skipped
            return admitted

    def fits(self, request: GenerationRequest) -> bool:
        """Whether the pool has pages for a waiting request's prompt (cached prefixes not counted)."""
        cache = self.cache
        return cache is None or pages_for(len(request.feed_ids) + 1, cache.page_size) <= cache.pool.available

    def leader(self, request: GenerationRequest) -> GenerationRequest | None:
        """The running request whose pages `request` can take instead of computing them again: one still
        prefilling the first full page of its prompt (with prefix reuse) or the whole of a prompt shorter than a
        page, which `request` waits for; else one holding the same prompt (another choice of it). Once admitted,
        `request` finds their full pages in the cache and copies the partial one (Cache.follow). None where there
        is none."""
        cache = self.cache
        if cache is None:
            return None
        page, feed = cache.page_size, request.feed_ids
        if len(feed) > page and not cache.pool.prefix_cache:
            return None
        same = (lambda r: r.feed_ids[:page] == feed[:page]) if len(feed) > page else (lambda r: r.feed_ids == feed)
        others = [r for r in self.running() if not r.done]
        return (next((r for r in others if r.prefilling and same(r)), None)
                or next((r for r in others if r.feed_ids == feed), None))

    def prefill_rows(self, requests: list[GenerationRequest]) -> tuple[list[GenerationRequest], int]:
        """The prefilling requests that run this step, oldest first, and their chunk size: PREFILL_CHUNK, less where
        the attention scores would pass their budget (core/sizes.py prefill_chunk); newer requests wait a step
        rather than shrink the chunk below MIN_PREFILL_CHUNK."""
        requests = sorted(requests, key=lambda r: r.admission)
        while True:
            size = prefill_chunk(len(requests), self.heads, max(r.cached for r in requests), self.scores_budget)
            if size >= MIN_PREFILL_CHUNK or len(requests) == 1:
                return requests, size
            requests = requests[:-1]

    def make_room(self, requests: list[GenerationRequest], lengths: list[int]
                  ) -> tuple[list[GenerationRequest], list[GenerationRequest], GenerationRequest | None]:
        """Frees the pages a forward of `requests` up to `lengths` positions needs beyond what the pool has left:
        while it is short, the newest admitted running request is preempted (its slot and pages given back; it
        waits first in line and later runs its prompt and what it generated again) -> (the requests that still
        run, those preempted, and a request that alone needs more than the whole pool, or None). The forward
        then takes the pages (BatchForward)."""
        preempted = []
        while True:
            rows = [(r, n) for r, n in zip(requests, lengths) if r.slot is not None]
            if self.cache is None or self.cache.pages_short([r.slot for r, _ in rows], [n for _, n in rows]) <= 0:
                return [r for r, _ in rows], preempted, None
            running = self.running()
            if len(running) == 1:  # alone and still short: it outgrew the whole pool
                return [r for r, _ in rows if r is not running[0]], preempted, running[0]
            victim = max(running, key=lambda r: r.admission)
            self.cache.release(victim.slot)
            self.requeue(victim)
            victim.preempt()
            preempted.append(victim)

    def requeue(self, request: GenerationRequest) -> None:
        """A running request gives its slot back and waits first in line (preempted: the cache ran out of pages)."""
        with self.lock:
            self.slots[request.slot] = None
            self.waiting.appendleft(request)

    def running(self) -> list[GenerationRequest]:
        with self.lock:
            return [r for r in self.slots if r is not None]

    def leave(self, request: GenerationRequest) -> None:
        with self.lock:
            self.slots[request.slot] = None

    def free_slots(self) -> int:
        return sum(holder is None for holder in self.slots)

    def queue_depth(self) -> int:
        return len(self.waiting)

    def drain_all(self) -> list[GenerationRequest]:
        """Empties the queue and the slots (at shutdown) -> the requests that were there."""
        with self.lock:
            everyone = list(self.waiting) + [r for r in self.slots if r is not None]
            self.waiting.clear()
            self.slots = [None] * len(self.slots)
            return everyone
