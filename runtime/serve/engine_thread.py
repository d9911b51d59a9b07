"""The engine: one thread that owns the model and the cache and runs the server's steps through the step loop
(`runtime/engine/step_loop.py`, the same loop `k2deploy generate` runs).

The HTTP side submits requests; the thread steps while any wait or run, and sleeps otherwise. Coming
out of idle, the first step waits BURST_WINDOW_S, so that requests sent together prefill together. After
IDLE_RELEASE_S without work the model lets go of what it holds only to step fast (Ray stages: the compiled graph,
whose actors poll a core each while they wait; `runtime/stages/ray_stages.py`).
"""

from __future__ import annotations

import logging
import threading
import time

from ...core.host_memory import available_memory
from ..cache.slots import pages_for
from ..backends.interface import Model
from ..engine.config import EngineConfig
from ..engine.requests import GenerationRequest, Update
from ..engine.step_loop import StepLoop
from .metrics import ServerMetrics

IDLE_WAIT_S = 0.25
BURST_WINDOW_S = 0.02  # from idle, the first step waits this long for requests sent at the same moment
IDLE_RELEASE_S = 10.0  # idle this long, the model releases its step-time holdings (the next step takes them back)

log = logging.getLogger("k2deploy.serve")


class Engine:
    """model: any backend of the runtime interface; config: how many requests run and wait, how far one may reach
    and the cache's page pool, sized here to the memory the host has left (runtime/engine/config.py)."""

    def __init__(self, model: Model, config: EngineConfig, metrics: ServerMetrics):
        self.model = model
        self.context = config.context  # positions one request may reach
        self.pool_tokens = config.pool_tokens(available_memory())  # measured now, with the weights in
        self.loop = StepLoop(model, config.max_batch, config.context, config.max_queue, metrics,
                             pages_for(self.pool_tokens), config.prefix_cache, config.speculative)
        self.cache = self.loop.cache
        self.metrics = metrics
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="k2deploy-engine", daemon=True)
        metrics.slots.set(config.max_batch)
        metrics.pages.set(self.cache.pool.pages)
        metrics.cache_tokens.set(self.cache.pool.pages * self.cache.page_size)
        metrics.cache_bytes.set(self.cache.nbytes)
        self._observe()

    def start(self) -> None:
        self.thread.start()

    def stop(self, reason: str = "the server is shutting down") -> None:
        """Ends the thread after its current step; requests still there get an error saying `reason`."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join()
        for request in self.loop.scheduler.drain_all():
            self.loop.send(request, Update(error=reason))

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def health(self) -> str | None:
        """None while the engine takes requests, else why not in one line. After a stage failed, the pipeline is
        asked again each time (a restarted stage answers and gets its cache back). Blocking: call off the loop."""
        if not self.alive:
            return "the engine thread has stopped"
        if self.loop.fault is not None:
            self.loop.fault = self.loop.problem()
        return self.loop.fault

    def submit(self, request: GenerationRequest) -> None:
        """Queues a request (QueueFull when there is no room); the engine admits it at its next step."""
        self.loop.submit(request)
        self.metrics.queue_depth.set(self.loop.scheduler.queue_depth())

    def _run(self) -> None:
        scheduler = self.loop.scheduler
        last_step, released = time.monotonic(), False
        while not self.stopping.is_set():
            idle = not scheduler.running()
            if not scheduler.wait_for_work(IDLE_WAIT_S):
                if not released and time.monotonic() - last_step >= IDLE_RELEASE_S:
                    self.model.release_idle()
                    released = True
                continue
            if idle:  # the first request after a pause: let the rest of its burst arrive and prefill with it
                time.sleep(BURST_WINDOW_S)
            try:
                self.loop.step()
            except Exception as exc:  # a bug, not a bad request: fail who is running, keep serving
                log.exception("engine step failed")
                self.loop.fail_all(exc)
            last_step, released = time.monotonic(), False
            self._observe()

    def _observe(self) -> None:
        held = [r.slot for r in self.loop.scheduler.running()]
        self.metrics.queue_depth.set(self.loop.scheduler.queue_depth())
        self.metrics.slots_used.set(len(held))
        self.metrics.cache_tokens_used.set(int(self.cache.lengths[held].sum()))
        pool = self.cache.pool
        self.metrics.pages_used.set(pool.used)
        self.metrics.pages_free.set(pool.available)
        self.metrics.pages_cached.set(pool.cached)
