"""The lowering passes of the exported graphs: a target's lowering is the list of named passes its `Target.passes`
gives (core/targets.py), applied in that order, each to what the passes before it made.

A pass acts at three points of an export. Each hook takes what the passes before it made there (`earlier`) and
returns what this pass makes of it; the defaults return it unchanged:
- `linear_block`, `experts_block`, `int4_group`, `int4_accuracy`, `tiled`: how the traced modules hold their
  weights, where they are built (export/graph_modules.py): the int8 block a projection or the routed experts are
  re-quantised in (None: as in the checkpoint), the INT4 group of re-quantised experts and the accuracy QMoE
  multiplies 4-bit experts at, whether the int8 and 4-bit weights are held in the native step's tiles;
- `pieces(..., name, earlier)`: an initializer's bytes as the export streams them, where `earlier(name)` gives
  any initializer's bytes as the passes before leave them, starting from the traced modules' own (copies of
  checkpoint tensors, derived tables, computed weights: export/exporter.py);
- `graph_files(directory, stem, earlier)`: files derived from a written graph, written beside it and listed in
  the manifest with it.

Passes:
- int4_experts (any target but tensorrt, asked by `export --weights int4`): an FP8 checkpoint's routed experts
  re-quantised to INT4 groups for ONNX Runtime's 4-bit QMoE; it runs before the target's passes.
- int8_weights (cpu): the dense linears, the head and the routed experts as int8 blocks along the input
  dim for ONNX Runtime's int8 kernels (plugins/int8.py), re-quantised from the checkpoint's FP8 / BF16 bytes.
- native_tiles (cpu, after int8_weights): the int8 and 4-bit weights the native step reads, laid out as it reads
  them (core/native_tiles.py): codes and block scales in tiles, the absorbed W_UK and W_UV four rows interleaved.
- tensorrt_plugins (tensorrt): the TensorRT copy of every graph, `<stem>.tensorrt.onnx`
  (export/tensorrt_graph.py), which `k2deploy build-engines` parses.
"""

from __future__ import annotations

from functools import partial, reduce
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..core import int4, native_tiles
from ..core.quant_blocks import INT4_GROUP
from ..core.checkpoint.reader import Checkpoint
from ..core.config import ModelConfig
from ..core.errors import K2Error
from ..core.manifest import file_record
from ..core.targets import get_target
from ..plugins import int8
from ..plugins.int4 import EXACT, INT8_ACTIVATIONS

Pieces = Callable[[str], Iterable[np.ndarray]]  # an initializer's name -> the pieces whose concatenation is its bytes


class Pass:
    """One named pass: its hooks (the module doc) each return `earlier`, what the passes before it made, unchanged."""

    name = ""

    def linear_block(self, in_features: int, earlier: int | None) -> int | None:
        return earlier

    def experts_block(self, config: ModelConfig, earlier: int | None) -> int | None:
        return earlier

    def int4_group(self, earlier: int | None) -> int | None:
        return earlier

    def int4_accuracy(self, earlier: int) -> int:
        return earlier

    def tiled(self, earlier: bool) -> bool:
        return earlier

    def pieces(self, config: ModelConfig, checkpoint: Checkpoint, kind: str, layer: int | None, name: str,
               earlier: Pieces) -> Iterable[np.ndarray]:
        return earlier(name)

    def graph_files(self, directory: Path, stem: str, earlier: dict[str, dict]) -> dict[str, dict]:
        return earlier


# -- int4_experts (export --weights int4) ------------------------------------------------------------------

WEIGHT_CHOICES = ("checkpoint", "int4")  # export --weights: the experts as stored, or FP8 ones re-quantised to INT4


class Int4Experts(Pass):
    """An FP8 checkpoint's routed experts re-quantised to INT4 in groups of INT4_GROUP (core/int4.py `quantize`:
    symmetric, BF16 scales, as Kimi-K2-Thinking stores them), gate and up interleaved for QMoE, for hosts whose
    memory or bandwidth binds. Lossy; its error is measured in benchmarks/int4_experts.py and stated in docs/artifact.md.
    An INT4 checkpoint's own codes are copied, never re-quantised (export/graph_modules.py)."""

    name = "int4_experts"

    def int4_group(self, earlier):
        return INT4_GROUP

    def pieces(self, config, checkpoint, kind, layer, name, earlier):
        if config.int4 is not None or not name.startswith("mlp.experts_fc"):
            return earlier(name)
        fc, part = name.removeprefix("mlp.experts_").split("_")
        return (_int4_part(_expert_fc(f"model.layers.{layer}.mlp.experts.{e}.", fc, checkpoint.float32),
                           part == "scales") for e in range(config.n_routed_experts))


def _int4_part(weight: np.ndarray, scales: bool) -> np.ndarray:
    packed, scale = int4.quantize(weight, INT4_GROUP)
    return scale.astype(np.float32) if scales else int4.nibble_bytes(packed)


# -- int8_weights ------------------------------------------------------------------------------------

ROWS_PER_PIECE = 1024  # rows re-quantised at a time: a real-size linear never sits in memory as float32


class Int8Weights(Pass):
    """Every linear whose input dim an int8 block divides, and the routed experts (fc1: gate and up rows
    interleaved, fc2: down, for QMoE) where a block divides hidden and expert width, as int8 codes
    (`<linear>.weight_int8`, `mlp.experts_<fc>_weight`) and their block scales (`..._scale`), in rows."""

    name = "int8_weights"

    def linear_block(self, in_features, earlier):
        return int8.int8_block(in_features) or earlier

    def experts_block(self, config, earlier):
        return int8.int8_block(config.hidden_size, config.moe_intermediate_size) or earlier

    def int4_accuracy(self, earlier):
        return INT8_ACTIVATIONS

    def pieces(self, config, checkpoint, kind, layer, name, earlier):
        prefix = "" if kind == "head" else f"model.layers.{layer}."
        if name.endswith((".weight_int8", ".weight_int8_scale")):
            module, _, part = name.rpartition(".")
            source = prefix + module + ".weight"
            rows, cols = checkpoint.entries[source].shape
            block = int8.int8_block(cols)
            return (_int8_part(_source_rows(config, checkpoint, source, start, start + ROWS_PER_PIECE), block,
                               part.endswith("scale"), source)
                    for start in range(0, rows, ROWS_PER_PIECE))
        if name.startswith("mlp.experts_fc") and name.endswith(("_weight", "_scale")):
            fc, part = name.removeprefix("mlp.experts_").split("_")
            block = self.experts_block(config, None)
            whole = lambda weight: _source_rows(config, checkpoint, weight, 0, 1 << 62)  # noqa: E731
            return (_int8_part(_expert_fc(f"{prefix}mlp.experts.{e}.", fc, whole), block,
                               part == "scale", f"{prefix}mlp.experts.{e}.{fc}")
                    for e in range(config.n_routed_experts))
        return earlier(name)


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


# -- native_tiles -----------------------------------------------------------------------------------

class NativeTiles(Pass):
    """The weights the native step reads, laid out as it reads them in place (core/native_tiles.py), from the rows
    the passes before it give: int8 and 4-bit codes and their block scales in tiles (`<name>_tiles`, a stack of
    experts tiled expert by expert), the absorbed W_UK and W_UV four rows interleaved (`<name>_four_rows`). The
    traced modules hold them so (export/tiled_buffers.py)."""

    name = "native_tiles"

    def tiled(self, earlier):
        return True

    def pieces(self, config, checkpoint, kind, layer, name, earlier):
        if name.endswith(native_tiles.SUFFIX):
            rows = name.removesuffix(native_tiles.SUFFIX)
            return tiled_pieces(rows, earlier(rows), stack=rows.startswith("mlp.experts_"))
        if name.endswith(native_tiles.FOUR_ROWS):
            return (native_tiles.four_rows(piece) for piece in earlier(name.removesuffix(native_tiles.FOUR_ROWS)))
        return earlier(name)


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


# -- tensorrt_plugins --------------------------------------------------------------------------------

class TensorrtPlugins(Pass):
    """The TensorRT copy of each graph, beside it (it reads the same .data file)."""

    name = "tensorrt_plugins"

    def graph_files(self, directory, stem, earlier):
        from .tensorrt_graph import write_copy

        copy = write_copy(directory / f"{stem}.onnx")["path"]
        return {**earlier, copy.name: file_record(directory, copy.name)}


PASSES = {p.name: p for p in (Int4Experts(), Int8Weights(), NativeTiles(), TensorrtPlugins())}


def weight_layout(target: str) -> str:
    """The manifest's `weight_layout`: native_tiles where the target's passes hold the int8 and 4-bit weights in the
    native step's tiles (core/native_tiles.py), else rows."""
    return "native_tiles" if Lowering(target).tiled() else "rows"


class Lowering:
    """A target's passes, in their order, after the one `weights` asks for (WEIGHT_CHOICES): each hook is the
    passes' hooks applied in turn, each to what the ones before it gave."""

    def __init__(self, target: str, weights: str = "checkpoint"):
        chosen = ("int4_experts",) if weights == "int4" else ()
        self.passes = [PASSES[name] for name in (*chosen, *get_target(target).passes)]

    def linear_block(self, in_features: int) -> int | None:
        return reduce(lambda block, p: p.linear_block(in_features, block), self.passes, None)

    def experts_block(self, config: ModelConfig) -> int | None:
        return reduce(lambda block, p: p.experts_block(config, block), self.passes, None)

    def int4_group(self) -> int | None:
        return reduce(lambda group, p: p.int4_group(group), self.passes, None)

    def int4_accuracy(self) -> int:
        return reduce(lambda accuracy, p: p.int4_accuracy(accuracy), self.passes, EXACT)

    def tiled(self) -> bool:
        return reduce(lambda tiled, p: p.tiled(tiled), self.passes, False)

    def pieces(self, config: ModelConfig, checkpoint: Checkpoint, kind: str, layer: int | None,
               traced: Pieces) -> Pieces:
        """A graph's initializers' bytes: `traced` (the traced modules' own) through every pass in turn."""
        return reduce(lambda earlier, p: partial(p.pieces, config, checkpoint, kind, layer, earlier=earlier),
                      self.passes, traced)

    def graph_files(self, directory: Path, stem: str) -> dict[str, dict]:
        return reduce(lambda files, p: p.graph_files(directory, stem, files), self.passes, {})
