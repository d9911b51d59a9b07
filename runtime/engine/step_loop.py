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
import numpy as np

from ...core.errors import K2Error
from ...core.sizes import ATTENTION_SCORES_BYTES
from ..backends.interface import Model
from .batch_forward import BatchForward
from .counters import StepCounters
from .requests import GenerationRequest, TokenLogprob, Update
from .sampling import sample, token_logprobs
from .scheduler import Scheduler
from .speculation import MAX_DRAFTS, PromptLookup, Speculation


log = logging.getLogger("k2deploy.runtime")


class StepLoop:
    """A cache of `slots` slots of `context` positions, the requests that hold them, and the forwards that run
    them; `metrics` (the server's) counts what happens."""

    def __init__(self, model: Model, slots: int, context: int, max_queue: int, metrics: StepCounters | None = None,
                 pages: int | None = None, prefix_cache: bool = True, speculative: str = "auto"):
        """slots: requests running at once; context: positions one may reach; pages: the cache's pool (default:
        every slot at full context); speculative: auto (drafted tokens checked where they pay and the backend's
        forward of several positions is exact, runtime/engine/speculation.py) or off."""
        self.model = model
        self.context = context
        self.cache = model.new_cache(slots, context, pages, prefix_cache)
        self.forwards = BatchForward(model, self.cache)
        self.scheduler = Scheduler(slots, max_queue, self.cache, model.config.num_attention_heads,
                                   getattr(model, "prefill_scores_budget", ATTENTION_SCORES_BYTES))
        self.metrics = metrics
        self.speculation = Speculation(speculative, getattr(model, "exact_positions", False))
        self.admissions = 0  # requests admitted so far: the newest running one is preempted first
        self.fault: str | None = None  # a pipeline stage is down: why (a server answers 503 until it is back)
        self.sampling_seconds = 0.0  # cumulative time spent choosing tokens, for benchmarks

    def submit(self, request: GenerationRequest) -> None:
        """Queues a request (QueueFull when there is no room); it is admitted at the next step. A prompt that
        does not fit the context or the whole cache is a K2Error."""
        needed, pool = len(request.prompt_ids) + 1, self.cache.pool.pages * self.cache.page_size
        if needed > self.context:
            raise K2Error(f"the prompt has {len(request.prompt_ids)} tokens; with one to generate that is past the "
                          f"context of {self.context} positions")
        if needed > pool:
            raise K2Error(f"the prompt has {len(request.prompt_ids)} tokens; with one to generate that is more than "
                          f"the whole cache holds ({pool} tokens)")
        self.scheduler.submit(request)

    def run_until_done(self) -> None:
        """Steps until no request waits or runs (for a batch submitted at once)."""
        while self.scheduler.queue_depth() or self.scheduler.running():
            self.step()

    def step(self) -> None:
        """Admits, runs the next prompt chunk of every request still prefilling, then one token for every request
        whose prompt is in (a prompt that has just come in included)."""
        running = self.admit()
        self.prefill(running)
        self.decode(running)

    def admit(self) -> list[GenerationRequest]:
        """Admits waiting requests into free slots and lets cancelled ones leave -> the requests that run."""
        for request in self.scheduler.admit():  # into slots their last request left
            try:
                self._admit(request)
            except Exception as exc:  # fails this request alone
                log.exception("a request's admission failed; the step goes on for the others")
                self._fail(request, exc)
        running = []
        for request in self.scheduler.running():
            if request.cancelled:
                self._leave(request, "cancelled")
            else:
                running.append(request)
        return running

    def _admit(self, request: GenerationRequest) -> None:
        """A request that has just taken a slot: its cached prefix found (or the pages its leader fills)."""
        held = self.cache.admit(request.slot, request.feed_ids)
        leader = request.after
        if leader is not None and leader.slot is not None and not leader.done and held < len(request.feed_ids) - 1:
            held = self.cache.follow(request.slot, leader.slot, request.feed_ids)  # its prefill's last page too
        request.admitted(held)
        self.admissions += 1
        request.admission = self.admissions
        if self.metrics:
            self.metrics.cached_prompt_tokens.inc(request.cached)

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
        return self.model.problem()

    def fail_all(self, exc: Exception) -> None:
        """A bug, not a bad request: every running request gets the error and leaves."""
        for request in self.scheduler.running():
            self._fail(request, exc)

    def _prefill(self, requests: list[GenerationRequest]) -> None:
        requests, size = self.scheduler.prefill_rows(requests)
        requests = self._make_room(requests, [r.cached + len(r.next_chunk(size)) for r in requests])
        if not requests:
            return
        chunks = [r.next_chunk(size) for r in requests]
        logits = self._forward(requests, lambda slots: self.forwards.prefill(slots, chunks))
        if logits is None:
            return
        for request, chunk in zip(requests, chunks):
            request.cached += len(chunk)
        if self.metrics:
            self.metrics.prompt_tokens.inc(sum(map(len, chunks)))
        complete = [row for row, r in enumerate(requests) if not r.prefilling]
        for row in complete:
            requests[row].speculation.forward_steps += 1
        self._emit([requests[row] for row in complete], logits[complete])

    def _decode(self, requests: list[GenerationRequest]) -> None:
        requests = self._make_room(requests, [int(self.cache.lengths[r.slot]) + 1 for r in requests])
        if not requests:
            return
        if self.metrics:
            self.metrics.decode_batch.observe(len(requests))
        drafts = self._drafts(requests)
        if any(drafts):
            self._verify(requests, drafts)
            return
        tokens = np.array([r.generated[-1] for r in requests], dtype=np.int64)
        started = time.perf_counter()
        logits = self._forward(requests, lambda slots: self.forwards.decode(slots, tokens))
        if logits is not None:
            self.speculation.timed(1, time.perf_counter() - started)
            for request in requests:
                request.speculation.forward_steps += 1
            self._emit(requests, logits)

    def _drafts(self, requests: list[GenerationRequest]) -> list[list[int]]:
        """Each request's drafted tokens this step (none where speculation is off or does not pay, or where the
        pool has no pages for them without preempting anyone)."""
        if not self.speculation.on:
            return [[] for _ in requests]
        drafts = []
        for request in requests:
            if request.lookup is None:
                request.lookup = PromptLookup(request.prompt_ids + request.generated)
            room = min(request.params.max_new_tokens - len(request.generated) - 1,
                       self.context - int(self.cache.lengths[request.slot]) - 1)
            drafts.append(self._forced(request, min(MAX_DRAFTS, room))
                          or self.speculation.draft(request.lookup, request.speculation, room))
        lengths = [int(self.cache.lengths[r.slot]) + 1 + len(d) for r, d in zip(requests, drafts)]
        if self.cache.pages_short([r.slot for r in requests], lengths) > 0:
            return [[] for _ in requests]
        return drafts

    @staticmethod
    def _forced(request: GenerationRequest, limit: int) -> list[int]:
        """The tokens its grammar forces next (none without a grammar, or where the grammar cannot say: drafting
        only saves forwards, so it never fails a request; sampling then meets whatever is wrong with the grammar)."""
        forced = getattr(request.constraint, "forced", None)
        if forced is None:
            return []
        try:
            return forced(limit)
        except Exception:
            log.debug("a grammar's forced tokens could not be read; no draft from it", exc_info=True)
            return []

    def _verify(self, requests: list[GenerationRequest], drafts: list[list[int]]) -> None:
        """One forward of each request's last token and its drafts; each samples position by position as decoding
        would, and keeps the drafts up to the first one its own choice differs from (runtime/engine/speculation.py)."""
        chunks = [[r.generated[-1]] + d for r, d in zip(requests, drafts)]
        started = time.perf_counter()
        got = self._forward(requests, lambda slots: self.forwards.verify(slots, chunks))
        if got is None:
            return
        self.speculation.timed(max(map(len, chunks)), time.perf_counter() - started)
        logits = got[0]
        for row, (request, draft) in enumerate(zip(requests, drafts)):
            request.speculation.forward_steps += 1
            request.speculation.draft_tokens += len(draft)
            accepted = 0
            try:
                for i in range(len(draft) + 1):
                    token = self._next_token(request, logits[row, i])
                    if request.done or i == len(draft) or token != draft[i]:
                        break
                    accepted += 1
            except Exception as exc:
                log.exception("a request's token failed; the step goes on for the others")
                self._fail(request, exc)
            request.speculation.accepted_tokens += accepted
            if self.metrics:
                self.metrics.draft_tokens.inc(len(draft))
                self.metrics.accepted_tokens.inc(accepted)
            if request.slot is not None:  # still running: it keeps its last token and the accepted drafts
                self.forwards.keep(request.slot, chunks[row][:accepted + 1])

    def _make_room(self, requests: list[GenerationRequest], lengths: list[int]) -> list[GenerationRequest]:
        """The pool's pages for each request's first `lengths` positions, made free by the scheduler (preempting the
        newest running requests) -> the requests that still run; one that alone needs more than the whole pool ends
        with finish_reason "length"."""
        running, preempted, outgrown = self.scheduler.make_room(requests, lengths)
        for request in preempted:
            log.info("cache pool full: preempted a request (%d tokens in; it runs again when pages are free)",
                     len(request.feed_ids))
            if self.metrics:
                self.metrics.preemptions.inc()
        if outgrown is not None:
            self._end(outgrown, "length")
        return running

    def _end(self, request: GenerationRequest, reason: str) -> None:
        self.send(request, request.end(reason))
        self._leave(request, reason)

    def _forward(self, requests: list[GenerationRequest], step) -> np.ndarray | None:
        """One step over the requests' slots -> logits [rows, vocab]; None when it failed (each request then got
        an error and left, the cache forgot its prefixes, whose entries a restarted stage no longer has, and a
        pipeline is asked whether a stage is down)."""
        try:
            return step([r.slot for r in requests])
        except Exception as exc:
            # unhealthy until the check below says otherwise: the failed requests' clients may ask /health at once
            self.fault = f"a forward failed ({exc}); the model is being checked"
            for request in requests:
                self._fail(request, exc)
            self.cache.pool.forget()
            self.fault = self.problem()
            return None

    def _emit(self, requests: list[GenerationRequest], logits: np.ndarray) -> None:
        """Samples each request's next token from its logits row and sends it; finished requests leave. Whatever
        fails in one request's part (its grammar, sampling, text, tool calls) fails that request alone."""
        for request, row in zip(requests, logits):
            try:
                self._next_token(request, row)
            except Exception as exc:
                log.exception("a request's token failed; the step goes on for the others")
                self._fail(request, exc)

    def _next_token(self, request: GenerationRequest, row: np.ndarray) -> int:
        previous_at, generated = request.last_token_at, len(request.generated)
        started = time.perf_counter()
        params, constraint = request.params, request.constraint
        allowed = row if constraint is None else constraint.allowed(row)
        token = sample(allowed, params, request.rng, request.prompt_ids, request.generated)
        if constraint is not None and token not in params.stop_ids:
            constraint.consume(token)
        logprob = None if params.logprobs is None else TokenLogprob(token, *token_logprobs(row, token, params.logprobs))
        self.sampling_seconds += time.perf_counter() - started
        update = request.accept(token, logprob)
        if self.metrics:
            if previous_at is None:
                self.metrics.ttft.observe(request.first_token_at - request.arrived_at)
            else:
                self.metrics.per_token.observe(request.last_token_at - previous_at)
            self.metrics.generated_tokens.inc(len(request.generated) - generated)
        self.send(request, update)
        if request.done:
            self._leave(request, request.finish_reason)
        return token

    def _fail(self, request: GenerationRequest, exc: Exception) -> None:
        log.info("request failed: %s", exc)  # the server logs it; `generate` raises it as its one-line error
        request.error = str(exc)
        self.send(request, Update(error=f"generation failed: {exc}"))
        if request.slot is not None:  # not left already
            self._leave(request, "error")

    def _leave(self, request: GenerationRequest, reason: str) -> None:
        if self.speculation.on and request.generated:
            self.speculation.recent.add(request.generated)  # later requests may draft from this answer
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
