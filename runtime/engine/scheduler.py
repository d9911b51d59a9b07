"""Who runs in the next step: a first-come queue of waiting requests and the cache slots of the running ones
(a request is admitted when a slot is free and the cache has pages for its prompt; a preempted one waits
first in line).

The HTTP side submits and cancels from the event loop; the engine thread admits, and lets
requests leave, at step boundaries. One lock guards the queue and the slot table.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .requests import GenerationRequest


class QueueFull(Exception):
    """Every slot is taken and the queue holds --max-queue requests already."""


class Scheduler:
    def __init__(self, slots: int, max_queue: int):
        self.max_queue = max_queue
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

    def admit(self, fits: Callable[[GenerationRequest], bool] = lambda request: True,
              leader: Callable[[GenerationRequest], GenerationRequest | None] = lambda request: None
              ) -> list[GenerationRequest]:
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
                    request.after = leader(request)
                if not request.ready:
                    skipped.append(pending.popleft())
                    continue
                if not fits(request):
                    break
                pending.popleft()
                request.slot = free.pop(0)
                self.slots[request.slot] = request
                admitted.append(request)
            skipped.extend(pending)
            self.waiting = skipped
            return admitted

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
