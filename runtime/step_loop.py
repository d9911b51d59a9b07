"""The one step loop: which requests run, their forwards, their tokens. `k2deploy generate` and `score` (through
`Generator`), `bench` and `serve` (the engine's thread) all step through it.

Each step, at its boundary: cancelled requests leave (their slots freed), waiting requests join
in free slots, then at most two forwards run. The requests still prefilling run their next prompt
chunk together (rows right-padded to the longest chunk; a request's first token is sampled when its
prompt is in); then ONE forward decodes a token for every running request. Each token goes to its
request's `deliver` as it comes; finished requests leave.

Prefill and decode are separate forwards so that decode rows are never padded to a prompt's
width. Both batch: on CPU the MoE layers' cost is mostly dequantising the experts a forward
touches, which a batch shares (on `small`, 2 cores: one 64-token prompt 3.9 s, sixteen 8.5 s).
Each forward runs only its requests' slots, not the whole slot table (`cache.view(slots)`).

Batching moves a request's logits by float32 rounding only (about 1e-5 on `tiny`): ONNX Runtime
picks kernels by shape (one row or several; the MoE's chosen-experts or every-expert branch),
and a row attends over its batch's longest past, masked. Greedy tokens are the same alone and
in a batch unless two logits tie that closely; tests/test_serve_api.py checks 16 requests.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from .batch_forward import BatchForward
from .interface import Model
from .requests import GenerationRequest, Update
from .sampling import sample
from .scheduler import Scheduler
from ..core.sizes import PREFILL_CHUNK

if TYPE_CHECKING:
    from .serve.metrics import ServerMetrics


log = logging.getLogger("k2deploy.runtime")


class StepLoop:
    """A cache of `slots` slots of `context` positions, the requests that hold them, and the forwards that run
    them; `metrics` (the server's) counts what happens."""

    def __init__(self, model: Model, slots: int, context: int, max_queue: int, metrics: ServerMetrics | None = None):
        self.model = model
        self.context = context
        self.cache = model.new_cache(slots, context)
        self.forwards = BatchForward(model, self.cache)
        self.scheduler = Scheduler(slots, max_queue)
        self.metrics = metrics
        self.fault: str | None = None  # a pipeline stage is down: why (a server answers 503 until it is back)
        self.sampling_seconds = 0.0  # cumulative time spent choosing tokens, for benchmarks

    def submit(self, request: GenerationRequest) -> None:
        """Queues a request (QueueFull when there is no room); it is admitted at the next step."""
        self.scheduler.submit(request)

    def run_until_done(self) -> None:
        """Steps until no request waits or runs (for a batch submitted at once)."""
        while self.scheduler.queue_depth() or self.scheduler.running():
            self.step()

    def step(self) -> None:
        """Admits, runs the next prompt chunk of every request still prefilling, then one token for every request
        whose prompt is in (a prompt that has just come in included)."""
        running = self.running()
        self.prefill(running)
        self.decode(running)

    def running(self) -> list[GenerationRequest]:
        """Admits waiting requests into free slots and lets cancelled ones leave -> the requests that run."""
        for request in self.scheduler.admit():  # into slots released when their last request left
            request.cached = self.cache.admit(request.slot, request.prompt_ids)
        running = []
        for request in self.scheduler.running():
            if request.cancelled:
                self._leave(request, "cancelled")
            else:
                running.append(request)
        return running

    def prefill(self, running: list[GenerationRequest]) -> None:
        """The next prompt chunk of each request still prefilling, in one forward; a completed prompt's first token."""
        prefilling = [r for r in running if r.prefilling]
        if prefilling:
            self._prefill(prefilling)

    def decode(self, running: list[GenerationRequest]) -> None:
        """One token for every request whose prompt is in, in one forward."""
        decoding = [r for r in running if r.slot is not None and not r.prefilling and not r.done]
        if decoding:
            self._decode(decoding)

    def problem(self) -> str | None:
        """What a pipeline of stages says is down (None for a model in one process, or when all are up)."""
        problem = getattr(self.model, "problem", None)
        return problem() if problem else None

    def fail_all(self, exc: Exception) -> None:
        """A bug, not a bad request: every running request gets the error and leaves."""
        for request in self.scheduler.running():
            self._fail(request, exc)

    def _prefill(self, requests: list[GenerationRequest]) -> None:
        chunks = [r.next_chunk(PREFILL_CHUNK) for r in requests]
        logits = self._forward(requests, lambda slots: self.forwards.prefill(slots, chunks))
        if logits is None:
            return
        for request, chunk in zip(requests, chunks):
            request.cached += len(chunk)
        if self.metrics:
            self.metrics.prompt_tokens.inc(sum(map(len, chunks)))
        complete = [row for row, r in enumerate(requests) if not r.prefilling]
        self._emit([requests[row] for row in complete], logits[complete])

    def _decode(self, requests: list[GenerationRequest]) -> None:
        tokens = np.array([r.generated[-1] for r in requests], dtype=np.int64)
        logits = self._forward(requests, lambda slots: self.forwards.decode(slots, tokens))
        if logits is not None:
            self._emit(requests, logits)

    def _forward(self, requests: list[GenerationRequest], step) -> np.ndarray | None:
        """One step over the requests' slots -> logits [rows, vocab]; None when it failed (each request then got
        an error and left, and a pipeline is asked whether a stage is down)."""
        try:
            return step([r.slot for r in requests])
        except Exception as exc:
            for request in requests:
                self._fail(request, exc)
            self.fault = self.problem()
            return None

    def _emit(self, requests: list[GenerationRequest], logits: np.ndarray) -> None:
        """Samples each request's next token from its logits row and sends it; finished requests leave."""
        for request, row in zip(requests, logits):
            previous_at, generated = request.last_token_at, len(request.generated)
            started = time.perf_counter()
            token = sample(row, request.params, request.rng)
            self.sampling_seconds += time.perf_counter() - started
            update = request.accept(token)
            if self.metrics:
                if previous_at is None:
                    self.metrics.ttft.observe(request.first_token_at - request.arrived_at)
                else:
                    self.metrics.per_token.observe(request.last_token_at - previous_at)
                self.metrics.generated_tokens.inc(len(request.generated) - generated)
            self.send(request, update)
            if request.done:
                self._leave(request, request.finish_reason)

    def _fail(self, request: GenerationRequest, exc: Exception) -> None:
        log.info("request failed: %s", exc)  # the server logs it; `generate` raises it as its one-line error
        request.error = str(exc)
        self.send(request, Update(error=f"generation failed: {exc}"))
        self._leave(request, "error")

    def _leave(self, request: GenerationRequest, reason: str) -> None:
        self.scheduler.leave(request)
        self.cache.release(request.slot)
        request.slot = None
        if self.metrics:
            self.metrics.finished.labels(reason).inc()

    def send(self, request: GenerationRequest, update: Update) -> None:
        try:
            request.deliver(update)
        except RuntimeError:  # the client's event loop is gone
            request.cancelled = True
