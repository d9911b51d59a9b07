"""Tools a chat may call, checked, and how `tool_choice` steers Kimi K2: which token it may not sample and
which tokens the answer is made to begin with.

Kimi K2 opens its calls with `<|tool_calls_section_begin|>`. `none` (and a chat without tools)
forbids that token, so the model answers in text. `required` makes the answer begin with
`<|tool_calls_section_begin|><|tool_call_begin|>functions.` and the model picks the function; a
named function makes it begin with that call's whole header,
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>` (IDX: the
conversation's calls so far), so the model writes only its arguments. Those forced tokens are prefilled with the prompt (counted
in `prompt_tokens`) and parsed as the start of the answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ...core.errors import K2Error
from .schema_limits import check_schema
from .tool_calls import KIMI_K2_MARKERS

# OpenAI's rule for function names; it also keeps marker text out of a forced header.
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
MAX_TOOLS = 128  # tools one request declares, at most (as OpenAI)


def check_tools(tools, where: str = "tools") -> list[dict]:
    """OpenAI's `tools`: [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}],
    at most MAX_TOOLS, each schema within runtime/text/schema_limits.py's limits."""
    if not isinstance(tools, list):
        raise K2Error(f"`{where}` must be an array of tools")
    if len(tools) > MAX_TOOLS:
        raise K2Error(f"`{where}` declares {len(tools)} tools; at most {MAX_TOOLS} may be declared")
    names = []
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise K2Error(f'`{at}` must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}')
        unknown = set(tool) - {"type", "function"} | set(tool["function"]) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise K2Error(f"`{at}` has fields this server does not know: {', '.join(sorted(unknown))}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise K2Error(f"`{at}.function.name` must be 1 to 64 letters, digits, underscores or dashes, got "
                          f"{json.dumps(name)}")
        if not isinstance(function.get("description", ""), str):
            raise K2Error(f"`{at}.function.description` must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise K2Error(f"`{at}.function.parameters` must be a JSON Schema object")
        check_schema(function.get("parameters", {}), f"`{at}.function.parameters`")
        names.append(name)
    if len(set(names)) != len(names):
        raise K2Error(f"`{where}` declares a function name twice")
    return tools


def normalise_call_ids(messages: list[dict]) -> list[dict]:
    """The chat with every earlier call's id as Kimi K2 writes it, `functions.<name>:<index>` (the index counts
    the conversation's calls from 0), whatever form the client kept (`search:0`, `call_abc`), and each tool
    result's `tool_call_id` renamed with its call's (K2-Vendor-Verifier's advice: the ids K2 learned)."""
    renamed, index, out = {}, 0, []
    for message in messages:
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                kimi_id = f"functions.{call['function']['name']}:{index}"
                renamed.setdefault(call["id"], kimi_id)
                calls.append({**call, "id": kimi_id})
                index += 1
            message = {**message, "tool_calls": calls}
        elif message.get("role") == "tool" and message.get("tool_call_id") in renamed:
            message = {**message, "tool_call_id": renamed[message["tool_call_id"]]}
        out.append(message)
    return out


def calls_made(messages: list[dict] | None) -> int:
    """How many calls the chat's assistant turns made: the index of the answer's first call."""
    return sum(len(m.get("tool_calls") or ()) for m in messages or ())


def check_tool_choice(choice, tools: list[dict] | None) -> str | dict:
    """`none`, `auto`, `required` or {"type": "function", "function": {"name": NAME}} naming a declared tool."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in CHOICES:
        if choice == "required" and not tools:
            raise K2Error("`tool_choice` \"required\" needs `tools`")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise K2Error('`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": NAME}}')
    if name not in {t["function"]["name"] for t in tools or []}:
        raise K2Error(f"`tool_choice` names the function {name!r}, which `tools` does not declare")
    return {"type": "function", "function": {"name": name}}


@dataclass(frozen=True)
class ToolSteering:
    """What a chat's tool choice does to generation: the answer's forced first text and a banned token."""

    forced_text: str  # markup the answer is made to begin with ("" for none / auto)
    banned_ids: tuple[int, ...]  # token ids the model may not sample

    @classmethod
    def plan(cls, tokenizer, tools: list[dict] | None, choice: str | dict, call_index: int = 0) -> ToolSteering:
        """call_index: the index the answer's first call takes (`calls_made` of the chat so far)."""
        has_markers = all(m in tokenizer.special_ids for m in KIMI_K2_MARKERS.tokens())
        if tools and not has_markers:
            raise K2Error("this artifact's tokenizer has no Kimi K2 tool-call tokens (<|tool_calls_section_begin|> "
                          "...); tool calls are supported in Kimi K2's format only")
        if not has_markers:
            return cls("", ())
        begin = KIMI_K2_MARKERS.section_begin + KIMI_K2_MARKERS.call_begin
        if choice == "none" or not tools:  # neither marker that can open a call (call_begin opens a section too)
            return cls("", tuple(tokenizer.special_ids[m] for m in (KIMI_K2_MARKERS.section_begin,
                                                                    KIMI_K2_MARKERS.call_begin)))
        if choice == "required":
            return cls(begin + "functions.", ())
        if isinstance(choice, dict):
            return cls(f"{begin}functions.{choice['function']['name']}:{call_index}{KIMI_K2_MARKERS.argument_begin}",
                       ())
        return cls("", ())

    def forced_ids(self, tokenizer) -> list[int]:
        """The forced text as tokens: markers as special tokens, the function name as text (a checked name)."""
        return tokenizer.encode(self.forced_text, allow_special=True) if self.forced_text else []
