"""Hugging Face's ``tokenizer.json`` (DeepSeek-V3, DeepSeek-R1, Moonlight), loaded with the ``tokenizers`` library.

The special tokens (bos, eos, ...) and the chat template come from ``tokenizer_config.json``
(or ``chat_template.jinja``). ``write_hf_tokenizer`` trains a small byte-level BPE with the
``tokenizers`` library and writes it with DeepSeek-V3's special tokens (``[BOS]`` id 0, ``[EOS]``
id 1, as in DeepSeek-V3) and a chat template in DeepSeek-V3's format, for synthetic
``deepseek_v3`` checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from .chat_template import ChatTokenizer, read_template
from .errors import K2Error
from .json_files import loads
from .tokenizer_io import CONFIG_FILE, GENERATION_FILE, TOKENIZER_JSON, file_error, read_json_object, read_text

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
# DeepSeek-V3's chat and tool markers: added tokens, not "special" (a decode that skips specials keeps them).
DEEPSEEK_MARKERS = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
                    "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]

# DeepSeek-V3's chat format: bos, the system prompts, then <｜User｜> and <｜Assistant｜> turns; an assistant's
# calls as fenced JSON between tool-call markers; consecutive tool results in one outputs block.
DEEPSEEK_TEMPLATE = (
    "{%- set ns = namespace(system='', in_outputs=false) -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + ('\\n\\n' if ns.system else '') + message['content'] -%}"
    "{%- endfor -%}"
    "{{ bos_token }}{{ ns.system }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'tool' and ns.in_outputs -%}<｜tool▁outputs▁end｜>{%- set ns.in_outputs = false -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}<｜User｜>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<｜Assistant｜>{{ message['content'] or '' }}"
    "{%- if message.get('tool_calls') -%}<｜tool▁calls▁begin｜>"
    "{%- for call in message['tool_calls'] -%}"
    "<｜tool▁call▁begin｜>{{ call['type'] }}<｜tool▁sep｜>{{ call['function']['name'] }}\\n```json\\n"
    "{{ call['function']['arguments'] }}\\n```<｜tool▁call▁end｜>"
    "{%- endfor -%}<｜tool▁calls▁end｜>"
    "{%- endif -%}{{ eos_token }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if not ns.in_outputs -%}<｜tool▁outputs▁begin｜>{%- set ns.in_outputs = true -%}{%- endif -%}"
    "<｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜>"
    "{%- elif message['role'] != 'system' -%}"
    "{{ raise_exception('unsupported role ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.in_outputs -%}<｜tool▁outputs▁end｜>{%- endif -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"
)


class HfTokenizer(ChatTokenizer):
    """A ``tokenizer.json`` tokenizer: encodes, decodes and renders chats as transformers' fast tokenizer does."""

    def __init__(self, tokenizer: Tokenizer, plain: Tokenizer, config: dict, config_path: Path, folder: Path,
                 generation: dict) -> None:
        self._tokenizer = tokenizer
        self._plain = plain  # the same model without added tokens: client text never forms one
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = {token.content: i for i, token in added.items()}
        self.template_variables = {key: _token_text(config.get(key)) for key in
                                   ("bos_token", "eos_token", "pad_token", "unk_token") if config.get(key)}
        for key in ("bos_token", "eos_token"):
            name = self.template_variables.get(key)
            if name is not None and name not in self.special_ids:
                raise file_error(config_path, f"{key} {name!r} is not one of tokenizer.json's added tokens")
        eos = self.special_ids.get(self.template_variables.get("eos_token"))
        self.stop_ids = tuple(dict.fromkeys([*_ids(generation.get("eos_token_id")), *([eos] if eos is not None else [])]))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = read_template(folder, config_path, config)
        self._tool_template = read_template(folder, config_path, config, tools=True)
        self._source = folder / TOKENIZER_JSON

    def grammar_tokenizer(self, vocab_size: int):
        from llguidance import LLTokenizer

        return LLTokenizer(str(self._source), n_vocab=vocab_size, eos_token=list(self.stop_ids))

    @classmethod
    def from_dir(cls, path: str | Path) -> HfTokenizer:
        folder = Path(path)
        source = folder / TOKENIZER_JSON
        text = read_text(source)
        try:
            tokenizer = Tokenizer.from_str(text)
            raw = loads(text)
            raw["added_tokens"] = []
            plain = Tokenizer.from_str(json.dumps(raw))
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise file_error(source, f"is not a tokenizer the tokenizers library can load ({str(exc)[:200]})") from None
        config_path = folder / CONFIG_FILE
        config = read_json_object(config_path) if config_path.exists() else {}
        generation = read_json_object(folder / GENERATION_FILE) if (folder / GENERATION_FILE).exists() else {}
        return cls(tokenizer, plain, config, config_path, folder, generation)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids for ``text`` (no bos added); added tokens written in it are plain text unless allowed."""
        source = self._tokenizer if allow_special else self._plain
        return source.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special)


def write_hf_tokenizer(out_dir: str | Path, vocab_size: int, corpus: str, bos_token_id: int, eos_token_id: int) -> None:
    """Train a byte-level BPE on ``corpus`` with at most ``vocab_size`` ids and write ``tokenizer.json``,
    ``tokenizer_config.json`` (special tokens, DeepSeek-V3-format chat template) as Hugging Face saves them."""
    specials = [BOS, EOS, PAD]
    if (bos_token_id, eos_token_id) != (0, 1):
        raise K2Error(f"a deepseek_v3 synthetic tokenizer puts {BOS} at id 0 and {EOS} at 1, as DeepSeek-V3 does; "
                      f"the config says bos_token_id {bos_token_id}, eos_token_id {eos_token_id}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(DEEPSEEK_MARKERS), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([corpus], trainer=trainer)
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in DEEPSEEK_MARKERS])
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise K2Error(f"vocab_size {vocab_size} is too small for a byte-level tokenizer with "
                      f"{len(specials) + len(DEEPSEEK_MARKERS)} added tokens")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / TOKENIZER_JSON))
    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": DEEPSEEK_TEMPLATE,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _token_text(value) -> str | None:
    """A token named in tokenizer_config.json: a string, or a serialised AddedToken."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
