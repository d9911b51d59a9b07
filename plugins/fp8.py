"""FP8 e4m3 block dequantisation in torch, shared by the plugin ops and the export modules."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

# e4m3 value of every byte: lets ONNX graphs decode bits stored as uint8 (ONNX Gather has no FP8 type)
E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    """scale [..., ceil(rows/block), ceil(cols/block)] -> [..., rows, cols]; partial edge blocks cropped."""
    return scale.repeat_interleave(block, dim=-2)[..., :rows, :].repeat_interleave(block, dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """weight [..., rows, cols] float8_e4m3fn (or its bits as uint8) -> float32, W = q * s per block."""
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    rows, cols = weight.shape[-2:]
    return weight.to(torch.float32) * expand_block_scales(scale, rows, cols, block)
