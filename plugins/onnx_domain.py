"""The project's ONNX domain: custom nodes for the exporter and function bodies for ONNX Runtime.

The exporter lowers each custom op to ONE node of domain `k2deploy` (through a translation
function built on a local OpSchema, so that the node is not inlined). The model then carries
a model-local FunctionProto of the same name whose body is standard ONNX: ONNX Runtime runs
that body on any execution provider, and TensorRT's parser can swap the node for a plugin.
"""

from __future__ import annotations

import onnx
from onnx import helper
from onnx.defs import OpSchema
from onnxscript.values import Op, Opset

DOMAIN = "k2deploy"
VERSION = 1
BODY_OPSET = 21  # the standard opset the function bodies are written against

_ATTRIBUTE_TYPES = {int: OpSchema.AttrType.INT, float: OpSchema.AttrType.FLOAT, bool: OpSchema.AttrType.INT}
_ALL_TENSORS = [f"tensor({t})" for t in ("float", "float16", "bfloat16", "int64", "int32", "uint8", "bool", "float8e4m3fn")]


def custom_node(name: str, inputs: list[str], outputs: list[str], attributes: dict[str, type]) -> Op:
    """An onnxscript op that emits one `k2deploy::name` node; call it inside a translation function."""
    parameter = OpSchema.FormalParameter
    schema = OpSchema(
        name, DOMAIN, VERSION,
        inputs=[parameter(n, f"T{i}") for i, n in enumerate(inputs)],
        outputs=[parameter(n, f"U{i}") for i, n in enumerate(outputs)],
        type_constraints=[(f"T{i}", _ALL_TENSORS, "") for i in range(len(inputs))]
        + [(f"U{i}", _ALL_TENSORS, "") for i in range(len(outputs))],
        attributes=[OpSchema.Attribute(n, _ATTRIBUTE_TYPES[t]) for n, t in attributes.items()],
    )
    return Op(Opset(DOMAIN, VERSION), name, schema)


class Body:
    """Builds a function body node by node; `node` returns its output names."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def node(self, op: str, *inputs: str, outputs: int = 1, **attributes) -> str | list[str]:
        names = []
        for _ in range(outputs):
            self._count += 1
            names.append(f"{self.prefix}_{self._count}")
        self.nodes.append(helper.make_node(op, list(inputs), names, **attributes))
        return names[0] if outputs == 1 else names

    def const(self, value, dtype=onnx.TensorProto.INT64) -> str:
        import numpy as np

        array = np.asarray(value)
        tensor = helper.make_tensor(f"{self.prefix}_c{self._count}", dtype, array.shape, array.flatten().tolist())
        return self.node("Constant", value=tensor)

    def rename(self, source: str, target: str) -> None:
        """Makes `target` (a function output name) an alias of `source`."""
        self.nodes.append(helper.make_node("Identity", [source], [target]))


def make_function(name: str, inputs: list[str], outputs: list[str], attributes: list[str], body: Body,
                  extra_opsets: list | None = None) -> onnx.FunctionProto:
    """The model-local function `k2deploy::name` with this body, written against BODY_OPSET (and extra_opsets)."""
    return helper.make_function(DOMAIN, name, inputs, outputs, body.nodes,
                                opset_imports=[helper.make_opsetid("", BODY_OPSET), *(extra_opsets or [])],
                                attributes=attributes)
