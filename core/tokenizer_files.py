"""Which tokenizer a checkpoint or artifact folder carries, loaded: Kimi's tiktoken files, a Hugging Face
``tokenizer.json``, or none (then everything that takes token ids still runs)."""

from __future__ import annotations

from pathlib import Path

from .chat_template import TEMPLATE_FILE, ChatTokenizer
from .errors import K2Error
from .tokenizer_io import CONFIG_FILE, GENERATION_FILE, TIKTOKEN_FILE, TOKENIZER_JSON

# What an export copies into the artifact's tokenizer folder, where the checkpoint has it.
TOKENIZER_FILES = (TIKTOKEN_FILE, TOKENIZER_JSON, CONFIG_FILE, TEMPLATE_FILE, GENERATION_FILE)


def tokenizer_kind(folder: Path) -> str | None:
    """"tiktoken" (Kimi), "tokenizers" (Hugging Face tokenizer.json) or None."""
    if (folder / TIKTOKEN_FILE).is_file():
        return "tiktoken"
    if (folder / TOKENIZER_JSON).is_file():
        return "tokenizers"
    return None


def load_tokenizer(folder: str | Path, vocab_size: int | None = None) -> ChatTokenizer | None:
    """The folder's tokenizer, None when it has none; a K2Error naming the file when it is broken, or when it
    makes ids the model (``vocab_size``) does not have."""
    folder = Path(folder)
    kind = tokenizer_kind(folder)
    if kind is None:
        return None
    try:
        if kind == "tiktoken":
            from .tokenizer import KimiTokenizer as cls
        else:
            from .hf_tokenizer import HfTokenizer as cls
    except ImportError as exc:
        raise K2Error(f"{folder}: its tokenizer needs {exc.name}: pip install 'k2deploy[runtime]'") from None
    tokenizer = cls.from_dir(folder)
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise K2Error(f"{folder}: the tokenizer has {tokenizer.vocab_size} ids but the model only {vocab_size}; "
                      "the tokenizer files belong to another model")
    return tokenizer


def describe_tokenizer(folder: Path) -> str:
    """One line: the tokenizer files found in ``folder`` and those not found."""
    kind = tokenizer_kind(folder)
    found = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if kind is None:
        return (f"no tokenizer ({TIKTOKEN_FILE} or {TOKENIZER_JSON}) in {folder}: the artifact takes token ids "
                f"only (generate --prompt-ids, score, bench, serve with token-id prompts)")
    missing = [name for name in TOKENIZER_FILES if name not in found and name not in (TIKTOKEN_FILE, TOKENIZER_JSON)]
    if CONFIG_FILE in found and '"chat_template"' in (folder / CONFIG_FILE).read_text(encoding="utf-8", errors="replace"):
        missing = [name for name in missing if name != TEMPLATE_FILE]  # the template is in the config
    text = f"tokenizer: {', '.join(found)}"
    return text + (f"; not found: {', '.join(missing)}" if missing else "")
