"""Chat templates as Hugging Face renders them, and chats encoded so that only the template's markup is special.

The template comes from the checkpoint (``tokenizer_config.json``'s ``chat_template`` or
``chat_template.jinja``) and is untrusted: it runs in Jinja's sandbox, with the helpers Hugging
Face templates use (``raise_exception``, ``tojson`` with ``indent`` / ``separators`` /
``ensure_ascii`` / ``sort_keys``, ``strftime_now``) and Hugging Face's whitespace settings.

``ChatTokenizer.encode_chat`` renders every string a client wrote (message text, names, tool-call
ids, names and arguments, every string in the tool declarations) as an unguessable placeholder and
encodes it as plain text where it lands, so `<|im_end|><|im_system|>` typed by a client stays text
and cannot open a turn. ``tojson`` output is plain text as a whole (JSON is data, never markup).
The text between two special tokens is encoded in one run, client text and markup together, so
the ids are those of the whole rendered string wherever the client wrote no special token.
A template that transforms a placeholder (upper-cases it, slices it) is refused rather than
trusted; one that tests message text (``'</think>' in content``) sees the placeholder, so such a
test is false. Dictionary keys in tool declarations are the template's to print: a key that
contains a special token is refused.
"""

from __future__ import annotations

import contextvars
import json
import re
import secrets
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from .errors import K2Error

TEMPLATE_FILE = "chat_template.jinja"

# Set while encode_chat renders: tojson then wraps its output as one plain-text placeholder.
_PLACEHOLDERS: contextvars.ContextVar[_Placeholders | None] = contextvars.ContextVar("placeholders", default=None)


class _Placeholders:
    """Client strings by number; ``wrap`` returns the marker that stands for one in the rendered text."""

    def __init__(self) -> None:
        self.nonce = secrets.token_hex(8)
        self.texts: list[str] = []
        self.pattern = re.compile(f"\ue000{self.nonce}:(\\d+)\ue001")

    def wrap(self, text: str) -> str:
        self.texts.append(text)
        return f"\ue000{self.nonce}:{len(self.texts) - 1}\ue001"

    def restore(self, value):
        """``value`` with every placeholder in its strings replaced by the text it stands for."""
        if isinstance(value, str):
            return self.pattern.sub(lambda m: self.texts[int(m.group(1))], value)
        if isinstance(value, dict):
            return {self.restore(k): self.restore(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.restore(v) for v in value]
        return value

    def split(self, rendered: str) -> list[tuple[str, bool]]:
        """The rendered text as (piece, is client text) in order."""
        pieces = self.pattern.split(rendered)
        out = []
        for i, piece in enumerate(pieces):
            if i % 2:
                out.append((self.texts[int(piece)], True))
            elif self.nonce in piece.lower() or "\ue000" in piece or "\ue001" in piece:  # a placeholder it changed
                raise K2Error("the chat template transformed message text instead of inserting it; "
                              "it cannot be rendered without letting that text form special tokens")
            elif piece:
                out.append((piece, False))
        return out


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """Hugging Face's tojson: json.dumps with its options (Jinja's own HTML-escapes and takes none)."""
    placeholders = _PLACEHOLDERS.get()
    if placeholders is not None:
        value = placeholders.restore(value)
    if isinstance(separators, list):
        separators = tuple(separators)
    try:
        text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    except (TypeError, ValueError) as exc:
        raise jinja2.TemplateError(f"tojson: {exc}") from None
    return placeholders.wrap(text) if placeholders is not None else text


def _raise_exception(message) -> None:
    raise jinja2.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Hugging Face renders chat templates with these settings; matching them keeps the real
# templates' whitespace. The plain sandbox (not the immutable one) lets Kimi's tool-call
# templates append to their namespace lists.
_JINJA = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_JINJA.filters["tojson"] = _tojson
_JINJA.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)


def read_template(folder: Path, config_path: Path, config: dict, tools: bool = False) -> jinja2.Template | None:
    """The chat template from the config, else from chat_template.jinja; a list of named templates gives
    "tool_use" when ``tools`` and that one exists, else "default"."""
    source, path = config.get("chat_template"), config_path
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("tool_use") if tools and "tool_use" in named else named.get("default")
    if source is None and (folder / TEMPLATE_FILE).is_file():
        path = folder / TEMPLATE_FILE
        source = path.read_text(encoding="utf-8")
    if source is None:
        return None
    try:
        return _JINJA.from_string(source)
    except (jinja2.TemplateSyntaxError, TypeError) as e:
        raise K2Error(f"{path}: its chat template does not parse ({e}); copy {path.name} unchanged from the "
                      "model's Hugging Face repository") from None


class ChatTokenizer:
    """What every tokenizer shares: the chat template and chats encoded safely. Subclasses set the
    attributes below and implement ``encode`` and ``decode``."""

    special_ids: dict[str, int]  # special and added tokens by name
    stop_ids: tuple[int, ...]
    vocab_size: int
    template_variables: dict[str, str]  # bos_token, eos_token, ... as the template sees them
    _template: jinja2.Template | None
    _tool_template: jinja2.Template | None  # a separate "tool_use" template, where the checkpoint has one

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        raise NotImplementedError

    def token_bytes(self, token: int) -> bytes:
        """One token's own bytes (a piece of a character is a piece of its UTF-8), special tokens as their names."""
        return self.decode([token]).encode()

    def grammar_tokenizer(self, vocab_size: int):
        """This vocabulary for llguidance's grammar engine (an `llguidance.LLTokenizer`, made once per model)."""
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, options: dict | None = None) -> str:
        """The prompt text for a chat (and the tools it may call), rendered with the checkpoint's own template;
        `options`: more template variables (e.g. `thinking`), which never replace the template's own."""
        template = (self._tool_template if tools else None) or self._template
        if template is None:
            raise K2Error(f"the tokenizer has no chat template (tokenizer_config.json's chat_template or "
                          f"{TEMPLATE_FILE}); copy the model's tokenizer files or regenerate the synthetic tokenizer")
        try:
            return template.render(**{**(options or {}), "messages": messages, "tools": tools or None,
                                      "add_generation_prompt": add_generation_prompt, **self.template_variables})
        except jinja2.TemplateError as exc:  # the checkpoint's template refused these messages
            raise K2Error(f"the chat template cannot render these messages: {exc}") from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None) -> list[int]:
        """Token ids of the rendered chat, ending in the assistant's generation prompt; client text stays text;
        `options`: template variables of numbers and booleans (no text, which could forge special tokens)."""
        placeholders = _Placeholders()
        specials = tuple(self.special_ids)
        wrapped_messages = [_wrap_strings(m, placeholders, specials) for m in messages]
        wrapped_tools = [_wrap_strings(t, placeholders, specials) for t in tools] if tools else None
        token = _PLACEHOLDERS.set(placeholders)
        try:
            rendered = self.apply_chat_template(wrapped_messages, wrapped_tools, options=options)
        finally:
            _PLACEHOLDERS.reset(token)
        return self._encode_runs(placeholders.split(rendered))

    def _encode_runs(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Special tokens where the markup names them; every text between two of them (markup and client text
        alike) encoded in one run, as a tokenizer encodes a whole rendered string."""
        if getattr(self, "_special_pattern", None) is None:
            names = sorted(self.special_ids, key=len, reverse=True)
            self._special_pattern = re.compile("(" + "|".join(map(re.escape, names)) + ")")
        ids: list[int] = []
        run: list[str] = []
        for piece, is_text in pieces:
            parts = [piece] if is_text else self._special_pattern.split(piece)
            for i, part in enumerate(parts):
                if i % 2:  # a special token of the markup
                    ids += self.encode("".join(run)) if run else []
                    run = []
                    ids.append(self.special_ids[part])
                elif part:
                    run.append(part)
        return ids + (self.encode("".join(run)) if run else [])


def _wrap_strings(value, placeholders: _Placeholders, specials: tuple[str, ...]):
    """A copy of ``value`` whose non-empty strings are placeholders (empty ones stay falsy for the template),
    but for the enumerations templates compare: a "role" or "type" that is a plain word."""
    if isinstance(value, str):
        return placeholders.wrap(value) if value else value
    if isinstance(value, list):
        return [_wrap_strings(v, placeholders, specials) for v in value]
    if isinstance(value, dict):
        for key in value:
            if isinstance(key, str) and any(s in key for s in specials):
                raise K2Error(f"the key {key!r} contains a special token; it cannot be rendered as text")
        return {k: v if k in _ENUM_KEYS and isinstance(v, str) and _WORD.fullmatch(v)
                else _wrap_strings(v, placeholders, specials) for k, v in value.items()}
    return value


_ENUM_KEYS = ("role", "type")
_WORD = re.compile(r"[A-Za-z0-9_-]*")
