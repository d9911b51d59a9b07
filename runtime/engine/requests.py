"""One generation request's state in the engine: its prompt and sampling, the slot it holds, what it produced."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..text.answer import AnswerDelta, AnswerStream
from ..text.constrained import Constraint
from ..text.tool_calls import CallDelta
from .sampling import SamplingParams
from .speculation import PromptLookup, SpeculationStats


@dataclass(frozen=True)
class Update:
    """What the engine hands the HTTP side after a step: new text and tool-call deltas, the token ids they came
    from, and on the last update why it ended."""

    text: str = ""
    finish_reason: str | None = None  # "stop" (a stop id or string), "length" (max_tokens) or "tool_calls"
    error: str | None = None  # the step failed; the request is over
    tool_calls: tuple[CallDelta, ...] = ()
    token_ids: tuple[int, ...] = ()  # the sampled ids this update covers (without a stop id)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per id of token_ids, where the request asked for them
    reasoning: str = ""  # new reasoning text (a thinking model's, between <think> and </think>), apart from `text`


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model and the likeliest tokens' (id, log-probability)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class GenerationRequest:
    """A prompt waiting, prefilling or decoding in one slot of the cache, until it finishes or is cancelled.

    The engine thread owns everything here but `cancelled`, which the HTTP side sets (client gone); the engine reads
    it at the next step boundary and frees the slot. Each sampled token goes through the request's `answer`
    (runtime/text/answer.py: text, stop strings, reasoning, tool calls) into the update its `deliver` gets; without
    one, updates carry token ids and no text.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, deliver: Callable[[Update], None],
                 row: int = 0, constraint: Constraint | None = None, answer: AnswerStream | None = None):
        """row: its place among choices of one prompt (seeds its sampling)."""
        self.prompt_ids = prompt_ids
        self.params = params
        self.after: GenerationRequest | None = None  # the request whose pages it reuses (Scheduler.leader)
        self.constraint = constraint  # the grammar its answer must keep to (runtime/text/constrained.py), if any
        # seeded by (seed, row in its batch): a server request is row 0, so it samples what `generate` does
        self.rng = np.random.default_rng(None if params.seed is None else [params.seed % 2**64, row])
        self.answer = answer  # the answer's text, stop strings, reasoning and tool calls (None: ids alone)
        self.deliver = deliver
        self.slot: int | None = None
        self.feed_ids = prompt_ids  # what runs before the next token is sampled: the prompt, after a preemption
        # the prompt and what was generated (the generated tokens are kept; the cache entries are recomputed)
        self.cached = 0  # tokens of feed_ids already in the slot's cache
        self.cached_prompt_tokens: int | None = None  # prompt tokens found in the cache when first admitted
        self.preempted = 0  # times it gave its pages back before it finished
        self.admission = 0  # when it last took a slot (the step loop's count): the newest is preempted first
        self.generated: list[int] = []  # sampled ids, without a stop id
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it failed, when a forward it was in failed
        self.cancelled = False
        self.speculation = SpeculationStats()  # drafts, accepted drafts and the forwards that gave it tokens
        self.lookup: PromptLookup | None = None  # its tokens' n-gram index, made at its first draft
        self.arrived_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.feed_ids)

    @property
    def ready(self) -> bool:
        """Whether it may take a slot: the request it waits for has prefilled its prompt, or will not."""
        after = self.after
        return after is None or after.done or after.cancelled or (after.slot is not None and not after.prefilling)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def next_chunk(self, limit: int) -> list[int]:
        return self.feed_ids[self.cached:self.cached + limit]

    def admitted(self, cached: int) -> None:
        """It holds a slot whose cache has the first `cached` tokens of feed_ids already."""
        self.cached = cached
        if self.cached_prompt_tokens is None:
            self.cached_prompt_tokens = cached

    def preempt(self) -> None:
        """It gave its slot and pages back: it will run its prompt and what it generated again, then go on."""
        self.feed_ids = self.prompt_ids + self.generated
        self.slot, self.cached = None, 0
        self.preempted += 1

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> Update:
        """One sampled token (with its log-probabilities, if asked for) -> the update for the client; sets
        finish_reason when this token ends the request."""
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        if token in self.params.stop_ids:
            return self.end("stop")
        self.generated.append(token)
        if self.lookup is not None:
            self.lookup.extend([token])
        last = "length" if len(self.generated) >= self.params.max_new_tokens else None
        delta = self.answer.push(token, last) if self.answer is not None else AnswerDelta(finish_reason=last)
        return self._update(delta, (token,), () if logprob is None else (logprob,))

    def end(self, reason: str) -> Update:
        """Ends it without a token (a stop id; the cache cannot hold more of it): the last update, finish_reason
        `reason` (or "tool_calls" where the answer called tools)."""
        delta = self.answer.finish(reason) if self.answer is not None else AnswerDelta(finish_reason=reason)
        return self._update(delta, (), ())

    def _update(self, delta: AnswerDelta, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]) -> Update:
        self.finish_reason = delta.finish_reason
        return Update(delta.text, delta.finish_reason, tool_calls=delta.tool_calls, token_ids=token_ids,
                      logprobs=logprobs, reasoning=delta.reasoning)
