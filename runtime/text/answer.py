"""One answer's output processing, as its tokens come: text decoded as it becomes final, stop strings, the reasoning
split from the answer, tool calls parsed. One `AnswerStream` a request, made by `answer_stream` for `serve` and
`generate` alike; the engine hands it each sampled token and passes its parts on (runtime/engine/requests.py).

It runs on the engine's thread: a stop string or a complete single tool call ends the answer within the step that
produced its token, so no token past it is generated, counted or billed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .reasoning import ReasoningSplitter, reasoning_splitter
from .tool_calls import CallDelta, ToolCallParser, undecided_tail


@dataclass(frozen=True)
class AnswerDelta:
    """What a token (or the end) adds to an answer: its text, its reasoning, tool-call deltas, and the finish reason
    where this ends it ("stop" for a stop string, "tool_calls" for calls, or the engine's reason)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: tuple[CallDelta, ...] = ()
    finish_reason: str | None = None


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


class AnswerStream:
    """Tokens in, the answer's parts out: text through `decode` and the stop strings (TextStream), the reasoning
    split off where the model thinks (`reasoning`), then the rest through the tool-call `parser` where there is
    one; `forced_text` (prefilled with the prompt by tool_choice) is parsed first, and `single_call` ends the
    answer after its first call."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (),
                 parser: ToolCallParser | None = None, forced_text: str = "", single_call: bool = False,
                 reasoning: ReasoningSplitter | None = None):
        self.text = TextStream(decode, stop)
        self.parser, self.single_call, self.reasoning = parser, single_call, reasoning
        self.forced = parser.feed(forced_text) if parser is not None and forced_text else None

    def push(self, token: int, last: str | None = None) -> AnswerDelta:
        """One generated token -> what it adds; `last`: the engine's reason where it ends the answer after this
        token (e.g. "length"), so that what is held back comes out with it."""
        text, stopped = self.text.push(token)
        if stopped:
            return self._delta(text, "stop")
        return self._delta(text + self.text.finish(), last) if last is not None else self._delta(text, None)

    def finish(self, reason: str) -> AnswerDelta:
        """The end without a new token (a stop id, a full cache) -> what was held back, finish_reason `reason`
        (or "tool_calls")."""
        return self._delta(self.text.finish(), reason)

    def calls(self) -> list[dict]:
        """The answer's tool calls so far, as the OpenAI API writes them."""
        return [] if self.parser is None else [call.to_openai() for call in self.parser.calls]

    def _delta(self, text: str, finish_reason: str | None) -> AnswerDelta:
        reasoning = ""
        if self.reasoning is not None:
            parts = [self.reasoning.feed(text), *([self.reasoning.finish()] if finish_reason is not None else [])]
            reasoning, text = "".join(p.reasoning for p in parts), "".join(p.answer for p in parts)
        if self.parser is None:
            return AnswerDelta(text, reasoning, (), finish_reason)
        parsed = [d for d in (self.forced, self.parser.feed(text)) if d is not None]
        self.forced = None
        if self.single_call and self.parser.calls and self.parser.calls[0].complete:
            finish_reason = "tool_calls"  # parallel_tool_calls false: the first call is the answer
        if finish_reason is not None:
            parsed.append(self.parser.finish())
            if finish_reason == "stop" and self.parser.called:
                finish_reason = "tool_calls"
        calls = tuple(c for d in parsed for c in d.calls)
        if self.single_call:
            calls = tuple(c for c in calls if c.index == 0)
        return AnswerDelta("".join(d.content for d in parsed), reasoning, calls, finish_reason)


def answer_stream(tokenizer, prompt_ids: list[int], chat: bool, stop: tuple[str, ...] = (), forced_text: str = "",
                  single_call: bool = False) -> AnswerStream | None:
    """The answer's processing for a request: a chat answer's reasoning and tool calls are parsed; None without a
    tokenizer (updates then carry token ids alone)."""
    if tokenizer is None:
        return None
    return AnswerStream(lambda ids: tokenizer.decode(ids, skip_special=True), stop,
                        ToolCallParser() if chat else None, forced_text, single_call,
                        reasoning_splitter(tokenizer, prompt_ids) if chat else None)
