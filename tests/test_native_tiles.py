"""The cpu target's tile layout (core/native_tiles.py): what the export writes, the graphs untile and the native
step reads in place."""

import numpy as np
import pytest
import torch

from k2deploy.core import native_tiles
from k2deploy.export.passes import tiled_pieces
from k2deploy.export.tiled_buffers import untiled, untiled_scales

TILE = native_tiles.TILE


def test_a_ragged_weight_comes_back_from_its_tiles_and_its_padding_is_zero():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (TILE + 36, 48), dtype=np.uint8)
    scales = rng.random((TILE + 36, 3), dtype=np.float32)
    tiled, tiled_scales = native_tiles.tile_codes(codes), native_tiles.tile_scales(scales)
    assert tiled.shape == native_tiles.codes_shape((), len(codes), 48) == (2, 12, TILE, 4)
    assert tiled_scales.shape == native_tiles.scales_shape((), len(codes), 3) == (2, 3, TILE)
    # tile 1's row r is weight row TILE + r; four bytes of it at a time, each group of four side by side
    assert np.array_equal(tiled[1, 5, 7], codes[TILE + 7, 20:24])
    assert np.array_equal(tiled_scales[1, 2, 7], scales[TILE + 7, 2])
    assert not tiled[1, :, 36:].any() and not tiled_scales[1, :, 36:].any()  # the rows past n
    # the graphs' own untiling (a Transpose, Reshape and Slice that ONNX Runtime folds) gives the rows back
    assert np.array_equal(untiled(torch.from_numpy(tiled), len(codes)).numpy(), codes)
    assert np.array_equal(untiled_scales(torch.from_numpy(tiled_scales), len(codes)).numpy(), scales)


def test_pieces_are_tiled_as_one_weight_or_one_weight_each():
    rows = np.arange((2 * TILE + 8) * 4, dtype=np.uint32).view(np.uint8).reshape(2 * TILE + 8, 16)
    pieces = [rows[:TILE], rows[TILE:2 * TILE], rows[2 * TILE:]]  # whole tiles, then the ragged end
    joined = np.concatenate([piece.reshape(-1) for piece in tiled_pieces("x.weight_int8", pieces, stack=False)])
    assert np.array_equal(joined, native_tiles.tile_codes(rows).reshape(-1))
    with pytest.raises(ValueError, match="not whole tiles and more follow"):
        list(tiled_pieces("x.weight_int8", [rows[:8], rows[8:]], stack=False))
    experts = [rows[:8], rows[8:16]]  # a stack: each weight padded to its own tile
    stacked = list(tiled_pieces("mlp.experts_fc2_weight", experts, stack=True))
    assert [p.shape for p in stacked] == [(1, 4, TILE, 4)] * 2
    scales = list(tiled_pieces("mlp.experts_fc2_scale", [np.ones((8, 2), np.float32)], stack=True))
    assert scales[0].shape == (1, 2, TILE) and scales[0].dtype == np.float32
