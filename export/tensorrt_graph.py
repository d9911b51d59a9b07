"""The TensorRT copy of an artifact's ONNX graphs: onnx and numpy only, no TensorRT, no torch.

TensorRT's ONNX parser imports a node of an unknown op type as a model-local function when the
model carries one of that name, and only otherwise looks the op up as a plugin. So the copy
that `k2deploy build-engines` feeds to the parser is rewritten from the exported graph, by the
tensorrt target's `tensorrt_plugins` pass as it exports (export/passes.py), or by build-engines
for an artifact that has no copies (one exported for cuda):

- the model-local function bodies of the plugin ops are dropped, and every `k2deploy` node
  carries the attributes the parser resolves a plugin by: `plugin_namespace`, `plugin_version`
  and, where an ahead-of-time kernel exists, `aot` = 1;
- routed-expert weight bits, stored as UINT8 (ONNX Gather has no FP8 type), are typed
  FLOAT8E4M3FN: the same bytes, and TensorRT takes UINT8 only as a network input or output;
- a Cast to or from FP8 (which the parser rejects) becomes explicit quantisation: FP8 weights
  and the FP8 latent cache stay FP8 through a DequantizeLinear with unit scale, the block
  scales being applied by the Mul that follows as in the exported graph; the new cache
  entries leave through a QuantizeLinear with unit scale (both saturate to +-448, as the Cast);
- torch's split (SplitToSequence + SequenceAt, unsupported) becomes one Split;
- CastLike becomes Cast, and the small constant computations torch emits for axes, starts
  and shapes are folded into initializers (the parser needs Slice, Reduce*, Squeeze axes and
  TopK's K as initializers);
- dead nodes are removed.

Weights are not duplicated: the copy is written beside the exported graph, as
ART/graphs/<stem>.tensorrt.onnx, and reads the same `.data` file (the external-data locations are
kept). It cannot live elsewhere without a second copy of the weights: TensorRT's parser, ONNX and
ONNX Runtime all refuse external data outside the model's folder (`../`), and ONNX also refuses
it behind a symbolic or a hard link.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..core.targets import artifact_target
from ..plugins.tensorrt.descriptors import DOMAIN_OP_PLUGINS, NAMESPACE, PLUGINS, VERSION

OPS_FILE = Path(__file__).resolve().parents[1] / "plugins" / "tensorrt" / "tensorrt_onnx_ops.json"
FOLD_LIMIT = 1 << 16  # constant computations up to this many elements are folded into initializers
FP8 = TensorProto.FLOAT8E4M3FN
QUANTIZED_TYPES = {TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2,
                   TensorProto.FLOAT8E5M2FNUZ, TensorProto.INT4, TensorProto.UINT4, TensorProto.INT8}
EXPERT_BITS_INPUTS = ("gate_bits", "up_bits", "down_bits")
UNIT_SCALE, FP8_ZERO = "k2trt_unit_scale", "k2trt_fp8_zero"
# ops whose axes / K input the parser needs as an initializer (docs/operators.md restrictions)
CONSTANT_INPUTS = {"Slice": (1, 2, 3, 4), "TopK": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "CumSum": (1,),
                   **{op: (1,) for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
                                          "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")}}
NOT_FOLDED = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
              "If", "Loop", "Scan", "SequenceEmpty", "SplitToSequence", "SequenceAt", "SequenceConstruct",
              "DequantizeLinear", "QuantizeLinear"}


@lru_cache(maxsize=1)
def parser_ops() -> dict:
    """The TensorRT ONNX parser's operator support matrix, with its source (see the JSON file)."""
    return json.loads(OPS_FILE.read_text())


def supported_ops() -> set[str]:
    return {name for name, entry in parser_ops()["operators"].items() if entry["supported"]}


# -- the rewrite ----------------------------------------------------------------------------

class _Graph:
    """What the passes need to know about a graph: constant values, element types, producers."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        self.types: dict[str, int] = {}
        self.shapes: dict[str, list] = {}
        for value in [*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info]:
            tensor = value.type.tensor_type
            if tensor.elem_type:
                self.types[value.name] = tensor.elem_type
            if tensor.HasField("shape"):
                self.shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        self.initializers = {t.name: t for t in self.graph.initializer}
        for t in self.graph.initializer:
            self.types[t.name] = t.data_type
            self.shapes[t.name] = list(t.dims)
        self.constants: dict[str, np.ndarray] = {}
        for t in self.graph.initializer:
            if not _is_external(t) and _numel(t.dims) <= FOLD_LIMIT:
                self.constants[t.name] = numpy_helper.to_array(t)
        self.counts: Counter = Counter()
        self._fresh = 0

    def fresh(self, base: str) -> str:
        self._fresh += 1
        return f"{base}__trt{self._fresh}"

    def add_initializer(self, name: str, value: np.ndarray, dtype: int | None = None) -> None:
        if dtype is None:
            tensor = numpy_helper.from_array(np.asarray(value), name)
        else:
            tensor = helper.make_tensor(name, dtype, np.shape(value), np.asarray(value).flatten().tolist())
        self.graph.initializer.append(tensor)
        self.initializers[name] = tensor
        self.types[name] = tensor.data_type
        self.shapes[name] = list(tensor.dims)
        self.constants[name] = numpy_helper.to_array(tensor)


def _is_external(tensor: TensorProto) -> bool:
    return tensor.data_location == TensorProto.EXTERNAL


def _numel(dims) -> int:
    return int(np.prod([int(d) for d in dims])) if len(dims) else 1


def _attribute(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _set_attribute(node: onnx.NodeProto, name: str, value) -> None:
    for i, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[i]
            break
    node.attribute.append(helper.make_attribute(name, value))


def _plugin_node(g: _Graph, source: onnx.NodeProto, plugin: str, inputs: list[str], outputs: list[str],
                 aot: bool) -> onnx.NodeProto:
    """A node the parser resolves to `plugin`: the plugin's own attributes from `source`, plus
    plugin_namespace, plugin_version and (where an AOT kernel exists and is wanted) aot."""
    spec = PLUGINS[plugin]
    node = helper.make_node(plugin, inputs, outputs, name=f"{source.name or source.op_type}/{plugin}",
                            domain=NAMESPACE)
    node.attribute.extend(a for a in source.attribute if a.name in spec.attributes)
    _set_attribute(node, "plugin_namespace", NAMESPACE)
    _set_attribute(node, "plugin_version", VERSION)
    if aot and spec.aot:
        _set_attribute(node, "aot", 1)
    g.counts[f"{plugin} plugin nodes"] += 1
    for name, role in zip(inputs, spec.inputs):
        tensor = g.initializers.get(name) if role in EXPERT_BITS_INPUTS else None
        if tensor is not None and tensor.data_type == TensorProto.UINT8:
            tensor.data_type = FP8  # same bytes: the bits are e4m3 values
            g.types[tensor.name] = FP8
            g.counts["expert bits typed UINT8 -> FLOAT8E4M3FN"] += 1
    return node


def _annotate_plugins(g: _Graph, aot: bool) -> None:
    """Drops the custom ops' function bodies and turns each custom node into its plugin node(s): MoeExperts
    becomes MoeExpertsUp (-> hidden [n, k, f]) and MoeExpertsDown."""
    kept = [f for f in g.model.functions if not (f.domain == NAMESPACE and f.name in DOMAIN_OP_PLUGINS)]
    g.counts["plugin function bodies dropped"] += len(g.model.functions) - len(kept)
    del g.model.functions[:]
    g.model.functions.extend(kept)
    nodes = []
    for node in g.graph.node:
        if node.domain != NAMESPACE:
            nodes.append(node)
            continue
        if node.op_type not in DOMAIN_OP_PLUGINS:
            raise ValueError(f"node {node.name}: op {NAMESPACE}::{node.op_type} has no TensorRT plugin "
                             f"(custom ops with plugins: {', '.join(DOMAIN_OP_PLUGINS)})")
        if node.op_type != "MoeExperts":
            nodes.append(_plugin_node(g, node, node.op_type, list(node.input), list(node.output), aot))
            continue
        x, ids, weights, gate, gate_scale, up, up_scale, down, down_scale = node.input
        hidden = g.fresh("experts_hidden")
        g.types[hidden] = TensorProto.FLOAT
        nodes.append(_plugin_node(g, node, "MoeExpertsUp", [x, ids, gate, gate_scale, up, up_scale], [hidden], aot))
        nodes.append(_plugin_node(g, node, "MoeExpertsDown", [hidden, ids, weights, down, down_scale],
                                  list(node.output), aot))
        g.counts["MoeExperts -> MoeExpertsUp + MoeExpertsDown"] += 1
    del g.graph.node[:]
    g.graph.node.extend(nodes)


def _castlike_to_cast(g: _Graph) -> None:
    for node in g.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type == "CastLike" and node.input[1] in g.types:
            target = g.types[node.input[1]]
            node.op_type = "Cast"
            del node.input[1]
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("to", target))
            g.counts["CastLike -> Cast"] += 1


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
    return None


def _fold_constants(g: _Graph) -> None:
    """Evaluates nodes whose inputs are all small constants; their outputs become initializers."""
    from onnx.reference import ReferenceEvaluator

    opset = next((o.version for o in g.model.opset_import if o.domain in ("", "ai.onnx")), 21)
    kept = []
    for node in g.graph.node:
        standard = node.domain in ("", "ai.onnx")
        if standard and node.op_type == "Constant":
            value = _constant_value(node)
            if value is not None and value.size <= FOLD_LIMIT:
                g.constants[node.output[0]] = value
                kept.append(node)  # replaced by an initializer below if anything still reads it
                continue
        if standard and node.op_type == "Shape" and node.input[0] in g.shapes \
                and all(d is not None for d in g.shapes[node.input[0]]):
            shape = np.array(g.shapes[node.input[0]], dtype=np.int64)
            start, end = _attribute(node, "start", 0), _attribute(node, "end", None)
            g.constants[node.output[0]] = shape[start:end]
            g.counts["folded constants"] += 1
            continue
        inputs = [i for i in node.input if i]
        if (standard and node.op_type not in NOT_FOLDED and inputs and all(i in g.constants for i in inputs)
                and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)):
            try:
                model = helper.make_model(
                    helper.make_graph([node], "fold", [helper.make_tensor_value_info(i, _np_type(g.constants[i]), None)
                                                       for i in dict.fromkeys(inputs)],
                                      [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None)
                                       for o in node.output if o]),
                    opset_imports=[helper.make_opsetid("", opset)])
                results = ReferenceEvaluator(model).run(None, {i: g.constants[i] for i in inputs})
            except Exception:  # noqa: BLE001 - an op the reference cannot evaluate stays a node
                kept.append(node)
                continue
            if all(np.asarray(r).size <= FOLD_LIMIT for r in results):
                for name, result in zip([o for o in node.output if o], results):
                    g.constants[name] = np.asarray(result)
                g.counts["folded constants"] += 1
                continue
        kept.append(node)
    # every folded value still read by a node or a graph output becomes an initializer
    produced_by_kept = {o for n in kept for o in n.output}
    needed = {i for n in kept for i in _all_inputs(n)} | {o.name for o in g.graph.output}
    final = []
    for node in kept:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output[0] in g.constants:
            if node.output[0] in needed:
                g.add_initializer(node.output[0], g.constants[node.output[0]])
            continue
        final.append(node)
    for name, value in g.constants.items():
        if name in needed and name not in g.initializers and name not in produced_by_kept:
            g.add_initializer(name, value)
    del g.graph.node[:]
    g.graph.node.extend(final)


def _np_type(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)


def _all_inputs(node: onnx.NodeProto) -> list[str]:
    """A node's inputs and the outer-scope names its subgraphs read."""
    names = [i for i in node.input if i]
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for sub in graphs:
            local = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            for n in sub.node:
                local.update(n.output)
            for n in sub.node:
                names.extend(i for i in _all_inputs(n) if i not in local)
            names.extend(o.name for o in sub.output if o.name not in local)
    return names


def _split_sequences(g: _Graph) -> None:
    """SplitToSequence(x, sizes) followed by SequenceAt(seq, i) for constant i -> Split(x, sizes)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.graph.node:
        for name in _all_inputs(node):
            readers.setdefault(name, []).append(node)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dropped: set[int] = set()
    for node in g.graph.node:
        if node.op_type != "SplitToSequence":
            continue
        if len(node.input) < 2 or node.input[1] not in g.constants:
            raise ValueError(f"node {node.name}: SplitToSequence without constant split sizes cannot become Split")
        if _attribute(node, "keepdims", 1) != 1:
            raise ValueError(f"node {node.name}: SplitToSequence with keepdims=0 is not rewritten")
        sizes = np.asarray(g.constants[node.input[1]]).astype(np.int64)
        if sizes.ndim != 1:
            raise ValueError(f"node {node.name}: SplitToSequence with a scalar split is not rewritten")
        sequence = node.output[0]
        uses = readers.get(sequence, [])
        if any(u.op_type != "SequenceAt" or u.input[1] not in g.constants for u in uses) \
                or sequence in {o.name for o in g.graph.output}:
            raise ValueError(f"node {node.name}: its sequence is read other than by SequenceAt at constant "
                             f"positions; it cannot become Split")
        parts = [g.fresh(f"{sequence}_part{i}") for i in range(len(sizes))]
        extra = []
        named = set()
        for use in uses:
            index = int(np.asarray(g.constants[use.input[1]])) % len(sizes)
            if index not in named:
                parts[index] = use.output[0]
                named.add(index)
            else:
                extra.append(helper.make_node("Identity", [parts[index]], [use.output[0]], name=g.fresh(use.name)))
            dropped.add(id(use))
        sizes_name = g.fresh(f"{sequence}_sizes")
        g.add_initializer(sizes_name, sizes)
        split = helper.make_node("Split", [node.input[0], sizes_name], parts, name=node.name or g.fresh("split"),
                                 axis=_attribute(node, "axis", 0))
        replaced[id(node)] = [split, *extra]
        g.counts["SplitToSequence + SequenceAt -> Split"] += 1
    if not replaced:
        return
    nodes = []
    for node in g.graph.node:
        if id(node) in dropped:
            continue
        nodes.extend(replaced.get(id(node), [node]))
    del g.graph.node[:]
    g.graph.node.extend(nodes)


def _explicit_fp8(g: _Graph) -> None:
    """Cast from FP8 -> DequantizeLinear (unit scale); Cast to FP8 -> QuantizeLinear (unit scale, saturating)."""
    nodes = []
    for node in g.graph.node:
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        source, target = g.types.get(node.input[0]), _attribute(node, "to")
        if source == FP8 and target != FP8:
            _ensure_unit_scale(g, TensorProto.FLOAT)
            if target == TensorProto.FLOAT:
                nodes.append(helper.make_node("DequantizeLinear", [node.input[0], UNIT_SCALE], list(node.output),
                                              name=node.name or g.fresh("dq")))
            else:
                wide = g.fresh(node.output[0])
                nodes.append(helper.make_node("DequantizeLinear", [node.input[0], UNIT_SCALE], [wide],
                                              name=g.fresh(node.name or "dq")))
                nodes.append(helper.make_node("Cast", [wide], list(node.output), name=node.name, to=target))
            g.counts["Cast from FP8 -> DequantizeLinear"] += 1
        elif target == FP8 and source != FP8:
            if source not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
                raise ValueError(f"node {node.name}: Cast to FP8 from element type {source} has no QuantizeLinear form")
            scale = _ensure_unit_scale(g, source)
            _ensure_fp8_zero(g)
            nodes.append(helper.make_node("QuantizeLinear", [node.input[0], scale, FP8_ZERO], list(node.output),
                                          name=node.name or g.fresh("q"), saturate=1))
            g.counts["Cast to FP8 -> QuantizeLinear"] += 1
        else:
            nodes.append(node)
    del g.graph.node[:]
    g.graph.node.extend(nodes)


def _ensure_unit_scale(g: _Graph, dtype: int) -> str:
    name = UNIT_SCALE if dtype == TensorProto.FLOAT else f"{UNIT_SCALE}_{TensorProto.DataType.Name(dtype).lower()}"
    if name not in g.initializers:
        g.add_initializer(name, np.array(1.0, dtype=np.float32), dtype)
    return name


def _ensure_fp8_zero(g: _Graph) -> None:
    if FP8_ZERO not in g.initializers:
        tensor = helper.make_tensor(FP8_ZERO, FP8, [], [0.0])
        g.graph.initializer.append(tensor)
        g.initializers[FP8_ZERO] = tensor
        g.types[FP8_ZERO] = FP8


def _remove_dead(g: _Graph) -> None:
    live = {o.name for o in g.graph.output}
    kept = []
    for node in reversed(list(g.graph.node)):
        if any(o in live for o in node.output):
            kept.append(node)
            live.update(_all_inputs(node))
        else:
            g.counts["dead nodes removed"] += 1
    kept.reverse()
    del g.graph.node[:]
    g.graph.node.extend(kept)
    graph_inputs = {i.name for i in g.graph.input}
    initializers = [t for t in g.graph.initializer if t.name in live or t.name in graph_inputs]
    del g.graph.initializer[:]
    g.graph.initializer.extend(initializers)


def tensorrt_model(model: onnx.ModelProto, aot: bool = True) -> tuple[onnx.ModelProto, dict]:
    """The TensorRT copy of one exported graph (the input is not changed) and what was rewritten."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    g = _Graph(copy)
    _annotate_plugins(g, aot)
    _castlike_to_cast(g)
    _fold_constants(g)
    _split_sequences(g)
    _explicit_fp8(g)
    _remove_dead(g)
    del copy.graph.value_info[:]  # inferred through the dropped function bodies; the parser infers its own
    if not any(n.domain == NAMESPACE for n in copy.graph.node):
        kept = [o for o in copy.opset_import if o.domain != NAMESPACE]
        del copy.opset_import[:]
        copy.opset_import.extend(kept)
    copy.producer_name = "k2deploy tensorrt_graph"
    report = {"rewrites": dict(sorted(g.counts.items())), "op_types": op_types(copy)}
    return copy, report


def op_types(model: onnx.ModelProto) -> list[str]:
    """Every op type in the model (subgraphs included), `domain::Op` for custom domains."""
    found = set()

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            found.add(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}")
            for a in node.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    visit(sub)

    visit(model.graph)
    return sorted(found)


# -- checks ---------------------------------------------------------------------------------

def parser_problems(model: onnx.ModelProto) -> list[str]:
    """What in a TensorRT copy the parser would refuse, per its support matrix and restrictions; [] when none."""
    supported = supported_ops()
    problems = []
    initializers = {t.name: t for t in model.graph.initializer}
    function_names = {(f.domain, f.name) for f in model.functions}
    types = {t.name: t.data_type for t in model.graph.initializer}
    for value in [*model.graph.input, *model.graph.output]:
        types[value.name] = value.type.tensor_type.elem_type

    def visit(graph: onnx.GraphProto, outer: dict) -> None:
        local = {**outer, **{t.name: t for t in graph.initializer}}
        for node in graph.node:
            where = f"{node.name or node.op_type} ({node.op_type})"
            if node.domain == NAMESPACE:
                if (node.domain, node.op_type) in function_names:
                    problems.append(f"{where}: a function body of the same name would be inlined instead of the plugin")
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                if (attrs.get("plugin_namespace"), attrs.get("plugin_version")) != (NAMESPACE.encode(), VERSION.encode()):
                    problems.append(f"{where}: missing plugin_namespace/plugin_version attributes")
                continue
            if node.domain not in ("", "ai.onnx"):
                problems.append(f"{where}: domain {node.domain!r} is neither standard ONNX nor the plugins'")
                continue
            if node.op_type not in supported:
                problems.append(f"{where}: not supported by the TensorRT ONNX parser")
                continue
            for index in CONSTANT_INPUTS.get(node.op_type, ()):
                if index < len(node.input) and node.input[index] and node.input[index] not in local:
                    problems.append(f"{where}: input {index} must be an initializer")
            if node.op_type == "Cast" and (_attribute(node, "to") in QUANTIZED_TYPES
                                           or types.get(node.input[0]) in QUANTIZED_TYPES):
                problems.append(f"{where}: Cast to or from a quantized type (use Q/DQ)")
            if node.op_type == "ScatterND" and _attribute(node, "reduction", b"none") not in (b"none", "none"):
                problems.append(f"{where}: ScatterND with a reduction")
            if node.op_type in ("DequantizeLinear", "QuantizeLinear") and len(node.input) > 2 and node.input[2]:
                zero = local.get(node.input[2])
                if zero is None or np.any(numpy_helper.to_array(zero).astype(np.float32) != 0):
                    problems.append(f"{where}: zero point must be a zero initializer")
            for a in node.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    visit(sub, local)

    visit(model.graph, initializers)
    return problems


# -- an artifact's copies on disk ---------------------------------------------------------

def graph_entries(manifest) -> list[dict]:
    graphs = manifest.graphs
    return [e for e in [graphs.get("embed"), *graphs.get("layers", []), graphs.get("head")] if e]


COPY_SUFFIX = ".tensorrt.onnx"  # the copies with AOT kernels: what the tensorrt target's export writes
JIT_COPY_SUFFIX = ".tensorrt-jit.onnx"  # `build-engines --no-aot`'s copies, whose plugins run as Python


def copy_path(graph: Path, aot: bool = True) -> Path:
    """Where the TensorRT copy of a graph file lives: beside the graph and its weights, graphs/<stem>.tensorrt.onnx."""
    return graph.with_name(graph.stem + (COPY_SUFFIX if aot else JIT_COPY_SUFFIX))


def write_copy(graph: Path, aot: bool = True) -> dict:
    """Writes the TensorRT copy of one exported graph file beside it -> {"path", "rewrites", "op_types"}."""
    copy, info = tensorrt_model(onnx.load(str(graph), load_external_data=False), aot=aot)
    problems = parser_problems(copy)
    if problems:
        raise ValueError(f"{graph.name}: the TensorRT copy still has what the parser refuses: " + "; ".join(problems[:5]))
    target = copy_path(graph, aot)
    partial = target.with_name(f".{target.name}.partial")
    onnx.save(copy, str(partial))
    os.replace(partial, target)
    return {"path": target, **info}


def tensorrt_copies(manifest, aot: bool = True) -> dict:
    """The TensorRT copy of every graph of the artifact: the one its manifest lists (the tensorrt target's export
    wrote it), else one written now, beside the graph and reading the same .data file.

    Returns {stem: {"file", "data", "written"}, with "rewrites" and "op_types" for the copies written now},
    paths relative to the artifact.
    """
    artifact_target(manifest.data).check_runnable("tensorrt")
    report = {}
    for entry in graph_entries(manifest):
        source = manifest.path(entry["file"])
        folder = str(Path(entry["file"]).parent)
        listed = f"{folder}/{copy_path(source, aot).name}"
        if listed in manifest.data["files"]:
            copy = {"path": manifest.path(listed), "written": False}
        else:
            copy = {**write_copy(source, aot), "written": True}
        path = copy.pop("path")
        model = onnx.load(str(path), load_external_data=False)
        data = sorted({e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"})
        report[source.stem] = {"file": f"{folder}/{path.name}", "data": [f"{folder}/{d}" for d in data], **copy}
    return report
