"""The engine: one thread that owns the model and the cache and runs the server's steps.

Each step, at its boundary: cancelled requests leave (their slots freed), waiting requests
join in free slots, then at most two forwards run. The requests still prefilling run their
next prompt chunk together (rows right-padded to the longest chunk; a request's first token
is sampled when its prompt is in); then ONE forward decodes a token for every running request.
Tokens go to each request's client as they come; finished requests leave. Coming out of
idle, the first step waits BURST_WINDOW_S, so that requests sent together prefill together.

Prefill and decode are separate forwards so that decode rows are never padded to a prompt's
width. Both batch: on CPU the MoE layers' cost is mostly dequantising the experts a forward
touches, which a batch shares (on `small`, 2 cores: one 64-token prompt 3.9 s, sixteen 8.5 s).
Each forward runs only its requests' cache rows, not the whole slot table (`cache.rows`: on the host
runtime/cache_rows.py, on the GPU runtime/tensorrt/device_cache.py).

Batching moves a request's logits by float32 rounding only (about 1e-5 on `tiny`): ONNX Runtime
picks kernels by shape (one row or several; the MoE's chosen-experts or every-expert branch),
and a row attends over its batch's longest past, masked. Greedy tokens are the same alone and
in a batch unless two logits tie that closely; tests/test_serve_api.py checks 16 requests.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from ..sampling import sample
from ..steps import Steps
from .metrics import ServerMetrics
from .requests import GenerationRequest, Update
from .scheduler import Scheduler

PREFILL_CHUNK = 512  # prompt tokens per request per step: bounds how long one step holds the decoders back
IDLE_WAIT_S = 0.25
BURST_WINDOW_S = 0.02  # from idle, the first step waits this long for requests sent at the same moment

log = logging.getLogger("k2deploy.serve")


class Engine:
    """model: any backend of the runtime interface (`runtime.interface.Model`); its cache holds max_batch slots."""

    def __init__(self, model, max_batch: int, max_context: int, max_queue: int, metrics: ServerMetrics):
        self.model = model
        self.context = min(model.config.max_position_embeddings, max_context)  # positions per slot
        self.cache = model.new_cache(max_batch, self.context)
        self.steps = Steps(model, self.cache)
        self.scheduler = Scheduler(max_batch, max_queue)
        self.metrics = metrics
        self.fault: str | None = None  # a pipeline stage is down: why (requests get 503 until it is back)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="k2deploy-engine", daemon=True)
        metrics.slots.set(max_batch)
        metrics.cache_tokens.set(max_batch * self.context)
        metrics.cache_bytes.set(self.cache.nbytes)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ends the thread after its current step; requests still there get an error."""
        self.stopping.set()
        self.thread.join()
        for request in self.scheduler.drain_all():
            self._send(request, Update(error="the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def health(self) -> str | None:
        """None while the engine takes requests, else why not in one line. After a stage failed, the pipeline is
        asked again each time (a restarted stage answers and gets its cache back). Blocking: call off the loop."""
        if not self.alive:
            return "the engine thread has stopped"
        if self.fault is not None:
            self.fault = self._problem()
        return self.fault

    def _problem(self) -> str | None:
        problem = getattr(self.model, "problem", None)  # pipelines of stages; a single process has no stages to lose
        return problem() if problem else None

    def submit(self, request: GenerationRequest) -> None:
        """Queues a request (QueueFull when there is no room); the engine admits it at its next step."""
        self.scheduler.submit(request)
        self.metrics.queue_depth.set(self.scheduler.queue_depth())

    def _run(self) -> None:
        while not self.stopping.is_set():
            idle = not self.scheduler.running()
            if not self.scheduler.wait_for_work(IDLE_WAIT_S):
                continue
            if idle:  # the first request after a pause: let the rest of its burst arrive and prefill with it
                time.sleep(BURST_WINDOW_S)
            try:
                self.step()
            except Exception as exc:  # a bug, not a bad request: fail who is running, keep serving
                log.exception("engine step failed")
                for request in self.scheduler.running():
                    self._fail(request, exc)
            self._observe()

    def step(self) -> None:
        self.scheduler.admit()  # into slots that were released (emptied) when their last request left
        running = []
        for request in self.scheduler.running():
            if request.cancelled:
                self._leave(request, "cancelled")
            else:
                running.append(request)
        prefilling = [r for r in running if r.prefilling]
        if prefilling:
            self._prefill(prefilling)
        decoding = [r for r in running if r.slot is not None and not r.prefilling and not r.done]
        if decoding:
            self._decode(decoding)

    def _prefill(self, requests: list[GenerationRequest]) -> None:
        chunks = [r.next_chunk(PREFILL_CHUNK) for r in requests]
        logits = self._forward(requests, lambda slots: self.steps.prefill(slots, chunks))
        if logits is None:
            return
        for request, chunk in zip(requests, chunks):
            request.cached += len(chunk)
        self.metrics.prompt_tokens.inc(sum(map(len, chunks)))
        complete = [row for row, r in enumerate(requests) if not r.prefilling]
        self._emit([requests[row] for row in complete], logits[complete])

    def _decode(self, requests: list[GenerationRequest]) -> None:
        tokens = np.array([r.generated[-1] for r in requests], dtype=np.int64)
        logits = self._forward(requests, lambda slots: self.steps.decode(slots, tokens))
        if logits is not None:
            self._emit(requests, logits)

    def _forward(self, requests: list[GenerationRequest], step) -> np.ndarray | None:
        """One step over the requests' slots -> logits [rows, vocab]; None when it failed (each request then got
        an error and left)."""
        try:
            return step([r.slot for r in requests])
        except Exception as exc:
            for request in requests:
                self._fail(request, exc)
            self.fault = self._problem()
            return None

    def _emit(self, requests: list[GenerationRequest], logits: np.ndarray) -> None:
        """Samples each request's next token from its logits row and sends it; finished requests leave."""
        for request, row in zip(requests, logits):
            previous_at, generated = request.last_token_at, len(request.generated)
            update = request.accept(sample(row, request.params, request.rng))
            if previous_at is None:
                self.metrics.ttft.observe(request.first_token_at - request.arrived_at)
            else:
                self.metrics.per_token.observe(request.last_token_at - previous_at)
            self.metrics.generated_tokens.inc(len(request.generated) - generated)
            self._send(request, update)
            if request.done:
                self._leave(request, request.finish_reason)

    def _fail(self, request: GenerationRequest, exc: Exception) -> None:
        log.error("request failed: %s", exc)
        self._send(request, Update(error=f"generation failed: {exc}"))
        self._leave(request, "error")

    def _leave(self, request: GenerationRequest, reason: str) -> None:
        self.scheduler.leave(request)
        self.cache.release(request.slot)
        request.slot = None
        self.metrics.finished.labels(reason).inc()

    def _send(self, request: GenerationRequest, update: Update) -> None:
        try:
            request.deliver(update)
        except RuntimeError:  # the client's event loop is gone
            request.cancelled = True

    def _observe(self) -> None:
        held = [r.slot for r in self.scheduler.running()]
        self.metrics.queue_depth.set(self.scheduler.queue_depth())
        self.metrics.slots_used.set(len(held))
        self.metrics.cache_tokens_used.set(int(self.cache.lengths[held].sum()))
