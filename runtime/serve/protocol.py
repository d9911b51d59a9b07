"""The OpenAI API's side of the server: request bodies checked into `Options`, responses and errors shaped.

Checking is strict: a field of the wrong type, a value out of range or an option this server
does not implement is a 400 with OpenAI's error body, never a silent default. Options that
clients send at their neutral value (`n: 1`, `presence_penalty: 0`, `logprobs: null`, ...) pass.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...core.errors import K2Error
from ...core.json_files import loads
from ..text.chat_tools import check_tool_choice, check_tools, normalise_call_ids
from ..text.schema_limits import SchemaTooLarge, check_schema
from ..engine.requests import TokenLogprob
from ..engine.sampling import BIAS_RANGE, MAX_TOP_LOGPROBS, PENALTY_RANGE, SEED_RANGE

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # serve --max-request-bytes
DEFAULT_BODY_TIMEOUT_S = 30.0  # serve --body-timeout
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256  # characters of one stop string, at most: each token's text is checked against them all
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Options a client may send as long as they ask for nothing this server would have to do.
NEUTRAL_VALUES = {
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
}
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_CHOICES = 16  # n, at most
MAX_PROMPTS = 64  # prompts in one /v1/completions request, at most
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user",
                 "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                 "top_k", "min_p", "repetition_penalty"}  # the last three: extras other servers take too
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "response_format", "chat_template_kwargs"}
MAX_TEMPLATE_OPTIONS = 16
TEMPLATE_OPTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class ApiError(Exception):
    """An error answered as OpenAI does: an HTTP status and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Options:
    """What one completion or chat completion asks for, checked; the prompt is still text (or ids)."""

    chat: bool
    model: str
    prompts: tuple[str | list[int], ...] | None  # completions: each prompt, text or token ids
    messages: list[dict] | None  # chat: [{"role", "content"[, "name"]}], content as text
    max_tokens: int | None  # None: the rest of the context (chat) or 16 (completions, as OpenAI)
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): the counts in every chunk
    tools: list[dict] | None = None  # chat: OpenAI's function tools, checked
    tool_choice: str | dict = "none"  # "none", "auto", "required" or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none asked; n: the sampled token's and the n likeliest tokens'
    json_answer: bool = False  # response_format json_object or json_schema: the answer is one JSON value
    json_schema: dict | None = None  # ... that follows this schema (None: any JSON object)
    n: int = 1  # choices per prompt
    template_options: tuple[tuple[str, bool | int | float], ...] = ()  # chat_template_kwargs, e.g. thinking


def parse_json(raw: bytes) -> dict:
    """A request's body: JSON in UTF-8, as RFC 8259 asks of JSON between systems (json.loads would take UTF-16 or
    UTF-32 bytes too, by their first bytes) -> the object; a 400 naming what is wrong."""
    try:
        body = loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise bad_request(f"We could not parse the JSON body of your request ({why}). The body must be a JSON object.",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body of your request must be a JSON object.", code="invalid_json")
    return body


def parse_options(body: dict, chat: bool) -> Options:
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in allowed:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name,
                              code="unrecognized_argument")
    for name, neutral in NEUTRAL_VALUES.items():
        if name in body and not _is_neutral(body[name], neutral):
            raise bad_request(f"`{name}` {json.dumps(body[name])} is not supported by this server "
                              f"(it accepts only {' or '.join(json.dumps(v) for v in neutral)})", param=name,
                              code="unsupported_option")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a string", param="model")
    stream = _optional(body, "stream", bool, False)
    stream_options = _optional(body, "stream_options", dict, None)
    if stream_options is not None and not stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true", param="stream_options")
    include_usage = continuous_usage = False
    if stream_options is not None:
        unknown = set(stream_options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise bad_request(f"`stream_options.{min(unknown)}` is not supported", param="stream_options")
        include_usage = _optional(stream_options, "include_usage", bool, False, label="stream_options.include_usage")
        continuous_usage = _optional(stream_options, "continuous_usage_stats", bool, False,
                                     label="stream_options.continuous_usage_stats")
    max_tokens = _max_tokens(body, chat)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad_request("`top_p` must be greater than 0 (use temperature 0 for greedy decoding)", param="top_p")
    seed = _optional(body, "seed", int, None)
    if seed is not None and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise bad_request("`seed` must fit in a signed 64-bit integer", param="seed")
    _optional(body, "user", str, None)
    tools, tool_choice = _tools(body) if chat else (None, "none")
    top_k = _optional(body, "top_k", int, 0)
    if top_k < -1:
        raise bad_request(f"`top_k` must be -1 or 0 (no limit) or a positive number of tokens, got {top_k}",
                          param="top_k")
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if repetition_penalty == 0:
        raise bad_request("`repetition_penalty` must be greater than 0 (1: none)", param="repetition_penalty")
    n = _optional(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"`n` must lie in [1, {MAX_CHOICES}], got {n}", param="n")
    return Options(chat=chat, model=model, prompts=None if chat else _prompts(body), n=n,
                   messages=_messages(body) if chat else None, max_tokens=max_tokens, temperature=temperature,
                   top_p=top_p, seed=seed, stop=_stop(body), stream=stream, include_usage=include_usage,
                   continuous_usage=continuous_usage,
                   tools=tools, tool_choice=tool_choice,
                   parallel_tool_calls=_optional(body, "parallel_tool_calls", bool, True),
                   presence_penalty=_number(body, "presence_penalty", 0.0, *PENALTY_RANGE),
                   frequency_penalty=_number(body, "frequency_penalty", 0.0, *PENALTY_RANGE),
                   repetition_penalty=repetition_penalty, top_k=max(top_k, 0),
                   min_p=_number(body, "min_p", 0.0, 0.0, 1.0), logit_bias=_logit_bias(body),
                   logprobs=_logprobs(body, chat), template_options=_template_options(body),
                   **_response_format(body, tools))


def _template_options(body: dict) -> tuple[tuple[str, bool | int | float], ...]:
    """chat_template_kwargs: up to 16 variables for the chat template, named as identifiers, each a boolean or a
    finite number (text could carry special tokens into the prompt)."""
    value = _optional(body, "chat_template_kwargs", dict, {})
    if len(value) > MAX_TEMPLATE_OPTIONS:
        raise bad_request(f"`chat_template_kwargs` takes at most {MAX_TEMPLATE_OPTIONS} entries", param="chat_template_kwargs")
    for name, item in value.items():
        if not TEMPLATE_OPTION_NAME.match(name):
            raise bad_request(f"`chat_template_kwargs` names must be identifiers, got {json.dumps(name)}",
                              param="chat_template_kwargs")
        if not isinstance(item, bool | int | float) or (isinstance(item, float) and not math.isfinite(item)):
            raise bad_request(f"`chat_template_kwargs.{name}` must be a boolean or a number, got "
                              f"{json.dumps(item)[:100]}", param="chat_template_kwargs")
    return tuple(value.items())


def _response_format(body: dict, tools: list[dict] | None) -> dict:
    """{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}} -> the Options fields json_answer and json_schema."""
    value = _optional(body, "response_format", dict, {"type": "text"})
    kind = value.get("type")
    if kind == "text":
        return {}
    if kind not in ("json_object", "json_schema"):
        raise bad_request(f"`response_format.type` must be text, json_object or json_schema, got {json.dumps(kind)}",
                          param="response_format")
    if tools:
        raise bad_request("`response_format` JSON and `tools` together are not supported; send one of them",
                          param="response_format", code="unsupported_option")
    if kind == "json_object":
        return {"json_answer": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema", {}), dict):
        raise bad_request('`response_format.json_schema` must be {"name": ..., "schema": {...}[, "strict": ...]}',
                          param="response_format")
    try:
        check_schema(spec.get("schema", {}), "`response_format.json_schema.schema`")
    except SchemaTooLarge as exc:
        raise bad_request(str(exc), param="response_format") from None
    return {"json_answer": True, "json_schema": spec.get("schema", {})}


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} -> ((id, bias), ...); the ids are checked against the vocabulary later."""
    value = _optional(body, "logit_bias", dict, {})
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"`logit_bias` takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}", param="logit_bias")
    pairs = []
    for key, bias in value.items():
        if not (key.isdigit() and len(key) <= 9):
            raise bad_request(f"`logit_bias` keys must be token ids, got {json.dumps(key)}", param="logit_bias")
        if not isinstance(bias, int | float) or isinstance(bias, bool) or not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]:
            raise bad_request(f"`logit_bias` values must be numbers in [-100, 100], got {json.dumps(bias)} for "
                              f"token {key}", param="logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: `logprobs` true, with `top_logprobs` 0-20; completions: `logprobs` 0-20 (the top count) -> the count,
    or None when no log-probabilities are asked for."""
    if not chat:
        count = _optional(body, "logprobs", int, None)
        if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
            raise bad_request(f"`logprobs` must lie in [0, {MAX_TOP_LOGPROBS}], got {count}", param="logprobs")
        return count
    wanted = _optional(body, "logprobs", bool, False)
    top = _optional(body, "top_logprobs", int, None)
    if top is not None and not wanted:
        raise bad_request("`top_logprobs` needs `logprobs` set to true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"`top_logprobs` must lie in [0, {MAX_TOP_LOGPROBS}], got {top}", param="top_logprobs")
    return (top or 0) if wanted else None


def max_new_tokens(options: Options, prompt_tokens: int, context: int) -> int:
    """The tokens this request may generate, or a 400 when the prompt and max_tokens do not fit the context."""
    if prompt_tokens == 0:
        raise bad_request("The prompt is empty; give at least one token.",
                          param="messages" if options.chat else "prompt")
    requested = options.max_tokens
    if requested is None:
        requested = max(context - prompt_tokens, 1) if options.chat else 16
    if prompt_tokens + requested > context:
        prompt_param = "messages" if options.chat else "prompt"
        raise bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                          f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the "
                          f"completion). Please reduce the prompt or max_tokens.",
                          param=prompt_param if prompt_tokens >= context else "max_tokens",
                          code="context_length_exceeded")
    return requested


def _is_neutral(value, neutral: tuple) -> bool:
    """null, or equal to a neutral value with the same JSON type (true is not 1, 0.0 is 0)."""
    if value is None:
        return True
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _type_name(kind) -> str:
    return {bool: "a boolean", int: "an integer", str: "a string", dict: "an object", list: "an array"}[kind]


def _optional(body: dict, name: str, kind, default, label: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise bad_request(f"`{label or name}` must be {_type_name(kind)}, got {json.dumps(value)}", param=label or name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise bad_request(f"`{name}` must be a number, got {json.dumps(value)}", param=name)
    if not low <= value <= high:
        raise bad_request(f"`{name}` must lie in [{low:g}, {high:g}], got {value}", param=name)
    return float(value)


def _max_tokens(body: dict, chat: bool) -> int | None:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = _optional(body, name, int, None)
    if value is not None and value < 1:
        raise bad_request(f"`{name}` must be at least 1, got {value}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"`stop` must be a string or an array of strings, got {json.dumps(value)}", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"`stop` takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise bad_request("`stop` strings must not be empty", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"`stop` strings may hold at most {MAX_STOP_CHARS} characters", param="stop")
    return tuple(stops)


def _prompts(body: dict) -> tuple[str | list[int], ...]:
    """`prompt`: a string, an array of token ids, or an array of either (a choice, or n, for each)."""
    prompt = body.get("prompt")
    if _is_one_prompt(prompt):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(_is_one_prompt(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(f"`prompt` takes at most {MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
        return tuple(prompt)
    raise bad_request("`prompt` is required: a string, an array of token ids, or an array of either",
                      param="prompt")


def _is_one_prompt(prompt) -> bool:
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt))


def _tools(body: dict) -> tuple[list[dict] | None, str | dict]:
    tools = body.get("tools") or None
    try:
        if tools is not None:
            check_tools(tools)
        return tools, check_tool_choice(body.get("tool_choice"), tools)
    except K2Error as exc:
        raise bad_request(str(exc), param="tool_choice" if "tool_choice" in str(exc) else "tools") from None


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` is required: a non-empty array of messages", param="messages")
    return normalise_call_ids([_message(message, f"messages[{i}]") for i, message in enumerate(messages)])


def _message(message, where: str) -> dict:
    """One chat message, checked: role, content as text, name; an assistant's tool_calls; a tool's tool_call_id."""
    if not isinstance(message, dict):
        raise bad_request(f"`{where}` must be an object", param=where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"`{where}.role` must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}",
                          param=f"{where}.role")
    allowed = {"role", "content", "name"} | {"assistant": {"tool_calls", "reasoning_content"},
                                             "tool": {"tool_call_id"}}.get(role, set())
    unknown = set(message) - allowed
    if unknown:
        raise bad_request(f"`{where}.{min(unknown)}` is not supported by this server", param=where,
                          code="unsupported_option")
    calls = message.get("tool_calls") or None
    entry = {"role": role, "content": _content(message.get("content"), f"{where}.content", role)}
    if message.get("name") is not None:
        entry["name"] = _optional(message, "name", str, None, label=f"{where}.name")
    if calls is not None:
        entry["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if message.get("reasoning_content") is not None:  # a thinking model's template may keep the last turn's
        entry["reasoning_content"] = _optional(message, "reasoning_content", str, None,
                                               label=f"{where}.reasoning_content")
    if role == "tool":
        entry["tool_call_id"] = _optional(message, "tool_call_id", str, None, label=f"{where}.tool_call_id")
        if entry["tool_call_id"] is None:
            raise bad_request(f"`{where}.tool_call_id` is required in a tool message", param=f"{where}.tool_call_id")
    return entry


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant's earlier calls: [{"id", "type": "function", "function": {"name", "arguments" (a string)}}]."""
    if not isinstance(calls, list):
        raise bad_request(f"`{where}` must be an array of tool calls", param=where)
    checked = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and call.get("type", "function") == "function" and isinstance(call.get("id"), str)
                and isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)):
            raise bad_request(f'`{where}[{i}]` must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                              f'"arguments": "<JSON text>"}}}}', param=f"{where}[{i}]")
        checked.append({"id": call["id"], "type": "function",
                        "function": {"name": function["name"], "arguments": function["arguments"]}})
    return checked


def _content(content, where: str, role: str) -> str:
    """A message's text: a string, or an array of {"type": "text", "text": ...} parts joined."""
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise bad_request(f"`{where}`: only text parts are supported", param=where, code="unsupported_option")
    raise bad_request(f"`{where}` must be a string or an array of text parts", param=where)


# -- responses ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """Names one response: its id, creation time and model, shared by all its chunks."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, index: int, text: str, finish_reason: str, tool_calls: list[dict] | None = None,
               token_ids: list[int] | None = None, logprobs: dict | None = None, reasoning: str = "") -> dict:
        """One whole answer of a response; `token_ids` (the generated ids) only where the artifact has no
        tokenizer to give text; `reasoning`: a thinking model's reasoning, as `reasoning_content`."""
        if self.chat:
            message = {"role": "assistant", "content": text or None if tool_calls else text}
            message |= {"reasoning_content": reasoning} if reasoning else {}
            return {"index": index, "message": message | ({"tool_calls": tool_calls} if tool_calls else {}),
                    "logprobs": logprobs, "finish_reason": finish_reason}
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return choice | ({"token_ids": token_ids} if token_ids is not None else {})

    def response(self, choices: list[dict], usage: dict) -> dict:
        return self._envelope("chat.completion" if self.chat else "text_completion", choices) | {"usage": usage}

    def chunk(self, text: str, finish_reason: str | None = None, role: bool = False,
              tool_calls: list[dict] | None = None, token_ids: list[int] | None = None,
              logprobs: dict | None = None, index: int = 0, reasoning: str = "") -> dict:
        """One streamed piece of choice `index`; `role` marks a chat choice's first chunk, which names the
        assistant; `reasoning` goes out as `reasoning_content`."""
        if self.chat:
            delta = {"reasoning_content": reasoning} if reasoning else {}
            if text or not (finish_reason or tool_calls or reasoning):  # content may be empty (a token's first bytes)
                delta["content"] = text
            delta |= {"tool_calls": tool_calls} if tool_calls else {}
            delta = {"role": "assistant"} | delta if role else delta
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", []) | {"usage": usage}


def logprobs_object(chat: bool, entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes],
                    text_offset: int = 0) -> dict:
    """OpenAI's logprobs of some sampled tokens: chat's {"content": [{token, logprob, bytes, top_logprobs}]}, or
    completions' {tokens, token_logprobs, top_logprobs, text_offset} (offsets from text_offset on). A token's text
    is its bytes as UTF-8, a piece of a character as U+FFFD (chat's `bytes` keep the piece)."""
    def token_text(token: int) -> str:
        return token_bytes(token).decode("utf-8", "replace")

    if chat:
        def item(token: int, logprob: float) -> dict:
            return {"token": token_text(token), "logprob": logprob, "bytes": list(token_bytes(token))}

        return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}
    tokens = [token_text(e.token) for e in entries]
    offsets = [text_offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_first_of((token_text(t), lp) for t, lp in e.top) for e in entries], "text_offset": offsets}


def _first_of(pairs) -> dict:
    """A dict of (key, value) pairs where a repeated key keeps its first value (tokens of the same text: the
    likeliest)."""
    out: dict = {}
    for key, value in pairs:
        out.setdefault(key, value)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          speculative: dict | None = None) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache, not prefilled; speculative:
    the drafted tokens, the accepted ones and the forwards that gave the tokens (runtime/engine/speculation.py)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}} | ({"speculative": speculative} if speculative
                                                                        else {})


def models_list(model: str, created: int, context: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "k2deploy",
                                        "max_model_len": context}]}


def sse(obj: dict) -> str:
    """One server-sent event; the stream ends with `data: [DONE]`."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
