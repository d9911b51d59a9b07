"""JSON files the user hands over or the tools leave behind: read with one-line errors, written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import K2Error

MAX_DEPTH = 64  # nesting levels any JSON this project reads may have (its own files need under ten)


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads for untrusted text, with its nesting bounded: deeper input raises json.JSONDecodeError (what
    every caller already catches for garbled JSON) instead of RecursionError here or in whoever walks the value."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    except (json.JSONDecodeError, UnicodeDecodeError):  # bytes that are not UTF-8 are the caller's to name
        raise
    except ValueError:  # an integer of more digits than Python converts (4,300): garbled input as well
        raise json.JSONDecodeError("a number with too many digits", "", 0) from None
    else:
        if _depth_within(value, max_depth):
            return value
    raise TooDeep(max_depth)


class TooDeep(json.JSONDecodeError):
    def __init__(self, max_depth: int):
        super().__init__(f"nested deeper than {max_depth} levels", "", 0)

    def __str__(self) -> str:
        return self.msg


def _depth_within(value: Any, max_depth: int) -> bool:
    """Whether no array or object in value lies more than max_depth levels deep (walked without recursion)."""
    pending = [(value, 1)] if isinstance(value, (dict, list)) else []
    while pending:
        container, depth = pending.pop()
        if depth > max_depth:
            return False
        children = container.values() if isinstance(container, dict) else container
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return True


def read_small_text(path: str | Path, limit: int, what: str) -> str:
    """A small file the user names (a tools file, a key file), read whole as UTF-8: a K2Error naming `what` where
    it holds more than `limit` bytes (a device such as /dev/zero included) or cannot be read."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise K2Error(f"{what} {path}: cannot be read ({exc.strerror})") from None
    if len(data) > limit:
        raise K2Error(f"{what} {path}: holds more than {limit} bytes; give a smaller file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise K2Error(f"{what} {path}: not UTF-8 text") from None


def read_json(path: Path, missing: str) -> Any:
    """The parsed file; a missing file raises K2Error "PATH: <missing>", a garbled one names the JSON error."""
    try:
        return loads(Path(path).read_text())
    except FileNotFoundError:
        raise K2Error(f"{path}: {missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise K2Error(f"{path}: not valid JSON ({exc})") from None


def read_document(path: Path, missing: str, key: str, tag: str, what: str) -> dict:
    """read_json, then a K2Error "PATH: not a <what>" unless it is an object whose `key` is `tag`."""
    doc = read_json(path, missing)
    if not isinstance(doc, dict) or doc.get(key) != tag:
        raise K2Error(f"{path}: not a {what}")
    return doc


def check_version(doc: dict, key: str, version: int | tuple[int, ...], subject: str, redo: str) -> None:
    """A K2Error "<subject> version V, this k2deploy reads version W; <redo>" unless doc[key] is `version` (or one of
    them)."""
    versions = version if isinstance(version, tuple) else (version,)
    if doc.get(key) not in versions or isinstance(doc.get(key), bool):
        said = " or ".join(str(v) for v in versions)
        raise K2Error(f"{subject} version {doc.get(key)!r}, this k2deploy reads version {said}; {redo}")


def write_json_atomically(path: Path, obj: dict) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(obj, indent=2) + "\n")
    with open(partial, "rb") as f:
        os.fsync(f.fileno())
    os.replace(partial, path)
