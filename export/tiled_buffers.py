"""How the traced modules hold int8 and 4-bit codes and their block scales: in rows, or in the native step's tiles
(core/native_tiles.py) where the target's passes hold them so (the native_tiles pass, export/passes.py), taken back
to rows inside the graph by a Transpose, Reshape and Slice of the initializer, which ONNX Runtime folds at load."""

from __future__ import annotations

import torch
from torch import nn

from ..core import native_tiles


def untiled(tiled: torch.Tensor, rows: int) -> torch.Tensor:
    """Codes held in tiles back in rows: [..., tiles, groups, TILE, 4] -> [..., rows, 4 groups]."""
    *lead, count, groups, tile, four = tiled.shape
    return tiled.transpose(-3, -2).reshape(*lead, count * tile, groups * four)[..., :rows, :]


def untiled_scales(tiled: torch.Tensor, rows: int) -> torch.Tensor:
    """Block scales held in tiles back in rows: [..., tiles, blocks, TILE] -> [..., rows, blocks]."""
    *lead, count, blocks, tile = tiled.shape
    return tiled.transpose(-2, -1).reshape(*lead, count * tile, blocks)[..., :rows, :]


def hold(module: nn.Module, name: str, lead: tuple[int, ...], rows: int, width: int, codes: bool,
         tiled: bool) -> None:
    """Registers `name` on module: codes ([*lead, rows, width] uint8, `width` bytes a row) or their block scales
    ([*lead, rows, width] float32), as `<name>_tiles` in the native step's tiles where `tiled`, a stack (`lead`)
    tiled weight by weight."""
    if not tiled:
        module.register_buffer(name, torch.empty((*lead, rows, width), dtype=torch.uint8 if codes else torch.float32))
    elif codes:
        module.register_buffer(name + native_tiles.SUFFIX,
                               torch.empty(native_tiles.codes_shape(lead, rows, width), dtype=torch.uint8))
    else:
        module.register_buffer(name + native_tiles.SUFFIX, torch.empty(native_tiles.scales_shape(lead, rows, width)))


def held_rows(module: nn.Module, name: str, rows: int) -> torch.Tensor:
    """What `hold` registered as `name`, in rows: [*lead, rows, width] (untiled where it is held in tiles)."""
    tiled = getattr(module, name + native_tiles.SUFFIX, None)
    if tiled is None:
        return getattr(module, name)
    return (untiled if tiled.dtype == torch.uint8 else untiled_scales)(tiled, rows)
