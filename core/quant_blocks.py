"""Block sizes of the project's weight-only quantised formats (no torch, no numpy: plan sizes by them too).

int8 (the cpu target, plugins/int8.py): a row's input dim cut into blocks of b values, one float32 scale each;
ONNX Runtime's MatMulNBits and QMoE take b in INT8_BLOCKS, and the lowering picks the largest that divides.
int4 (Kimi-K2-Thinking's routed experts, compressed-tensors pack-quantized): groups of INT4_GROUP values along
the input dim, one BF16 scale each, eight 4-bit codes per int32 word (core/int4.py); `export --weights int4`
re-quantises an FP8 checkpoint's experts to the same groups.
"""

from __future__ import annotations

INT8_BLOCKS = (128, 64, 32, 16)  # int8 block sizes the contrib ops take, largest (fastest) first
INT4_GROUP = 32  # values per scale in Kimi-K2-Thinking's int4 format


def int8_block(*dims: int) -> int | None:
    """The largest int8 block that divides every dim (QMoE needs whole blocks), or None."""
    return next((b for b in INT8_BLOCKS if all(d % b == 0 for d in dims)), None)
