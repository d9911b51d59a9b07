"""The tokenizer files' names and one reader for them: their text and JSON objects, and errors that say which file
is unusable and what to do. Both tokenizers (`tokenizer.py`, `hf_tokenizer.py`) and `tokenizer_files.py` read through it."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import K2Error
from .json_files import loads

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_JSON = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
GENERATION_FILE = "generation_config.json"


def file_error(path: Path, problem: str) -> K2Error:
    """A tokenizer file that cannot be used: which, why, and what to do."""
    return K2Error(f"{path}: {problem}; copy {path.name} unchanged from the model's Hugging Face "
                   "repository or regenerate the synthetic tokenizer")


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise file_error(path, "not found") from None
    except OSError as e:
        raise file_error(path, f"cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise file_error(path, f"is not UTF-8 text ({e})") from None


def read_json_object(path: Path) -> dict:
    try:
        value = loads(read_text(path))
    except json.JSONDecodeError as e:
        raise file_error(path, f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise file_error(path, "is not a JSON object")
    return value
