"""Constrained decoding (llguidance): what an answer must be, as a grammar, and a matcher per request that masks
the logits of every step to the tokens that keep the answer inside it.

Two kinds of answer are constrained:
- `response_format` json_object / json_schema: the whole answer is one JSON value (an object, or one that follows
  the schema), spaced as JSON is written (compact, with spaces after separators, or indented), never padded;
- tool calls, when tools are declared: free text, then at most one section of calls in Kimi K2's format, each
  naming a declared function and carrying arguments that follow its `parameters` schema (`strict: true`: exactly
  that schema, refused if the engine cannot compile it; otherwise the schema where it compiles, else any JSON
  object). `tool_choice` "required" or a named function makes the section (or that call) the whole answer.
Without tools no call can start at all (runtime/text/chat_tools.py bans the markers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ...core.errors import K2Error
from .schema_limits import SchemaTooLarge, check_schema
from .tool_calls import KIMI_K2_MARKERS

# JSON as a model writes it: between two of its tokens, what json.dumps writes (nothing, a space after "," or ":",
# or a line break and its indentation in spaces or in tabs) and no more, so an answer that already keeps to the
# schema passes unchanged whatever spacing it chose, and a weak model cannot pad one: at most one space, then at
# most one line break and 32 spaces or 16 tabs, between two JSON tokens (benchmarks/json_padding.py: answers
# drawn from random logits to a three-field schema carry 21 whitespace characters on average, 38 at most, against
# 1 / 3 for compact JSON and 28 / 47 with 4 blanks and 64 of indentation)
WHITESPACE = r" ?(\r?\n( {0,32}|\t{0,16}))?"
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE}
MAX_CALL_INDEX_DIGITS = 3


def parser_limits():
    """The engine's limits, stated rather than left to its version's defaults: its fuel bounds the work of a
    compile and of each step's mask (a grammar past them is an error for its request, never a stall), and a
    schema within runtime/text/schema_limits.py's limits stays inside them (its widest object about half a row)."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                          step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
                          verbose_errors=False)


class GrammarError(K2Error):
    """A schema or grammar the engine cannot compile: the request's fault, answered with a 400."""


# How a thinking model's reasoning comes before the constrained answer: not at all (the model does not think),
# "may" (an optional <think> ... </think> first) or "open" (the prompt opened it: reasoning, then </think>)
THINKING = {None: "start: answer", "may": "start: think? answer\nthink: <think> REASONING </think>",
            "open": "start: REASONING </think> answer"}
# with tools: a section of calls may also end the reasoning before its </think> (Kimi-K2-Thinking calls so)
THINKING_THEN_CALLS = {None: THINKING[None],
                       "may": "start: think? answer | <think> REASONING section\nthink: <think> REASONING </think>",
                       "open": "start: REASONING </think> answer | REASONING section"}


def json_grammar(schema: dict | None, thinking: str | None = None) -> str:
    """Any JSON object (schema None), or a JSON value that follows `schema`; after the reasoning, where the model
    thinks (THINKING)."""
    from llguidance import LLMatcher

    schema = _compact({"type": "object"} if schema is None else schema)
    if thinking is None:
        return LLMatcher.grammar_from_json_schema(schema)
    return LLMatcher.grammar_from_lark(_with_thinking(thinking, [f"answer: %json {json.dumps(schema)}"]))


def _with_thinking(thinking: str | None, rules: list[str], starts: dict = THINKING) -> str:
    return "\n".join([starts[thinking], r"REASONING: /(.|\n)*/", *rules])


def tools_grammar(tools: list[dict], choice: str | dict, single_call: bool, thinking: str | None = None) -> str:
    """Kimi K2's answer with calls to `tools` (OpenAI's checked `tools`): free text and a section of calls
    (choice "auto"), the section alone ("required"), or the section with calls to one function ({"function":
    {"name"}}); single_call: one call in the section (parallel_tool_calls false); after the reasoning, where the
    model thinks (THINKING)."""
    from llguidance import LLMatcher

    m = KIMI_K2_MARKERS
    functions = [t["function"] for t in tools]
    if isinstance(choice, dict):
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
    calls = [f'fn_{i}: "functions.{f["name"]}:" INDEX {m.argument_begin} args_{i}\n'
             f'args_{i}: %json {json.dumps(_arguments_schema(f))}' for i, f in enumerate(functions)]
    answer = {"auto": "answer: TEXT | TEXT? section"}.get(choice if isinstance(choice, str) else "", "answer: section")
    lark = _with_thinking(thinking, [
        answer,
        r"TEXT: /(.|\n)+/",
        f"section: {m.section_begin} call{'' if single_call else '+'} {m.section_end}",
        f"call: {m.call_begin} ({' | '.join(f'fn_{i}' for i in range(len(functions)))}) {m.call_end}",
        f"INDEX: /[0-9]{{1,{MAX_CALL_INDEX_DIGITS}}}/",
        *calls,
    ], THINKING_THEN_CALLS)
    return LLMatcher.grammar_from_lark(lark)


def thinking_mode(tokenizer, prompt_ids: list[int]) -> str | None:
    """THINKING's key for a chat answer: None where the tokenizer has no think markers, "open" where the prompt
    ends with <think>, else "may"."""
    if "</think>" not in tokenizer.special_ids:
        return None
    return "open" if prompt_ids and prompt_ids[-1] == tokenizer.special_ids.get("<think>") else "may"


def _arguments_schema(function: dict) -> dict:
    """The schema a call's arguments are held to: its parameters (strict: exactly; else if the engine compiles
    them), else any JSON object."""
    from llguidance import LLMatcher

    schema = _compact(function.get("parameters") or {"type": "object", "properties": {}})
    errors = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema), limits=parser_limits())
    if not errors:
        return schema
    if function.get("strict"):
        raise GrammarError(f"tool {function['name']}: its parameters schema cannot be enforced ({errors}); "
                           f"simplify it or leave `strict` off")
    return _compact({"type": "object"})


def _compact(schema: dict) -> dict:
    """The schema as the engine takes it (JSON_OPTIONS), once it is within runtime/text/schema_limits.py's limits."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {json.dumps(schema)[:100]}")
    try:
        check_schema(schema)
    except SchemaTooLarge as exc:
        raise GrammarError(str(exc)) from None
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


class Grammars:
    """One model's vocabulary in llguidance's form (made on first use) and the matchers made over it."""

    def __init__(self, tokenizer, vocab_size: int):
        """tokenizer: the artifact's ChatTokenizer; vocab_size: the model's logits width."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._vocabulary = None

    def constraint(self, grammar: str, forced_ids: list[int] = ()) -> Constraint:
        """A fresh matcher of `grammar` that has already read `forced_ids` (the start of the answer that
        tool_choice prefilled with the prompt); a GrammarError where the grammar does not compile."""
        from llguidance import LLMatcher

        if self._vocabulary is None:
            self._vocabulary = self.tokenizer.grammar_tokenizer(self.vocab_size)
        errors = LLMatcher.validate_grammar(grammar, self._vocabulary, limits=parser_limits())
        if errors:
            raise GrammarError(f"the schema or grammar cannot be enforced: {errors}")
        matcher = LLMatcher(self._vocabulary, grammar, limits=parser_limits())
        if forced_ids and matcher.consume_tokens(list(forced_ids)) is False or matcher.is_error():
            raise GrammarError(f"the answer's forced start does not fit its grammar: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)


@dataclass
class Constraint:
    """One request's matcher: masks a step's logits, then reads the token sampled from them."""

    matcher: object  # llguidance.LLMatcher
    vocab_size: int

    def __post_init__(self) -> None:
        self._mask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # a bit per token, 1: allowed

    def allowed(self, logits: np.ndarray) -> np.ndarray:
        """logits [vocab] -> a copy with every token the grammar forbids next at -inf."""
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:logits.shape[0]].astype(bool)
        return np.where(bits, logits, -np.inf).astype(logits.dtype)

    def forced(self, limit: int) -> list[int]:
        """The next tokens the grammar forces (at most `limit`): each the only one its mask will allow, as the
        grammar's own tokenization writes the forced text."""
        return list(self.matcher.compute_ff_tokens())[:limit] if limit > 0 else []

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise K2Error(f"token {token} broke the answer's grammar: {self.matcher.get_error()}")
