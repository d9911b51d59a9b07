"""A thinking model's answer split as it streams: its reasoning (between `<think>` and `</think>`, as Kimi-K2-Thinking
writes it before its answer or tool calls) apart from the answer's text.

Text goes in as it becomes final; each feed returns what it adds to the reasoning and to the answer. The answer
is in reasoning from its start when it opens with `<think>` (or when the chat template opened thinking, so the
prompt ends with it), until `</think>`; both markers leave the text. A tool-call section (or call) that opens
before `</think>` (Kimi-K2-Thinking does this) ends the reasoning too, and stays in the answer, where its calls are
parsed. A tail that could still grow into a marker is held back until it does or cannot. An answer with no
`<think>` at its start is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_calls import KIMI_K2_MARKERS, undecided_tail

THINK_BEGIN, THINK_END = "<think>", "</think>"
# what opens tool calls, in any spelling: it ends the reasoning where the model calls before closing it
CALLS_OPEN = tuple(m for m in KIMI_K2_MARKERS.all()
                   if KIMI_K2_MARKERS.canonical(m) in (KIMI_K2_MARKERS.section_begin, KIMI_K2_MARKERS.call_begin))

_OPENING, _REASONING, _ANSWER = "opening", "reasoning", "answer"


@dataclass(frozen=True)
class Split:
    reasoning: str = ""
    answer: str = ""


class ReasoningSplitter:
    def __init__(self, thinking: bool = False):
        """thinking: the prompt already opened the reasoning (it ends with `<think>`)."""
        self._state = _REASONING if thinking else _OPENING
        self._held = ""

    def feed(self, text: str) -> Split:
        self._held += text
        reasoning, answer = [], []
        while self._held:
            if self._state == _OPENING:  # only whitespace may come before <think>
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_BEGIN):
                    self._state, self._held = _REASONING, stripped[len(THINK_BEGIN):]
                elif THINK_BEGIN.startswith(stripped):
                    break  # it may still become <think>
                else:
                    self._state = _ANSWER
            elif self._state == _REASONING:
                hits = [(at, m) for m in (THINK_END, *CALLS_OPEN) if (at := self._held.find(m)) >= 0]
                if hits:
                    end, marker = min(hits)
                    reasoning.append(self._held[:end])
                    self._state = _ANSWER  # </think> leaves the text; calls stay for the answer's parser
                    self._held = self._held[end + len(THINK_END):] if marker == THINK_END else self._held[end:]
                else:
                    keep = undecided_tail(self._held, (THINK_END, *CALLS_OPEN))
                    reasoning.append(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    break
            else:
                answer.append(self._held)
                self._held = ""
        return Split("".join(reasoning), "".join(answer))

    def finish(self) -> Split:
        """End of the answer: what is held is final (reasoning cut off without its end stays reasoning)."""
        held, self._held = self._held, ""
        return Split(held, "") if self._state == _REASONING else Split("", held)



def reasoning_splitter(tokenizer, prompt_ids: list[int]) -> ReasoningSplitter | None:
    """A splitter for a chat answer where the tokenizer has the think markers (None where it has not: the model
    does not think); thinking from the start where the prompt ends with `<think>`."""
    if tokenizer is None or THINK_END not in tokenizer.special_ids:
        return None
    opened = tokenizer.special_ids.get(THINK_BEGIN)
    return ReasoningSplitter(thinking=bool(prompt_ids) and prompt_ids[-1] == opened)
