"""MoE dispatch: each token through its k chosen experts' SwiGLU, weighted and summed.

Expert weights stay FP8 (their e4m3 bits held as uint8 [e, rows, cols], with float32 block
scales [e, ceil(rows/128), ceil(cols/128)]); only the chosen experts are dequantised, so a
decode step reads k experts, not e. When a batch routes more token-expert pairs than there
are experts (prefill), the ONNX body instead runs every expert once over all tokens.
"""

from __future__ import annotations

import onnx
import torch
import torch.nn.functional as F

from .fp8 import E4M3_VALUES, dequantize
from .onnx_domain import Body, FunctionSpec, custom_node


def experts_eager(x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale, down_bits, down_scale,
                  block: int) -> torch.Tensor:
    """x [n, m], expert_ids / route_weights [n, k], *_bits [e, rows, cols] uint8 -> [n, m] float32."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for expert in expert_ids.unique().tolist():
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        chosen = x[tokens].float()
        hidden = F.silu(chosen @ dequantize(gate_bits[expert], gate_scale[expert], block).T)
        hidden = hidden * (chosen @ dequantize(up_bits[expert], up_scale[expert], block).T)
        expert_out = hidden @ dequantize(down_bits[expert], down_scale[expert], block).T
        out.index_add_(0, tokens, expert_out * route_weights[tokens, slots, None])
    return out


@torch.library.custom_op("k2deploy::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, route_weights: torch.Tensor, gate_bits: torch.Tensor,
                gate_scale: torch.Tensor, up_bits: torch.Tensor, up_scale: torch.Tensor, down_bits: torch.Tensor,
                down_scale: torch.Tensor, block: int) -> torch.Tensor:
    return experts_eager(x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale, down_bits,
                         down_scale, block)


@moe_experts.register_fake
def _(x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale, down_bits, down_scale, block):
    return torch.empty_like(x, dtype=torch.float32)


# -- ONNX -----------------------------------------------------------------------------------

EXPERTS = FunctionSpec(
    "MoeExperts",
    ["x", "expert_ids", "route_weights", "gate_bits", "gate_scale", "up_bits", "up_scale", "down_bits", "down_scale"],
    ["y"],
    ["block"],
)
_experts_node = custom_node(EXPERTS.name, EXPERTS.inputs, EXPERTS.outputs, {"block": int})


def moe_experts_onnx(x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale, down_bits, down_scale,
                     block: int):
    return _experts_node(x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale, down_bits,
                         down_scale, block=block)


def _dequantize(b: Body, bits: str, scale: str, index: str | None, rows: int, cols: int, block: int) -> str:
    """bits [e, rows, cols] uint8 -> float32 [*index.shape, rows, cols] (every expert when index is None)."""
    rows_axis = 1 if index is None else 2  # an [n, k] index replaces the expert axis with two
    values = b.node("Gather", b.const(E4M3_VALUES, onnx.TensorProto.FLOAT),
                    b.node("Cast", bits if index is None else b.node("Gather", bits, index, axis=0), to=onnx.TensorProto.INT32),
                    axis=0)
    scales = scale if index is None else b.node("Gather", scale, index, axis=0)
    scales = b.node("Gather", scales, b.const([r // block for r in range(rows)]), axis=rows_axis)
    scales = b.node("Gather", scales, b.const([c // block for c in range(cols)]), axis=rows_axis + 1)
    return b.node("Mul", values, scales)


def _gathered_branch(f: int, m: int, block: int) -> onnx.GraphProto:
    """Decode: dequantise only the chosen experts, [n, k, rows, cols], and run them."""
    b = Body("gathered")
    x_column = b.node("Unsqueeze", "x", b.const([1, 3]))  # [n, 1, m, 1]
    gate = b.node("MatMul", _dequantize(b, "gate_bits", "gate_scale", "expert_ids", f, m, block), x_column)  # [n, k, f, 1]
    up = b.node("MatMul", _dequantize(b, "up_bits", "up_scale", "expert_ids", f, m, block), x_column)
    hidden = b.node("Mul", b.node("Mul", gate, b.node("Sigmoid", gate)), up)
    down = b.node("MatMul", _dequantize(b, "down_bits", "down_scale", "expert_ids", m, f, block), hidden)  # [n, k, m, 1]
    weighted = b.node("Mul", b.node("Squeeze", down, b.const([3])), b.node("Unsqueeze", "route_weights", b.const([2])))
    y = b.node("ReduceSum", weighted, b.const([1]), keepdims=0)
    return onnx.helper.make_graph(b.nodes, "gathered", [], [_float_output(y)])


def _dense_branch(e: int, f: int, m: int, block: int) -> onnx.GraphProto:
    """Prefill: every expert over every token, weighted by the sparse routing matrix [n, e]."""
    b = Body("dense")
    x_rows = b.node("Unsqueeze", "x", b.const([0]))  # [1, n, m]
    gate = b.node("MatMul", x_rows, b.node("Transpose", _dequantize(b, "gate_bits", "gate_scale", None, f, m, block), perm=[0, 2, 1]))
    up = b.node("MatMul", x_rows, b.node("Transpose", _dequantize(b, "up_bits", "up_scale", None, f, m, block), perm=[0, 2, 1]))
    hidden = b.node("Mul", b.node("Mul", gate, b.node("Sigmoid", gate)), up)  # [e, n, f]
    down = b.node("MatMul", hidden, b.node("Transpose", _dequantize(b, "down_bits", "down_scale", None, m, f, block), perm=[0, 2, 1]))
    tokens = b.node("Slice", b.node("Shape", "x"), b.const([0]), b.const([1]))
    zeros = b.node("ConstantOfShape", b.node("Concat", tokens, b.const([e]), axis=0),
                   value=onnx.helper.make_tensor("value", onnx.TensorProto.FLOAT, [1], [0.0]))
    combine = b.node("ScatterElements", zeros, "expert_ids", "route_weights", axis=1)  # [n, e]
    per_expert = b.node("Unsqueeze", b.node("Transpose", combine, perm=[1, 0]), b.const([2]))  # [e, n, 1]
    y = b.node("ReduceSum", b.node("Mul", down, per_expert), b.const([0]), keepdims=0)
    return onnx.helper.make_graph(b.nodes, "dense", [], [_float_output(y)])


def _float_output(name: str) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["n", "m"])


def moe_experts_function(n_experts: int, expert_width: int, hidden: int, block: int) -> onnx.FunctionProto:
    b = Body("experts")
    pairs = b.node("Size", "expert_ids")  # n * k
    use_dense = b.node("Greater", pairs, b.const(n_experts))
    y = b.node("If", use_dense, then_branch=_dense_branch(n_experts, expert_width, hidden, block),
               else_branch=_gathered_branch(expert_width, hidden, block))
    b.rename(y, "y")
    return EXPERTS.function(b)
