"""Tracing a module to ONNX without its weights, then giving the graph its weights as external data.

Modules are traced on the `meta` device (torch.export, then torch.onnx's dynamo exporter with
the plugins' translation table), so tracing costs no weight memory. Each initializer then gets
its bytes streamed straight from the checkpoint's memory-mapped shards into the graph's `.data`
file: a real-size layer is exported within a few hundred MB of memory.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
import onnx_ir as ir
import torch

from .. import plugins
from ..core.manifest import GRAPH_KEY, sha256_file
from .background_writer import BackgroundWriter

ALIGNMENT = 64  # every initializer starts at a multiple of this offset in the .data file


def trace(module: torch.nn.Module, args: tuple, dynamic_shapes: dict, input_names: list[str],
          output_names: list[str], opset: int) -> ir.Model:
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # notes about absent torchvision ops
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, args, dynamo=True, optimize=False, opset_version=opset, dynamic_shapes=dynamic_shapes,
            input_names=input_names, output_names=output_names, custom_translation_table=plugins.translation_table(),
            verbose=False,
        )
    model = program.model
    got_inputs, got_outputs = [v.name for v in model.graph.inputs], [v.name for v in model.graph.outputs]
    if got_inputs != list(input_names) or got_outputs != list(output_names):  # the translation fell back part way
        raise TracingError(f"tracing {type(module).__name__} at opset {opset} gave a graph taking {got_inputs} and "
                           f"giving {got_outputs}, not {list(input_names)} -> {list(output_names)}")
    return model


class TracingError(RuntimeError):
    """The exported graph is not the traced module's: an export must stop rather than write it."""


def io_spec(values: Iterable[ir.Value]) -> list[dict]:
    """name, ONNX dtype name and shape (ints, or names for dynamic dims) of graph inputs or outputs."""
    return [{"name": v.name, "dtype": v.dtype.name, "shape": [d if isinstance(d, int) else str(d) for d in v.shape]}
            for v in values]


def write_graph(model: ir.Model, functions: list[onnx.FunctionProto], directory: Path, stem: str,
                initializer_bytes: Callable[[str], Iterable[np.ndarray]],
                on_bytes: Callable[[int], None] = lambda n: None) -> dict[str, dict]:
    """Writes `stem.onnx` and `stem.data` into directory, each via a temporary name renamed at the end; an
    exception, Ctrl-C included, removes the temporary files.

    initializer_bytes(name) gives the pieces whose concatenation is that initializer's data.
    Returns each written file's name -> its record: the graph's {bytes, sha256}, the data file's {bytes, chunk_bytes,
    chunk_blake3} (core/file_hashes.py), hashed as it is written, not read back.
    """
    data_name, graph_name = f"{stem}.data", f"{stem}.onnx"
    data_partial, graph_partial = directory / f".{data_name}.partial", directory / f".{graph_name}.partial"
    try:
        data_bytes, data_digests = _write_data(model, directory, data_name, data_partial, initializer_bytes, on_bytes)
        onnx.save(_graph_proto(model, functions, stem), graph_partial)
        os.replace(data_partial, directory / data_name)
        os.replace(graph_partial, directory / graph_name)
    except BaseException:
        data_partial.unlink(missing_ok=True)
        graph_partial.unlink(missing_ok=True)
        raise
    return {
        graph_name: {"bytes": (directory / graph_name).stat().st_size, "sha256": sha256_file(directory / graph_name)},
        data_name: {"bytes": data_bytes, **data_digests},
    }


def _write_data(model: ir.Model, directory: Path, data_name: str, path: Path,
                initializer_bytes: Callable[[str], Iterable[np.ndarray]],
                on_bytes: Callable[[int], None]) -> tuple[int, dict]:
    """Streams every initializer into `path`, aligned, pointing the model's initializers at `data_name` in
    `directory`; -> (bytes written, their digests)."""
    offset = 0
    with open(path, "wb") as f, BackgroundWriter(f) as sink:  # written and hashed while the next piece is made
        for name, value in model.graph.initializers.items():
            pad = -offset % ALIGNMENT
            sink.write(b"\0" * pad)
            offset += pad
            length = 0
            for piece in initializer_bytes(name):
                chunk = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
                sink.write(chunk.data)
                length += chunk.nbytes
                on_bytes(chunk.nbytes)
            expected = value.dtype.itemsize * math.prod(int(d) for d in value.shape)
            if length != expected:
                raise ValueError(f"initializer {name}: {length} bytes from the checkpoint, the graph needs {expected}")
            value.const_value = ir.ExternalTensor(data_name, offset, length, value.dtype, shape=value.shape,
                                                  name=name, base_dir=directory)
            offset += length
        digests = sink.finish()
    return offset, digests


def _graph_proto(model: ir.Model, functions: list[onnx.FunctionProto], stem: str) -> onnx.ModelProto:
    proto = ir.serde.serialize_model(model)
    for node in proto.graph.node:
        del node.metadata_props[:]  # the tracer's per-node source notes: half the file, of no use at run time
    proto.metadata_props.add(key=GRAPH_KEY, value=stem)  # the runtime checks each graph is the one its place names
    used = {(node.domain, node.op_type) for node in proto.graph.node}
    proto.functions.extend(f for f in functions if (f.domain, f.name) in used)
    return proto
