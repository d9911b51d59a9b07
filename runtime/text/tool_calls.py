"""Kimi K2's tool calls, parsed from the decoded text as it streams. Stdlib only.

Kimi K2 answers with optional text, then optionally a section of calls: ``section_begin``, per call
``call_begin functions.NAME:IDX argument_begin {JSON} call_end``, then ``section_end`` (the markers
are special tokens). ``ToolCallParser.feed`` takes that text in any chunks and returns what became final.

Rules:
- Text outside a section is content, before and after it (a later section parses too); text
  in a section between calls (Kimi writes only whitespace there) is dropped.
- A tail that could still begin a marker (a proper prefix of one, as ``<|tool``) is held
  until the next chunk decides it; ``finish`` releases it as content, header or arguments.
- Marker text never reaches content, ids, names or arguments. A marker out of place is dropped
  and changes nothing, except: ``call_begin`` always begins a call (outside a section it opens
  one), and ``call_begin`` or ``section_end`` while a call is open ends that call incomplete;
  only ``call_end`` makes a call ``complete``.
- A call's first delta (id, name) comes when its header ends: at ``argument_begin``, or with
  arguments "" at ``call_end``. A header cut off (by ``finish``, ``call_begin`` or ``section_end``)
  is dropped with its text: its name may be cut short, and a client dispatching by name must never
  get a name no tool has. Argument text follows as it arrives. ``finish`` with a call's arguments
  open leaves it ``complete=False`` with what it has.
- Arguments are verbatim, not validated: malformed JSON passes through, so validate before
  use, as OpenAI advises. Only a real marker (a special token, never inside JSON) ends them.
- Whatever the chunking, the deltas add up to ``content`` and to each call's ``arguments``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

_TEXT, _SECTION, _HEADER, _ARGUMENTS = "text", "section", "header", "arguments"


@dataclass(frozen=True)
class ToolCallMarkers:
    """The five strings that frame a tool-call section and its calls, and other spellings a model writes for them
    (as text: no special token), each taken as the marker it stands for."""

    section_begin: str
    section_end: str
    call_begin: str
    argument_begin: str
    call_end: str
    spellings: tuple[tuple[str, str], ...] = ()  # (another spelling, the marker it stands for)

    def all(self) -> tuple[str, ...]:
        """The five markers and their other spellings."""
        return (*self.tokens(), *(spelling for spelling, _ in self.spellings))

    def tokens(self) -> tuple[str, ...]:
        """The five markers alone (the tokenizer's special tokens)."""
        return (self.section_begin, self.section_end, self.call_begin, self.argument_begin, self.call_end)

    def canonical(self, marker: str) -> str:
        """The marker a spelling stands for (a marker stands for itself)."""
        return dict(self.spellings).get(marker, marker)


def undecided_tail(text: str, markers: Iterable[str]) -> int:
    """The length of the longest tail of `text` that is a proper start of one of `markers`: text a stream holds
    back, since the next chunk may complete the marker."""
    return max((n for m in markers for n in range(1, min(len(m), len(text) + 1))
                if text[-1] == m[n - 1] and text.endswith(m[:n])), default=0)


KIMI_K2_MARKERS = ToolCallMarkers("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                  "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                                  # K2 now and then writes the section markers singular, as plain text
                                  (("<|tool_call_section_begin|>", "<|tool_calls_section_begin|>"),
                                   ("<|tool_call_section_end|>", "<|tool_calls_section_end|>")))


@dataclass
class ToolCall:
    """One call as parsed so far."""

    id: str  # the header, stripped: "functions.get_weather:0"
    name: str  # "get_weather": before the last ":", then after the last "."
    arguments: str  # the model's argument text verbatim
    complete: bool  # True once call_end was seen

    def to_openai(self) -> dict:
        """The call as an entry of a chat.completion message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallDelta:
    """One streamed tool-call delta."""

    index: int  # the call's position in this message, 0-based
    id: str | None  # set only on the call's first delta
    name: str | None  # set only on the call's first delta
    arguments: str  # argument text added by this delta

    def to_openai(self) -> dict:
        """The delta as an entry of a chat.completion.chunk delta's ``tool_calls``."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedDelta:
    """What became final with one chunk."""

    content: str = ""  # assistant text
    calls: tuple[CallDelta, ...] = ()  # at most one delta per call index


class ToolCallParser:
    """Splits one streamed assistant message into content and tool calls (rules: module docstring)."""

    def __init__(self, markers: ToolCallMarkers = KIMI_K2_MARKERS) -> None:
        self.markers = markers
        self.calls: list[ToolCall] = []  # every call whose header has ended, in order
        self.content = ""  # all content released so far
        self._state = _TEXT
        self._buffer = ""  # text not yet decided: a proper prefix of a marker at most, between chunks
        self._header = ""  # the open call's header text so far
        self._reported = (0, 0, 0)  # len(content), len(calls), len(calls[-1].arguments) when last returned

    @property
    def called(self) -> bool:
        """At least one call was begun (its header may still be open)."""
        return bool(self.calls) or self._state == _HEADER

    def feed(self, text: str) -> ParsedDelta:
        """Take the next chunk of decoded text; returns the content and call deltas it made final."""
        self._buffer += text
        while hits := [(at, m) for m in self.markers.all() if (at := self._buffer.find(m)) >= 0]:
            at, marker = min(hits)
            self._release(self._buffer[:at])
            self._buffer = self._buffer[at + len(marker):]
            self._marker(marker)
        held = self._undecided_from()
        self._release(self._buffer[:held])
        self._buffer = self._buffer[held:]
        return self._delta()

    def finish(self) -> ParsedDelta:
        """End of generation: release the held text and end a call left open, incomplete."""
        self._release(self._buffer)
        self._buffer = ""
        self._end_call(complete=False)
        self._state = _TEXT
        return self._delta()

    def _undecided_from(self) -> int:
        """Where the buffer's tail that could still begin a marker starts (its length when none)."""
        return len(self._buffer) - undecided_tail(self._buffer, self.markers.all())

    def _release(self, text: str) -> None:
        """Final text, taken as the current state makes it: content, header or arguments."""
        if self._state == _TEXT:
            self.content += text
        elif self._state == _HEADER:
            self._header += text
        elif self._state == _ARGUMENTS:
            self.calls[-1].arguments += text

    def _marker(self, marker: str) -> None:
        """Act on a whole marker: move to the state it leads to, or drop it where it is out of place."""
        m, state, marker = self.markers, self._state, self.markers.canonical(marker)
        if marker == m.call_begin:
            self._end_call(complete=False)
            self._state, self._header = _HEADER, ""
        elif marker == m.argument_begin and state == _HEADER:
            self._open_call()
            self._state = _ARGUMENTS
        elif marker == m.call_end and state in (_HEADER, _ARGUMENTS):
            self._end_call(complete=True)
            self._state = _SECTION
        elif marker == m.section_begin and state == _TEXT:
            self._state = _SECTION
        elif marker == m.section_end and state != _TEXT:
            self._end_call(complete=False)
            self._state = _TEXT

    def _open_call(self) -> None:
        """The header has ended: the call joins ``calls``."""
        call_id = self._header.strip()  # "functions.get_weather:0" -> name "get_weather"
        if "functions.".startswith(call_id):  # cut inside the namespace ("func", "functions."): no name yet
            name = ""
        else:
            name = (call_id.rpartition(":")[0] if ":" in call_id else call_id).rpartition(".")[2]
        self.calls.append(ToolCall(call_id, name, "", complete=False))

    def _end_call(self, complete: bool) -> None:
        """End the open call, if any; a header still open becomes a call with arguments "" where call_end ends
        it (complete), and is dropped where it is cut off."""
        if self._state == _HEADER:
            if not complete:
                return
            self._open_call()
        if self._state in (_HEADER, _ARGUMENTS):
            self.calls[-1].complete = complete

    def _delta(self) -> ParsedDelta:
        """What was added since feed or finish last returned: content, and one delta per call touched."""
        content_from, calls_from, arguments_from = self._reported
        added = self.calls[calls_from - 1].arguments[arguments_from:] if calls_from else ""
        deltas = [CallDelta(calls_from - 1, None, None, added)] if added else []
        deltas += [CallDelta(i, self.calls[i].id, self.calls[i].name, self.calls[i].arguments)
                   for i in range(calls_from, len(self.calls))]
        self._reported = (len(self.content), len(self.calls), len(self.calls[-1].arguments) if self.calls else 0)
        return ParsedDelta(self.content[content_from:], tuple(deltas))
