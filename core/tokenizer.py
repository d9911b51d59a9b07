"""Kimi K2's tokenizer in Moonshot's own on-disk format, without torch or transformers.

A Kimi checkpoint carries two files: ``tiktoken.model`` (one ``base64(token bytes) rank``
line per mergeable rank) and ``tokenizer_config.json`` (the special tokens, by id, and the
chat template). The 256 ids after the last rank are special tokens; ids that
``added_tokens_decoder`` does not name are ``<|reserved_token_{id}|>``. ``write_tokenizer``
produces a small tokenizer in that layout for synthetic checkpoints; ``KimiTokenizer``
loads it or the real Kimi-K2-Instruct files.
"""

from __future__ import annotations

import base64
import itertools
import json
import re
from collections import Counter
from pathlib import Path

import jinja2
import tiktoken

from .chat_template import ChatTokenizer, read_template
from .tokenizer_io import CONFIG_FILE, TIKTOKEN_FILE, file_error, read_json_object

NUM_SPECIAL = 256
MIN_VOCAB = 512

# Kimi's pre-tokenizer split: Han runs, cased letter runs with English contractions,
# digits in threes, punctuation, then whitespace.
PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Named special tokens by offset from the first special id, as in Kimi-K2-Instruct
# (163584 + offset); the other offsets are reserved.
NAMED_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    22: "<think>",  # Kimi-K2-Thinking's reasoning markers
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
# Kimi marks the tool-call markers "special": false so a decode that skips specials keeps them; configs differ
# between releases and re-saved tokenizers, so a decode keeps them by their names whatever the flag says.
TOOL_MARKERS = {"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"}
THINK_MARKERS = {"<think>", "</think>"}  # special tokens in Kimi-K2-Thinking's tokenizer
KEPT_IN_TEXT = TOOL_MARKERS | THINK_MARKERS  # the answer's parsers need them: never skipped by a decode
_ADDITIONAL_SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                        "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"]

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."

# Kimi-K2-Instruct's chat format: tools declared first in a `tool_declare` system turn (compact JSON), the
# default system turn when the chat has none (Kimi's own template, rendered as Hugging Face does, leaves a
# newline after it and only there), an assistant's calls in its tool-call section, and a tool result as
# `## Return of CALL_ID` under the tool's name.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- if not messages or messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>{{ '\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>"
    "{%- else -%}<|im_system|>"
    "{%- endif -%}"
    "{{ message.get('name') or message['role'] }}<|im_middle|>"
    "{%- if message['role'] == 'tool' -%}## Return of {{ message.get('tool_call_id') }}{{ '\\n' }}{%- endif -%}"
    "{{ message['content'] or '' }}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>"
    "{%- endfor -%}"
    "<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking -%}<think>{%- endif -%}{%- endif -%}"
)

# Kimi-K2-Thinking's chat format: Kimi-K2-Instruct's, where each assistant turn opens with its reasoning. The turns
# up to and including the last assistant turn that answered without a tool call are history: their reasoning is
# left out (`<think></think>`); the later ones (the agent's calls since then) keep theirs (`reasoning_content`).
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- for message in messages -%}",
    "{%- set history = namespace(last=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}{%- set history.last = loop.index0 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}", 1).replace(
    "{{ message['content'] or '' }}",
    "{%- if message['role'] == 'assistant' -%}<think>"
    "{%- if loop.index0 > history.last -%}{{ message.get('reasoning_content') or '' }}{%- endif -%}"
    "</think>{%- endif -%}"
    "{{ message['content'] or '' }}", 1)

TRAINING_TEXT = """\
The harbour town wakes before the sun. Fishing boats leave the quay one after another,
their engines coughing in the cold air, and the gulls follow them out past the lighthouse.
By the time the bakery opens its shutters, the first crates of mackerel and cod are
already being carried up the stone steps to the market hall.

In the afternoon the wind usually turns. Children run along the sea wall with kites,
old men argue about the weather on the bench outside the post office, and the ferry from
the island arrives twenty minutes late, as it has done every day for the last ten years.
Nobody minds very much; there is always another cup of tea, and the view is the same.

Learning a language is a little like learning a town. At first every street looks new
and every sign is a puzzle. Then the patterns begin to repeat: the same words return in
different places, the same endings close the same kinds of sentences, and what once needed
careful thought becomes something you simply read without noticing that you are reading.

A computer that reads text does something similar. It starts with single letters and
learns which pairs appear together most often, then joins them into larger pieces, then
joins those pieces again. After enough rounds the common words of the language are whole
tokens, while rare names and numbers like 1,234 or 2025 are still spelled out in parts.

When the evening comes, the lights of the harbour are reflected in the water, the boats
return with the tide, and the town settles into the quiet that it has known for centuries.
Tomorrow the gulls will be waiting again, and the whole story will begin once more.
"""

# An ASCII stand-in for PAT_STR (which needs a Unicode-aware regex engine) that splits
# the English corpus the same way, so learned merges never span a Kimi split boundary.
_TRAINING_TEXT_SPLIT = re.compile(r"[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}| ?[^\sA-Za-z0-9]+[\r\n]*|\s+")


def write_tokenizer(out_dir: str | Path, vocab_size: int, thinking: bool = False) -> None:
    """Write ``tiktoken.model`` and ``tokenizer_config.json`` for a model with ``vocab_size`` ids; `thinking`:
    with Kimi-K2-Thinking's chat template (THINKING_CHAT_TEMPLATE), else Kimi-K2-Instruct's."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for a Kimi tokenizer: it needs at least "
            f"{MIN_VOCAB} ids (256 single bytes plus {NUM_SPECIAL} special tokens)"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    first_special = vocab_size - NUM_SPECIAL
    ranks = _build_ranks(first_special)
    lines = (f"{base64.b64encode(token).decode('ascii')} {rank}\n" for rank, token in enumerate(ranks))
    (out / TIKTOKEN_FILE).write_text("".join(lines), encoding="ascii")
    config = _config(first_special, THINKING_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _build_ranks(count: int) -> list[bytes]:
    """The 256 single bytes, then merges learned from the corpus, then unique fillers."""
    ranks = [bytes([b]) for b in range(256)]
    ranks += _learn_merges(TRAINING_TEXT, count - len(ranks))
    ranks += _fillers(set(ranks), count - len(ranks))
    return ranks


def _learn_merges(text: str, limit: int) -> list[bytes]:
    """Byte-pair merges, most frequent pair first (ties broken by the pair's bytes)."""
    words = [([bytes([b]) for b in word.encode("utf-8")], n)
             for word, n in Counter(_TRAINING_TEXT_SPLIT.findall(text)).items()]
    merges: list[bytes] = []
    while len(merges) < limit:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for parts, n in words:
            for pair in zip(parts, parts[1:]):
                pairs[pair] += n
        if not pairs:
            break
        (left, right), seen = max(pairs.items(), key=lambda item: (item[1], item[0]))
        if seen < 2:
            break
        merges.append(left + right)
        words = [(_merge(parts, left, right), n) for parts, n in words]
    return merges


def _merge(parts: list[bytes], left: bytes, right: bytes) -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while i < len(parts):
        if i + 1 < len(parts) and parts[i] == left and parts[i + 1] == right:
            out.append(left + right)
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return out


def _fillers(taken: set[bytes], count: int) -> list[bytes]:
    """``count`` byte strings of two then three bytes, in byte order, not already taken."""
    candidates = (bytes(c) for length in (2, 3) for c in itertools.product(range(256), repeat=length))
    return list(itertools.islice((c for c in candidates if c not in taken), count))


def _config(first_special: int, template: str) -> dict:
    decoder = {
        str(first_special + offset): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": name not in TOOL_MARKERS,
        }
        for offset, name in NAMED_SPECIALS.items()
    }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": _ADDITIONAL_SPECIALS,
        "bos_token": "[BOS]",
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


class KimiTokenizer(ChatTokenizer):
    """Encodes and decodes text, and renders chats, as Kimi K2's own tokenizer does."""

    def __init__(self, ranks: dict[bytes, int], special_ids: dict[str, int], skipped: set[int], bos_token: str,
                 eos_token: str, chat_template: jinja2.Template | None) -> None:
        self.special_ids = special_ids
        self.skipped = skipped  # special ids a decode that skips specials leaves out (not the tool-call markers)
        self.bos_id = special_ids[bos_token]
        self.eos_id = special_ids[eos_token]
        self.stop_ids = tuple(i for i in (self.eos_id, special_ids.get("<|im_end|>")) if i is not None)
        self.template_variables = {"bos_token": bos_token, "eos_token": eos_token}
        self._template = chat_template
        self._tool_template = None
        self._encoding = tiktoken.Encoding(
            name="kimi", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special_ids
        )
        self.vocab_size = self._encoding.n_vocab

    @classmethod
    def from_dir(cls, path: str | Path) -> KimiTokenizer:
        """Load ``tiktoken.model`` and ``tokenizer_config.json`` from a checkpoint folder."""
        folder = Path(path)
        ranks = _read_ranks(folder / TIKTOKEN_FILE)
        config_path = folder / CONFIG_FILE
        config = read_json_object(config_path)
        special_ids, skipped = _special_ids(config_path, config, first=len(ranks))
        bos_token = _token_name(config_path, config, "bos_token", "[BOS]", special_ids)
        eos_token = _token_name(config_path, config, "eos_token", "[EOS]", special_ids)
        template = read_template(folder, config_path, config)
        return cls(ranks, special_ids, skipped, bos_token, eos_token, template)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids for ``text``; special-token names in it are plain text unless allowed."""
        if allow_special:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode(text, disallowed_special=())

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text for ``ids``; special tokens come back as their names, or are left out with ``skip_special``
        (all but the tool-call and think markers, which the answer's parsers read)."""
        if skip_special:
            ids = [i for i in ids if i not in self.skipped]
        return self._encoding.decode(list(ids))

    def token_bytes(self, token: int) -> bytes:
        return self._encoding.decode_single_token_bytes(token)

    def grammar_tokenizer(self, vocab_size: int):
        from llguidance.tiktoken import lltokenizer_from_encoding

        return lltokenizer_from_encoding(self._encoding, n_vocab=vocab_size, eos_token=list(self.stop_ids))


def _read_ranks(path: Path) -> dict[bytes, int]:
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise file_error(path, "not found") from None
    except OSError as e:
        raise file_error(path, f"cannot be read ({e.strerror})") from None
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise file_error(path, f"line {number} is not '<base64 bytes> <rank>'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise file_error(path, "its ranks are not 0, 1, 2, ... with each token and rank once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise file_error(path, "it lacks some of the 256 single-byte tokens")
    return ranks


def _special_ids(path: Path, config: dict, first: int) -> tuple[dict[str, int], set[int]]:
    """Name -> id for the 256 ids after the last rank (Kimi ignores entries outside them), and the ids of
    those marked special but the markers the answer's parsers read (a decode that skips specials leaves them
    out)."""
    try:
        entries = {int(i): entry for i, entry in config.get("added_tokens_decoder", {}).items()}
        named = {i: entry["content"] for i, entry in entries.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        raise file_error(path, 'added_tokens_decoder is not {"<id>": {"content": ...}}') from None
    ids = range(first, first + NUM_SPECIAL)
    names = {named.get(i, f"<|reserved_token_{i}|>"): i for i in ids}
    skipped = {i for i in ids if entries.get(i, {}).get("special", True) is not False}
    return names, skipped - {names[m] for m in KEPT_IN_TEXT if m in names}


def _token_name(path: Path, config: dict, key: str, default: str, special_ids: dict[str, int]) -> str:
    value = config.get(key) or default
    # Hugging Face may store a token as a serialised AddedToken rather than a string.
    name = value.get("content") if isinstance(value, dict) else value
    if name not in special_ids:
        raise file_error(path, f"{key} {name!r} is not one of the special tokens")
    return name
