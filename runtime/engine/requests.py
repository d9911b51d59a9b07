"""One generation request's state in the engine: its prompt and sampling, the slot it holds, what it produced."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ..text.constrained import Constraint
from ..text.reasoning import ReasoningSplitter
from .sampling import SamplingParams
from ..text.tool_calls import CallDelta, ToolCallParser, undecided_tail


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


class TextStream:
    """Token ids in, text out as it becomes final.

    Decodes incrementally (from the last clean boundary, so a character split over tokens is
    held until complete) and holds back any tail that may still grow into a stop string.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode = decode
        self.stop = stop
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already taken
        self.read_offset = 0
        self.held = ""  # decoded, not yet released: may be the start of a stop string

    def push(self, token: int) -> tuple[str, bool]:
        """Adds one token -> (text now final, whether a stop string was reached; the text ends before it)."""
        self.ids.append(token)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return "", False  # an incomplete character: wait for the next token
        self.held += text[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def finish(self) -> str:
        """Everything still held, at the end of the generation (an incomplete character as U+FFFD)."""
        taken = self.decode(self.ids[self.prefix_offset:self.read_offset])
        text, self.held = self.held + self.decode(self.ids[self.prefix_offset:])[len(taken):], ""
        return text

    def _release(self) -> tuple[str, bool]:
        found = [i for i in (self.held.find(s) for s in self.stop) if i >= 0]
        if found:
            text, self.held = self.held[: min(found)], ""
            return text, True
        keep = undecided_tail(self.held, self.stop)
        text, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return text, False


class GenerationRequest:
    """A prompt waiting, prefilling or decoding in one slot of the cache, until it finishes or is cancelled.

    The engine thread owns everything here but `cancelled`, which the HTTP side sets (client
    gone); the engine reads it at the next step boundary and frees the slot. Without a tokenizer
    (`decode` None) updates carry token ids and no text. With a tool-call `parser` the text goes
    through it: the answer's content and its calls; `forced_text` (prefilled with the prompt by
    tool_choice) is parsed first, and `single_call` ends the answer after its first call.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams, stop: tuple[str, ...],
                 decode: Callable[[list[int]], str] | None, deliver: Callable[[Update], None],
                 parser: ToolCallParser | None = None, forced_text: str = "", single_call: bool = False,
                 row: int = 0, constraint: Constraint | None = None, reasoning: ReasoningSplitter | None = None):
        """row: its place among choices of one prompt (seeds its sampling)."""
        self.prompt_ids = prompt_ids
        self.params = params
        self.after: GenerationRequest | None = None  # the request whose pages it reuses (Scheduler.leader)
        self.reasoning = reasoning  # splits a thinking model's reasoning from its answer, where it may think
        self.constraint = constraint  # the grammar its answer must keep to (runtime/text/constrained.py), if any
        # seeded by (seed, row in its batch): a server request is row 0, so it samples what `generate` does
        self.rng = np.random.default_rng(None if params.seed is None else [params.seed % 2**64, row])
        self.text = TextStream(decode, stop) if decode is not None else None
        self.deliver = deliver
        self.parser = parser
        self.single_call = single_call
        self.forced = parser.feed(forced_text) if parser and forced_text else None  # sent with the first token
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
            return self._update(self._flush(), (), "stop")
        self.generated.append(token)
        text, stopped = self.text.push(token) if self.text else ("", False)
        if stopped:
            update = self._update(text, (token,), "stop")
        elif len(self.generated) >= self.params.max_new_tokens:
            update = self._update(text + self._flush(), (token,), "length")
        else:
            update = self._update(text, (token,), None)
        return replace(update, logprobs=(logprob,)) if logprob is not None else update

    def end(self, reason: str) -> Update:
        """Ends it without a token (the cache cannot hold more of it): the last update, finish_reason `reason`."""
        return self._update(self._flush(), (), reason)

    def _flush(self) -> str:
        return self.text.finish() if self.text else ""

    def _update(self, text: str, token_ids: tuple[int, ...], finish_reason: str | None) -> Update:
        """The update for new text: its reasoning split off, where the model may think, then the answer through
        the tool-call parser where there is one; sets finish_reason."""
        reasoning = ""
        if self.reasoning is not None:
            parts = [self.reasoning.feed(text), *([self.reasoning.finish()] if finish_reason is not None else [])]
            reasoning, text = "".join(p.reasoning for p in parts), "".join(p.answer for p in parts)
        update = self._answer_update(text, token_ids, finish_reason)
        return replace(update, reasoning=reasoning) if reasoning else update

    def _answer_update(self, text: str, token_ids: tuple[int, ...], finish_reason: str | None) -> Update:
        if self.parser is None:
            self.finish_reason = finish_reason
            return Update(text, finish_reason, token_ids=token_ids)
        parsed = [d for d in (self.forced, self.parser.feed(text)) if d is not None]
        self.forced = None
        if self.single_call and self.parser.calls and self.parser.calls[0].complete:
            finish_reason = "tool_calls"  # parallel_tool_calls false: the first call is the answer
        if finish_reason is not None:
            parsed.append(self.parser.finish())
            if finish_reason == "stop" and self.parser.called:
                finish_reason = "tool_calls"
        self.finish_reason = finish_reason
        calls = tuple(c for d in parsed for c in d.calls)
        if self.single_call:
            calls = tuple(c for c in calls if c.index == 0)
        return Update("".join(d.content for d in parsed), finish_reason, tool_calls=calls, token_ids=token_ids)
