"""The lowering passes of the exported graphs, by the names `Target.passes` gives them (core/targets.py).

A pass may act at three points of an export; each hook's default leaves the graph as traced:
- `linear(in, out)`, `experts_block(config)`: the module a projection or the routed experts become, where
  the traced modules are built (export/graph_modules.py);
- `pieces(...)`: an initializer's bytes, when they are not a copy of checkpoint tensors, as the export
  streams them;
- `graph_files(directory, stem)`: files derived from a written graph, written beside it and listed in the
  manifest with it.

Passes:
- int8_weights (cpu): the dense linears, the head and the routed experts as int8 blocks along the input
  dim for ONNX Runtime's int8 kernels (plugins/int8.py), re-quantised from the checkpoint's FP8 / BF16 bytes.
- tensorrt_plugins (tensorrt): the TensorRT copy of every graph, `<stem>.tensorrt.onnx`
  (export/tensorrt_graph.py), which `k2deploy build-engines` parses.
- int4_experts (any target but tensorrt, asked by `export --weights int4`): an FP8 checkpoint's routed experts
  re-quantised to INT4 groups for ONNX Runtime's 4-bit QMoE; it runs before the target's passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from torch import nn

from ..core import int4, native_tiles
from ..core.quant_blocks import INT4_GROUP
from ..core.checkpoint.reader import Checkpoint
from ..core.config import ModelConfig
from ..core.errors import K2Error
from ..core.manifest import file_record
from ..core.targets import get_target
from ..plugins import int8
from ..plugins.int4 import EXACT, INT8_ACTIVATIONS


class Pass:
    name = ""

    def native_tiles(self) -> bool:
        """Whether int8 and 4-bit weights are held in the native step's tiles (core/native_tiles.py)."""
        return False

    def linear(self, in_features: int, out_features: int) -> nn.Module | None:
        return None

    def experts_block(self, config: ModelConfig) -> int | None:
        return None

    def int4_accuracy(self) -> int | None:
        """QMoE's accuracy_level for 4-bit experts (plugins/int4.py); None: the exact one."""
        return None

    def int4_group(self) -> int | None:
        """The group an FP8 checkpoint's experts are re-quantised to INT4 in; None: they are not."""
        return None

    def pieces(self, config: ModelConfig, checkpoint: Checkpoint, kind: str, layer: int | None,
               name: str) -> Iterable[np.ndarray] | None:
        return None

    def graph_files(self, directory: Path, stem: str) -> dict[str, dict]:
        return {}


# -- int8_weights ------------------------------------------------------------------------------------

def untiled(tiled: torch.Tensor, rows: int) -> torch.Tensor:
    """Codes held in tiles back in rows (core/native_tiles.py): [..., tiles, groups, TILE, 4] -> [..., rows, 4 groups];
    a Transpose, Reshape and Slice of initializers, which ONNX Runtime folds at load."""
    *lead, count, groups, tile, four = tiled.shape
    return tiled.transpose(-3, -2).reshape(*lead, count * tile, groups * four)[..., :rows, :]


def untiled_scales(tiled: torch.Tensor, rows: int) -> torch.Tensor:
    """Block scales held in tiles back in rows: [..., tiles, blocks, TILE] -> [..., rows, blocks]."""
    *lead, count, blocks, tile = tiled.shape
    return tiled.transpose(-2, -1).reshape(*lead, count * tile, blocks)[..., :rows, :]


class Int8Linear(nn.Module):
    """y = x W^T with W kept as int8 blocks along the input dim (see plugins/int8.py), in the native step's tiles
    (core/native_tiles.py): codes [tiles(out), in / 4, TILE, 4], scales [tiles(out), in / block, TILE]."""

    def __init__(self, in_features: int, out_features: int, block: int):
        super().__init__()
        self.shape = out_features, in_features // block, block
        self.register_buffer("weight_int8" + native_tiles.SUFFIX, torch.empty(
            native_tiles.codes_shape((), out_features, in_features), dtype=torch.uint8))
        self.register_buffer("weight_int8_scale" + native_tiles.SUFFIX, torch.empty(
            native_tiles.scales_shape((), out_features, in_features // block)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.shape[0]
        weight = untiled(getattr(self, "weight_int8" + native_tiles.SUFFIX), rows).reshape(self.shape)
        scale = untiled_scales(getattr(self, "weight_int8_scale" + native_tiles.SUFFIX), rows)
        return torch.ops.k2deploy.linear_int8(x, weight, scale)


ROWS_PER_PIECE = 1024  # rows re-quantised at a time: a real-size linear never sits in memory as float32


class Int8Weights(Pass):
    """Every linear whose input dim an int8 block divides, and the routed experts (fc1: gate and up rows
    interleaved, fc2: down, for QMoE) where a block divides hidden and expert width."""

    name = "int8_weights"

    def native_tiles(self) -> bool:
        return True

    def linear(self, in_features: int, out_features: int) -> nn.Module | None:
        block = int8.int8_block(in_features)
        return Int8Linear(in_features, out_features, block) if block else None

    def experts_block(self, config: ModelConfig) -> int | None:
        return int8.int8_block(config.hidden_size, config.moe_intermediate_size)

    def int4_accuracy(self) -> int | None:
        return INT8_ACTIVATIONS

    def pieces(self, config, checkpoint, kind, layer, name):
        prefix = "" if kind == "head" else f"model.layers.{layer}."
        if name.endswith((".weight_int8", ".weight_int8_scale")):
            module, _, part = name.rpartition(".")
            source = prefix + module + ".weight"
            rows, cols = checkpoint.entries[source].shape
            block = int8.int8_block(cols)
            return (_int8_part(_source_rows(config, checkpoint, source, start, start + ROWS_PER_PIECE), block,
                               part.endswith("scale"), source)
                    for start in range(0, rows, ROWS_PER_PIECE))
        if name.startswith("mlp.experts_fc"):
            fc, part = name.removeprefix("mlp.experts_").split("_")
            block = self.experts_block(config)
            whole = lambda weight: _source_rows(config, checkpoint, weight, 0, 1 << 62)  # noqa: E731
            return (_int8_part(_expert_fc(f"{prefix}mlp.experts.{e}.", fc, whole), block,
                               part == "scale", f"{prefix}mlp.experts.{e}.{fc}")
                    for e in range(config.n_routed_experts))
        return None


# A checkpoint weight's rows as the int8 pass reads them: float32 [rows, cols] (BF16 widened), or FP8 as stored,
# (e4m3 bits [rows, cols] uint8, each row's block scales [rows, ceil(cols / fp8_block)] float32, fp8_block)
SourceRows = np.ndarray | tuple[np.ndarray, np.ndarray, int]


def _int8_part(rows: SourceRows, block: int, scales: bool, name: str) -> np.ndarray:
    """The int8 codes, or their block scales, of one piece of a weight; FP8 goes straight to int8 (plugins/int8.py),
    without a float32 copy."""
    if isinstance(rows, np.ndarray):
        return int8.block_scales(rows, block) if scales else int8.quantize_rows(rows, block)[0]
    bits, row_scales, fp8_block = rows
    if fp8_block % block:
        raise K2Error(f"{name}: an int8 block of {block} does not lie inside the FP8 blocks of {fp8_block}")
    largest = int8.fp8_block_maxima(bits, block)
    if (largest == int8.NAN_MAGNITUDE).any():
        raise K2Error(f"{name}: its FP8 weight holds NaN codes; the checkpoint is damaged")
    return int8.fp8_scales(largest, row_scales, fp8_block, block) if scales else int8.fp8_codes(bits, largest, block)


def _source_rows(config: ModelConfig, checkpoint: Checkpoint, name: str, start: int, stop: int) -> SourceRows:
    """Rows start:stop of a checkpoint weight: BF16 widened to float32, FP8 as stored with each row's scales."""
    raw = checkpoint.rows(name, start, stop)
    if raw.dtype.itemsize != 1:
        return raw.astype(np.float32)
    fp8 = config.fp8_block[0]
    scale = checkpoint.rows(name + "_scale_inv", start // fp8, -(-(start + len(raw)) // fp8))
    first = start % fp8
    return raw.view(np.uint8), np.repeat(scale, fp8, axis=0)[first : first + len(raw)].astype(np.float32), fp8


def _interleave(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """[r, ...] and [r, ...] -> [2r, ...]: first's row 0, second's row 0, first's row 1, ..."""
    return np.stack([first, second], axis=1).reshape(2 * first.shape[0], *first.shape[1:])


def _expert_fc(expert: str, fc: str, whole: Callable[[str], SourceRows]) -> SourceRows:
    """fc1: gate and up rows interleaved [2f, m] (QMoE's fused SwiGLU layout); fc2: down [m, f]; whole(name) reads
    one of the expert's weights."""
    if fc == "fc2":
        return whole(f"{expert}down_proj.weight")
    gate, up = whole(f"{expert}gate_proj.weight"), whole(f"{expert}up_proj.weight")
    if isinstance(gate, np.ndarray):
        return _interleave(gate, up)
    return _interleave(gate[0], up[0]), _interleave(gate[1], up[1]), gate[2]


# -- tensorrt_plugins --------------------------------------------------------------------------------

class TensorrtPlugins(Pass):
    """The TensorRT copy of each graph, beside it (it reads the same .data file)."""

    name = "tensorrt_plugins"

    def graph_files(self, directory: Path, stem: str) -> dict[str, dict]:
        from .tensorrt_graph import write_copy

        copy = write_copy(directory / f"{stem}.onnx")["path"]
        return {copy.name: file_record(directory, copy.name)}


# -- int4_experts (export --weights int4) ------------------------------------------------------------------

WEIGHT_CHOICES = ("checkpoint", "int4")  # export --weights: the experts as stored, or FP8 ones re-quantised to INT4


class Int4Experts(Pass):
    """An FP8 checkpoint's routed experts re-quantised to INT4 in groups of INT4_GROUP (core/int4.py `quantize`:
    symmetric, BF16 scales, as Kimi-K2-Thinking stores them), gate and up interleaved for QMoE, for hosts whose
    memory or bandwidth binds. Lossy; its error is measured in benchmarks/int4_experts.py and stated in docs/artifact.md.
    An INT4 checkpoint's own codes are copied, never re-quantised (export/graph_modules.py)."""

    name = "int4_experts"

    def int4_group(self) -> int | None:
        return INT4_GROUP

    def pieces(self, config, checkpoint, kind, layer, name):
        if config.int4 is not None or not name.startswith("mlp.experts_fc"):
            return None
        fc, part = name.removeprefix("mlp.experts_").split("_")
        return (_int4_part(_expert_fc(f"model.layers.{layer}.mlp.experts.{e}.", fc, checkpoint.float32),
                           part == "scales") for e in range(config.n_routed_experts))


def _int4_part(weight: np.ndarray, scales: bool) -> np.ndarray:
    packed, scale = int4.quantize(weight, INT4_GROUP)
    return scale.astype(np.float32) if scales else int4.nibble_bytes(packed)


def tiled_pieces(name: str, pieces: Iterable[np.ndarray], stack: bool) -> Iterable[np.ndarray]:
    """The pieces of a plain initializer `name` in the native step's tiles: codes (uint8) or block scales (`name`
    ends in scale or scales). stack: each piece is one weight of a stack (the routed experts), tiled on its own;
    else the pieces are one weight's rows in order, every piece but the last whole tiles."""
    scales = name.endswith(("scale", "scales"))
    ragged = None
    for piece in pieces:
        if ragged is not None and not stack:
            raise ValueError(f"initializer {name}: a piece of {ragged} rows is not whole tiles and more follow")
        rows = piece.reshape(len(piece), -1)
        if len(rows) % native_tiles.TILE:
            ragged = len(rows)
        yield native_tiles.tile_scales(rows) if scales else native_tiles.tile_codes(rows)


PASSES = {p.name: p for p in (Int8Weights(), TensorrtPlugins(), Int4Experts())}


def weight_layout(target: str) -> str:
    """The manifest's `weight_layout`: native_tiles where the target's passes hold the int8 and 4-bit weights in the
    native step's tiles (core/native_tiles.py), else rows."""
    return "native_tiles" if Lowering(target).native_tiles() else "rows"


class Lowering:
    """A target's passes, in their order, after the one `weights` asks for (WEIGHT_CHOICES), asked as one: the
    first pass that lowers a module or gives an initializer's bytes decides; every pass's graph files are written."""

    def __init__(self, target: str, weights: str = "checkpoint"):
        chosen = ("int4_experts",) if weights == "int4" else ()
        self.passes = [PASSES[name] for name in (*chosen, *get_target(target).passes)]

    def linear(self, in_features: int, out_features: int) -> nn.Module | None:
        return next((m for p in self.passes if (m := p.linear(in_features, out_features)) is not None), None)

    def experts_block(self, config: ModelConfig) -> int | None:
        return next((b for p in self.passes if (b := p.experts_block(config)) is not None), None)

    def int4_accuracy(self) -> int:
        return next((a for p in self.passes if (a := p.int4_accuracy()) is not None), EXACT)

    def int4_group(self) -> int | None:
        return next((g for p in self.passes if (g := p.int4_group()) is not None), None)

    def native_tiles(self) -> bool:
        return any(p.native_tiles() for p in self.passes)

    def pieces(self, config, checkpoint, kind, layer, name) -> Iterable[np.ndarray] | None:
        return next((x for p in self.passes if (x := p.pieces(config, checkpoint, kind, layer, name)) is not None),
                    None)

    def graph_files(self, directory: Path, stem: str) -> dict[str, dict]:
        return {name: record for p in self.passes for name, record in p.graph_files(directory, stem).items()}
