"""The native step's tile layout, in which the cpu target's artifact stores its int8 and 4-bit weights.

A weight of n rows of codes (int8 codes, a byte each, or 4-bit codes two a byte, the lower input in the low nibble:
`row_bytes` a row) is held as tiles of TILE rows, each tile's rows side by side four bytes at a time:

  codes  [n, row_bytes]       -> [tiles(n), row_bytes / 4, TILE, 4]
  scales [n, blocks] float32  -> [tiles(n), blocks, TILE]

the rows past n zero. One int8 dot instruction then takes four bytes of each of 16 (or 8, 4) consecutive rows in one
load, the block scales of a tile's rows are one vector, and no sum crosses a register's lanes
(runtime/backends/native/decode_step.c). The export lays the weights out so in the cpu target's native_tiles pass
(export/passes.py); the runtime maps these bytes from the artifact and runs on them in place; the layer graphs take
the plain layout back through a Transpose, Reshape and Slice of their own (`untiled` in export/tiled_buffers.py),
which ONNX Runtime folds into its initializers at load. A stack of weights (the routed experts, [e, n, row_bytes]) is
tiled weight by weight: [e, tiles(n), row_bytes / 4, TILE, 4].

The absorbed W_UK and W_UV, which the step multiplies a column at a time, are held four rows interleaved instead
(`four_rows`: [h, k, n] -> [h, k / 4, n, 4]), so that one int8 dot instruction takes four rows' products for a vector
of columns.
"""

from __future__ import annotations

import numpy as np

TILE = 64  # rows a tile; the native library's TILE (checked at load through its k2_contract)
SUFFIX = "_tiles"  # an initializer held in tiles is named after the plain one with this suffix
FOUR_ROWS = "_four_rows"  # ... and one held four rows interleaved (`four_rows`)


def tiles(rows: int) -> int:
    return -(-rows // TILE)


def codes_shape(lead: tuple[int, ...], rows: int, row_bytes: int) -> tuple[int, ...]:
    return (*lead, tiles(rows), row_bytes // 4, TILE, 4)


def scales_shape(lead: tuple[int, ...], rows: int, blocks: int) -> tuple[int, ...]:
    return (*lead, tiles(rows), blocks, TILE)


def _padded(rows: np.ndarray) -> np.ndarray:
    """[r, ...] -> [tiles(r) TILE, ...], the rows past r zero."""
    short = -len(rows) % TILE
    if not short:
        return rows
    return np.concatenate([rows, np.zeros((short, *rows.shape[1:]), rows.dtype)])


def tile_codes(codes: np.ndarray) -> np.ndarray:
    """codes [r, row_bytes] uint8 (row_bytes a multiple of 4) -> [tiles(r), row_bytes / 4, TILE, 4]."""
    r, row_bytes = codes.shape
    if codes.dtype != np.uint8 or row_bytes % 4:
        raise ValueError(f"tiles take uint8 rows of a multiple of 4 bytes, not {codes.dtype} rows of {row_bytes}")
    words = _padded(np.ascontiguousarray(codes)).view(np.uint32)  # four bytes of a row move together
    tiled = words.reshape(tiles(r), TILE, row_bytes // 4).transpose(0, 2, 1)
    return np.ascontiguousarray(tiled).view(np.uint8).reshape(tiles(r), row_bytes // 4, TILE, 4)


def tile_scales(scales: np.ndarray) -> np.ndarray:
    """scales [r, blocks] -> [tiles(r), blocks, TILE] float32."""
    r, blocks = scales.shape
    padded = _padded(np.ascontiguousarray(scales, dtype=np.float32))
    return np.ascontiguousarray(padded.reshape(tiles(r), TILE, blocks).transpose(0, 2, 1))


def four_rows(w: np.ndarray) -> np.ndarray:
    """[h, k, n] -> [h, k / 4, n, 4]: each run of four rows interleaved per column."""
    h, k, n = w.shape
    return np.ascontiguousarray(w.reshape(h, k // 4, 4, n).transpose(0, 1, 3, 2))
