"""What each TensorRT plugin is, in plain Python, derived from the op declarations (plugins/op_spec.py).

One `PluginSpec` per plugin (`DOMAIN_OP_PLUGINS`: which plugins each custom op of the `k2deploy`
ONNX domain becomes; MoeExperts becomes two). The plugin's name, namespace and version (what the
ONNX parser looks a node up by), its inputs and outputs in node order, its attributes, whether an
ahead-of-time (AOT) kernel exists, and its shape/dtype function: all read off its op's `OpSpec`.
No TensorRT needed; the graph rewrite and the tests use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .. import OPS
from ..onnx_domain import DOMAIN
from ..op_spec import OpSpec, TensorSpec

NAMESPACE = DOMAIN  # the plugin namespace: the ONNX domain of the custom nodes
VERSION = "1"  # tensorrt.plugin registers every plugin as version "1"


@dataclass(frozen=True)
class PluginSpec:
    op: OpSpec  # the declaration of the op the plugin runs

    @property
    def name(self) -> str:  # the ONNX op type and the plugin name
        return self.op.name

    @property
    def plugin_id(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(self.op.inputs)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self.op.outputs)

    @property
    def attributes(self) -> dict[str, type]:  # as the ONNX node carries them: a bool as an int
        return {a: int if kind is bool else kind for a, kind in self.op.attributes.items()}

    @property
    def aot(self) -> bool:  # an ahead-of-time (Triton -> PTX) implementation exists
        return self.op.plugin.launch is not None

    @property
    def implementation(self) -> str:  # what runs it on the GPU, in words
        return self.op.plugin.implementation

    def outputs_for(self, inputs: Sequence[TensorSpec], attributes: dict[str, Any]) -> list[TensorSpec]:
        return self.op.outputs_for(inputs, attributes)


PLUGINS: dict[str, PluginSpec] = {plugin.name: PluginSpec(plugin) for op in OPS for plugin in op.tensorrt_plugins}

# The plugins each custom op of the ONNX domain runs as in a TensorRT copy
DOMAIN_OP_PLUGINS: dict[str, tuple[str, ...]] = {
    op.name: tuple(plugin.name for plugin in op.tensorrt_plugins) for op in OPS if op.tensorrt_plugins}


def output_specs(op: str, inputs: Sequence[TensorSpec], attributes: dict[str, Any]) -> list[TensorSpec]:
    """The output descriptions of plugin `op` for these inputs and attributes; ValueError when they do not fit."""
    if op not in PLUGINS:
        raise ValueError(f"no plugin named {op!r}; plugins: {', '.join(PLUGINS)}")
    return PLUGINS[op].outputs_for(inputs, attributes)
