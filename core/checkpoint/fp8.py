"""FP8 e4m3 block-scaled weights: W[i, j] = q[i, j] * s[i // bm, j // bn] in float32.

The scale tensor is called `weight_scale_inv` in the checkpoint, but its value multiplies.
Edge blocks are partial: a [576, 7168] weight has ceil(576/128) = 5 block rows.
"""

from __future__ import annotations

import numpy as np

from ..errors import K2Error


def dequantize(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """q: [out, in] float8_e4m3fn, scale_inv: [ceil(out/bm), ceil(in/bn)] float32 -> [out, in] float32.

    One multiply per element in float32 (the e4m3 -> float32 conversion is exact), done one
    block row at a time so that the working memory is the float32 result alone.
    """
    rows, cols = q.shape
    bm, bn = block
    expected = (-(-rows // bm), -(-cols // bn))
    if scale_inv.shape != expected:
        raise K2Error(f"scale shape {scale_inv.shape} does not match weight {q.shape} in {bm}x{bn} blocks (expected {expected})")
    out = np.empty((rows, cols), dtype=np.float32)
    for block_row in range(expected[0]):
        lo, hi = block_row * bm, min((block_row + 1) * bm, rows)
        column_scales = np.repeat(scale_inv[block_row].astype(np.float32), bn)[:cols]  # [in]
        np.multiply(q[lo:hi].astype(np.float32), column_scales, out=out[lo:hi])
    return out
