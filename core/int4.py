"""INT4 weights in compressed-tensors' `pack-quantized` format (Kimi-K2-Thinking and later releases).

A quantised projection P [out, in] is stored as
  P.weight_packed  int32 [out, in / 8]: eight 4-bit codes per word along the input axis, code = value + 8
                   (0..15), the first value in the lowest four bits (little-endian words, so byte j of a row
                   holds values 2j (low nibble) and 2j + 1 (high nibble));
  P.weight_scale   bfloat16 [out, in / group]: one scale per group of `group` input values;
  P.weight_shape   integer [2]: (out, in);
  value = (code - 8) x scale of its group. Symmetric: no zero point.
The config's `quantization_config` names the scheme (one group of weights: num_bits 4, type int, symmetric,
strategy group) and an `ignore` list of module names (exact, or `re:` patterns matched from the name's start,
as compressed-tensors matches them, but by RE2, in time linear in the name) that stay BF16. Everything here is
numpy: the runtime reads nothing of it, the exporter and the checkpoint reader do.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import re2

from .errors import K2Error

QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
BITS = 4
CODE_ZERO = 8  # code = value + 8
LARGEST = 7  # symmetric codes -8..7; the quantiser uses -7..7 so that the scale is absmax / 7 (see `quantize`)
PER_WORD = 32 // BITS
MAX_IGNORE = 4096  # entries of `ignore`: bounded, as every name is matched against them
MAX_PATTERN = 512  # characters of one entry
RE2_OPTIONS = re2.Options()
RE2_OPTIONS.log_errors = False  # a pattern RE2 refuses is a one-line error of ours, not a log line on stderr


@dataclass(frozen=True)
class Int4Scheme:
    group: int  # input values per scale
    ignore: tuple[str, ...]  # module names and `re:` patterns left in BF16

    def quantizes(self, module: str) -> bool:
        """Whether the projection `module` (e.g. model.layers.5.mlp.experts.17.gate_proj) is stored as INT4."""
        return not any(_matches(entry, module) for entry in self.ignore)

    def to_dict(self) -> dict:
        """The quantization_config a checkpoint in this scheme carries."""
        weights = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group", "group_size": self.group,
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                   "observer_kwargs": {}}
        return {"quant_method": QUANT_METHOD, "format": FORMAT, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None}},
                "ignore": list(self.ignore), "kv_cache_scheme": None}


@lru_cache(maxsize=MAX_IGNORE)
def _pattern(text: str):
    """`text` compiled by RE2, whose matching never backtracks: Python's `re` takes time exponential in the
    name's length for a pattern such as `(.+)+z$`, and `ignore` comes with the checkpoint."""
    return re2.compile(text, RE2_OPTIONS)


def _matches(entry: str, module: str) -> bool:
    if entry.startswith("re:"):
        return _pattern(entry[3:]).match(module) is not None
    return entry == module


def parse_scheme(q: dict, source: str) -> Int4Scheme:
    """A compressed-tensors quantization_config -> its scheme; a one-line K2Error for anything but symmetric
    weight-only int4 in groups, packed."""
    def need(ok: bool, why: str) -> None:
        if not ok:
            raise K2Error(f"{source}: field 'quantization_config' {why}")

    need(q.get("format") == FORMAT, f"format is {q.get('format')!r}; only {FORMAT!r} compressed-tensors is supported")
    groups = q.get("config_groups")
    need(isinstance(groups, dict) and len(groups) == 1,
         f"must hold one config group (the INT4 experts' scheme), got {type(groups).__name__ if not isinstance(groups, dict) else len(groups)}")
    group = next(iter(groups.values()))
    need(isinstance(group, dict), "config group must be an object")
    targets = group.get("targets")
    need(targets == ["Linear"], f"config group targets {targets!r}; only ['Linear'] is supported")
    need(group.get("input_activations") is None, "quantises activations; only weight-only INT4 (W4A16) is supported")
    weights = group.get("weights")
    need(isinstance(weights, dict), "config group has no 'weights' object")
    expected = {"num_bits": BITS, "type": "int", "symmetric": True, "strategy": "group"}
    for key, value in expected.items():
        need(weights.get(key) == value and type(weights.get(key)) is type(value),
             f"weights.{key} is {weights.get(key)!r}; only {value!r} is supported")
    size = weights.get("group_size")
    need(isinstance(size, int) and not isinstance(size, bool) and size > 0 and size % PER_WORD == 0 and size <= 1 << 16,
         f"weights.group_size must be a positive multiple of {PER_WORD} up to 65,536, got {size!r}")
    need(not weights.get("dynamic") and weights.get("actorder") in (None, False),
         "weights use dynamic or act-order quantisation; only static groups are supported")
    ignore = q.get("ignore", [])
    need(isinstance(ignore, list) and len(ignore) <= MAX_IGNORE and
         all(isinstance(e, str) and 0 < len(e) <= MAX_PATTERN for e in ignore),
         f"ignore must be a list of at most {MAX_IGNORE} names or 're:' patterns of at most {MAX_PATTERN} characters")
    for entry in ignore:
        if entry.startswith("re:"):
            try:
                _pattern(entry[3:])
            except re2.error as error:
                need(False, f"ignore pattern {entry!r} is not a regular expression RE2 matches ({_reason(error)}); "
                            f"rewrite it in RE2 syntax: Python's, less lookaround and backreferences")
    return Int4Scheme(size, tuple(ignore))


def _reason(error: re2.error) -> str:
    """RE2's message, which it gives as bytes."""
    reason = error.args[0] if error.args else error
    return reason.decode(errors="replace") if isinstance(reason, bytes) else str(reason)


# -- codes and words ----------------------------------------------------------------------------------

def pack(values: np.ndarray) -> np.ndarray:
    """Signed codes [rows, cols] in -8..7 (any integer dtype) -> int32 words [rows, cols / 8]."""
    rows, cols = values.shape
    nibbles = (values.astype(np.int16) + CODE_ZERO).astype(np.uint8).reshape(rows, cols // 2, 2)
    return (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(np.uint8).view("<i4").reshape(rows, cols // PER_WORD)


def nibble_bytes(packed: np.ndarray) -> np.ndarray:
    """int32 words [rows, in / 8] -> their bytes [rows, in / 2] uint8 (a view): byte j holds code 2j in its low
    nibble and code 2j + 1 in its high one, which is ONNX Runtime's 4-bit layout with zero point 8."""
    return np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)


def unpack(packed: np.ndarray) -> np.ndarray:
    """int32 words [rows, cols / 8] -> signed codes [rows, cols] int8."""
    data = nibble_bytes(packed)
    rows = data.shape[0]
    codes = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(rows, -1)
    return (codes.astype(np.int8) - CODE_ZERO).astype(np.int8)


def dequantize(packed: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """weight_packed [rows, in / 8] int32 and weight_scale [rows, in / group] (bf16) -> float32 [rows, in]."""
    codes = unpack(packed).astype(np.float32)
    rows, cols = codes.shape
    grouped = codes.reshape(rows, cols // group, group) * scale.astype(np.float32)[..., None]
    return grouped.reshape(rows, cols)


def quantize(weight: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, in] -> (weight_packed int32 [rows, in / 8], weight_scale bf16 [rows, in / group]):
    symmetric round-to-nearest per group, scale = absmax / 7 rounded to bf16 first, codes clipped to -8..7."""
    import ml_dtypes  # here, not at the top: its import takes half a second of every command's start

    rows, cols = weight.shape
    grouped = weight.reshape(rows, cols // group, group)
    scale = (np.abs(grouped).max(axis=-1) / LARGEST).astype(ml_dtypes.bfloat16)
    wide = scale.astype(np.float32)
    safe = np.where(wide > 0, wide, 1.0)
    codes = np.clip(np.rint(grouped / safe[..., None]), -CODE_ZERO, LARGEST).astype(np.int8).reshape(rows, cols)
    return pack(codes), scale
