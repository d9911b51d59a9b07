"""The two facts the runtime checks in an ONNX file before ONNX Runtime opens it, read from protobuf's wire format.

The runtime runs without the `onnx` package, so this walks the few messages it needs by their field numbers
(onnx.proto): the model's metadata_props, and the location of every tensor kept as external data (the graph's
initializers, tensors in node attributes, subgraphs, and the bodies of the model's functions).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import K2Error

# field numbers of onnx.proto
MODEL_GRAPH, MODEL_METADATA, MODEL_FUNCTIONS = 7, 14, 25
GRAPH_NODE, GRAPH_INITIALIZER = 1, 5
FUNCTION_NODE = 7
NODE_ATTRIBUTE = 5
ATTRIBUTE_TENSOR, ATTRIBUTE_GRAPH, ATTRIBUTE_TENSORS, ATTRIBUTE_GRAPHS = 5, 6, 10, 11
TENSOR_EXTERNAL_DATA = 13
ENTRY_KEY, ENTRY_VALUE = 1, 2
MAX_NESTING = 32  # subgraphs within subgraphs: far beyond what an exported layer holds


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _fields(buffer: memoryview):
    """(field number, wire type, value) of one message: ints for varint and fixed fields, a memoryview for
    length-delimited ones."""
    at, end = 0, len(buffer)
    while at < end:
        key, at = _varint(buffer, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(buffer, at)
        elif wire == 2:
            length, at = _varint(buffer, at)
            if at + length > end:
                raise WireError("a field runs past the end of its message")
            value, at = buffer[at:at + length], at + length
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, at = int.from_bytes(buffer[at:at + width], "little"), at + width
        else:
            raise WireError(f"wire type {wire} is not one ONNX files use")
        if at > end:
            raise WireError("a field runs past the end of its message")
        yield field, wire, value


def _varint(buffer: memoryview, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if at >= len(buffer) or shift > 63:
            raise WireError("a varint is cut off or too long")
        byte = buffer[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def _messages(buffer: memoryview, number: int):
    return (value for field, wire, value in _fields(buffer) if field == number and wire == 2)


def _entries(buffer: memoryview, number: int) -> dict[str, str]:
    """A repeated StringStringEntryProto field as a dict."""
    out = {}
    for entry in _messages(buffer, number):
        parts = {field: bytes(value).decode("utf-8", "replace") for field, wire, value in _fields(entry) if wire == 2}
        out[parts.get(ENTRY_KEY, "")] = parts.get(ENTRY_VALUE, "")
    return out


def _external_locations(nodes_and_tensors: list[tuple[str, memoryview, int]]) -> set[str]:
    """Locations of external tensors under graphs, function bodies, nodes and tensors (walked without recursion)."""
    found, pending = set(), list(nodes_and_tensors)
    while pending:
        kind, buffer, depth = pending.pop()
        if depth > MAX_NESTING:
            raise WireError(f"subgraphs nested deeper than {MAX_NESTING} levels")
        if kind == "tensor":
            location = _entries(buffer, TENSOR_EXTERNAL_DATA).get("location")
            if location is not None:
                found.add(location)
        elif kind in ("graph", "function"):
            pending += [("node", n, depth) for n in _messages(buffer, GRAPH_NODE if kind == "graph" else FUNCTION_NODE)]
            if kind == "graph":
                pending += [("tensor", t, depth) for t in _messages(buffer, GRAPH_INITIALIZER)]
        else:  # a node: its attributes' tensors and subgraphs
            for attribute in _messages(buffer, NODE_ATTRIBUTE):
                for field, wire, value in _fields(attribute):
                    if wire == 2 and field in (ATTRIBUTE_TENSOR, ATTRIBUTE_TENSORS):
                        pending.append(("tensor", value, depth))
                    elif wire == 2 and field in (ATTRIBUTE_GRAPH, ATTRIBUTE_GRAPHS):
                        pending.append(("graph", value, depth + 1))
    return found


def graph_facts(path: Path) -> tuple[dict[str, str], set[str]]:
    """An ONNX file's metadata_props and the locations its external tensors name; a K2Error if it is not one."""
    try:
        model = memoryview(Path(path).read_bytes())
        metadata = _entries(model, MODEL_METADATA)
        roots = [("graph", g, 0) for g in _messages(model, MODEL_GRAPH)]
        roots += [("function", f, 0) for f in _messages(model, MODEL_FUNCTIONS)]
        return metadata, _external_locations(roots)
    except (WireError, IndexError) as exc:
        raise K2Error(f"{path}: not a readable ONNX file ({exc}); re-export the artifact") from None


TENSOR_DIMS, TENSOR_DATA_TYPE, TENSOR_NAME = 1, 2, 8


@dataclass(frozen=True)
class ExternalTensor:
    """A graph initializer kept as external data: where its bytes lie."""

    dims: tuple[int, ...]
    data_type: int  # TensorProto's element type number
    location: str
    offset: int
    length: int


def _dims(tensor: memoryview) -> tuple[int, ...]:
    dims = []
    for field, wire, value in _fields(tensor):
        if field != TENSOR_DIMS:
            continue
        if wire == 0:
            dims.append(value)
        elif wire == 2:  # packed
            at = 0
            while at < len(value):
                dim, at = _varint(value, at)
                dims.append(dim)
    return tuple(dims)


def external_initializers(path: Path) -> dict[str, ExternalTensor]:
    """The graph initializers of an ONNX file that are kept as external data, by name; a K2Error if the file is not
    a readable ONNX file or an entry's offset or length is not a number."""
    try:
        model = memoryview(Path(path).read_bytes())
        found = {}
        for graph in _messages(model, MODEL_GRAPH):
            for tensor in _messages(graph, GRAPH_INITIALIZER):
                data = _entries(tensor, TENSOR_EXTERNAL_DATA)
                if "location" not in data:
                    continue
                name = next((bytes(v).decode("utf-8", "replace") for f, w, v in _fields(tensor)
                             if f == TENSOR_NAME and w == 2), "")
                data_type = next((v for f, w, v in _fields(tensor) if f == TENSOR_DATA_TYPE and w == 0), 0)
                found[name] = ExternalTensor(_dims(tensor), data_type, data["location"], int(data.get("offset", 0)),
                                             int(data.get("length", -1)))
        return found
    except (WireError, IndexError, ValueError) as exc:
        raise K2Error(f"{path}: not a readable ONNX file ({exc}); re-export the artifact") from None
