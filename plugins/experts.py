"""MoE dispatch: each token through its k chosen experts' SwiGLU, weighted and summed.

Expert weights stay FP8 (their e4m3 bits held as uint8 [e, rows, cols], with float32 block
scales [e, ceil(rows/128), ceil(cols/128)]); only the chosen experts are dequantised, so a
decode step reads k experts, not e. When a batch routes more token-expert pairs than there
are experts (prefill), the ONNX body instead loops over the experts, running each once on the
tokens routed to it. The TensorRT copy of a graph runs the op as two plugins, MoeExpertsUp
(the chosen experts' SwiGLU -> hidden [n, k, f]) and MoeExpertsDown (their weighted down
projection); their bodies here let ONNX Runtime run that copy too.
"""

from __future__ import annotations

import onnx
import torch
import torch.nn.functional as F

from .fp8 import E4M3_VALUES, dequantize
from .onnx_domain import Body
from .op_spec import (EXPERT_BITS_DTYPES, FLOAT, INT64, KernelLaunch, OpSpec, Plugin, Tensor, fixed, is_int, need,
                      tensor)


def experts_up_eager(x, expert_ids, gate_bits, gate_scale, up_bits, up_scale, block: int) -> torch.Tensor:
    """The SwiGLU of each token's chosen experts: x [n, m], expert_ids [n, k], gate/up bits [e, f, m]
    -> hidden [n, k, f] float32, silu(G_e x) * (U_e x) for the expert e in each slot."""
    n, k = expert_ids.shape
    hidden = torch.zeros((n, k, gate_bits.shape[1]), dtype=torch.float32, device=x.device)
    for expert in expert_ids.unique().tolist():
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        chosen = x[tokens].float()
        gate = chosen @ dequantize(gate_bits[expert], gate_scale[expert], block).T
        hidden[tokens, slots] = F.silu(gate) * (chosen @ dequantize(up_bits[expert], up_scale[expert], block).T)
    return hidden


def experts_down_eager(hidden, expert_ids, route_weights, down_bits, down_scale, block: int) -> torch.Tensor:
    """The chosen experts' down projections, weighted and summed: hidden [n, k, f], expert_ids / route_weights
    [n, k], down bits [e, m, f] -> [n, m] float32."""
    out = torch.zeros((hidden.shape[0], down_bits.shape[1]), dtype=torch.float32, device=hidden.device)
    for expert in expert_ids.unique().tolist():
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        expert_out = hidden[tokens, slots] @ dequantize(down_bits[expert], down_scale[expert], block).T
        out.index_add_(0, tokens, expert_out * route_weights[tokens, slots, None])
    return out


def experts_eager(x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale, down_bits, down_scale,
                  block: int) -> torch.Tensor:
    """x [n, m], expert_ids / route_weights [n, k], *_bits [e, rows, cols] uint8 -> [n, m] float32."""
    hidden = experts_up_eager(x, expert_ids, gate_bits, gate_scale, up_bits, up_scale, block)
    return experts_down_eager(hidden, expert_ids, route_weights, down_bits, down_scale, block)


# -- the ops: MoeExperts, and the two plugins a TensorRT copy runs it as -----------------------
# bits [e, rows, cols] with one scale per block: [e, ceil(rows/block), ceil(cols/block)] (fb, mb: f and m in blocks)

_TENSORS = {
    "x": tensor("n m", FLOAT), "expert_ids": tensor("n k", INT64), "route_weights": tensor("n k", FLOAT),
    "gate_bits": tensor("e f m", *EXPERT_BITS_DTYPES), "gate_scale": tensor("e fb mb", FLOAT),
    "up_bits": tensor("e f m", *EXPERT_BITS_DTYPES), "up_scale": tensor("e fb mb", FLOAT),
    "down_bits": tensor("e m f", *EXPERT_BITS_DTYPES), "down_scale": tensor("e mb fb", FLOAT),
    "hidden": tensor("n k f", FLOAT), "y": tensor("n m", FLOAT),
}


def _tensors(names: str) -> dict[str, Tensor]:
    return {name: _TENSORS[name] for name in names.split()}


def _check_blocks(dims: dict) -> None:
    block = dims["block"]
    need(block >= 1, f"block must be positive, got {block}")
    for rows, blocks in (("f", "fb"), ("m", "mb")):
        if is_int(dims[rows]) and is_int(dims[blocks]):
            need(dims[blocks] == -(-dims[rows] // block),
                 f"{dims[blocks]} scales along {rows} = {dims[rows]} is not one scale per {block}-block")


def _up_launch(dims: dict, *, block: int) -> KernelLaunch:
    """One program per (token-expert pair, block of expert rows)."""
    from . import triton_kernels as tk

    k, width, hidden = fixed(dims, "k", "f", "m")
    constants = tk.experts_constants(block)
    return KernelLaunch(tk.moe_experts_up_kernel, constants, grid=(dims["n"] * k, -(-width // constants["BLOCK_R"])),
                        scalars=(k, hidden, width))


def _down_launch(dims: dict, *, block: int) -> KernelLaunch:
    """One program per (token, block of output rows)."""
    from . import triton_kernels as tk

    k, hidden, width = fixed(dims, "k", "m", "f")
    constants = tk.experts_constants(block)
    return KernelLaunch(tk.moe_experts_down_kernel, constants, grid=(dims["n"], -(-hidden // constants["BLOCK_R"])),
                        scalars=(k, hidden, width))


EXPERTS_UP = OpSpec(
    "MoeExpertsUp", _tensors("x expert_ids gate_bits gate_scale up_bits up_scale"), _tensors("hidden"),
    {"block": int}, _check_blocks,
    Plugin("moe_experts_up", "one Triton kernel per (token-expert pair, block of expert rows): FP8 gate and up rows "
                             "of the chosen expert times x, SwiGLU; AOT PTX", _up_launch))
EXPERTS_DOWN = OpSpec(
    "MoeExpertsDown", _tensors("hidden expert_ids route_weights down_bits down_scale"), _tensors("y"),
    {"block": int}, _check_blocks,
    Plugin("moe_experts_down", "one Triton kernel per (token, block of hidden rows): FP8 down rows of each chosen "
                               "expert times its SwiGLU output, weighted and summed; AOT PTX", _down_launch))
# a TensorRT copy runs MoeExperts as two plugins: an AOT plugin is one kernel launch, and the down projection
# needs the whole SwiGLU output of its expert
EXPERTS = OpSpec(
    "MoeExperts",
    _tensors("x expert_ids route_weights gate_bits gate_scale up_bits up_scale down_bits down_scale"), _tensors("y"),
    {"block": int}, _check_blocks, split_into=(EXPERTS_UP, EXPERTS_DOWN))
moe_experts = EXPERTS.torch_op("moe_experts", experts_eager)


# -- ONNX: the bodies ONNX Runtime runs for the MoeExperts node and its two halves ----------------

def _dequantize(b: Body, bits: str, scale: str, index: str | None, rows: int, cols: int, block: int,
                index_rank: int = 0) -> str:
    """bits [e, rows, cols] uint8 -> float32 [*index.shape, rows, cols], or [e, rows, cols] when index is None."""
    rows_axis = 1 if index is None else index_rank
    values = b.node("Gather", b.const(E4M3_VALUES, onnx.TensorProto.FLOAT),
                    b.node("Cast", bits if index is None else b.node("Gather", bits, index, axis=0), to=onnx.TensorProto.INT32),
                    axis=0)
    scales = scale if index is None else b.node("Gather", scale, index, axis=0)
    scales = b.node("Gather", scales, b.const([r // block for r in range(rows)]), axis=rows_axis)
    scales = b.node("Gather", scales, b.const([c // block for c in range(cols)]), axis=rows_axis + 1)
    return b.node("Mul", values, scales)


def _chosen_experts_times(b: Body, bits: str, scale: str, vector: str, rows: int, cols: int, block: int) -> str:
    """W_e v for each chosen expert: bits [e, rows, cols], vector [n, 1 or k, cols] -> [n, k, rows].

    When rows fill whole blocks, the block scales multiply the small vector instead of the
    dequantised weights: W v = sum over column blocks of s[row block, col block] * (q v), computed as
    q [n, k, rows/block, block, cols] times (s expanded over columns * v) [n, k, rows/block, cols, 1].
    """
    if rows % block:
        weights = _dequantize(b, bits, scale, "expert_ids", rows, cols, block, 2)  # [n, k, rows, cols]
        return b.node("Squeeze", b.node("MatMul", weights, b.node("Unsqueeze", vector, b.const([3]))), b.const([3]))
    codes = b.node("Cast", b.node("Gather", bits, "expert_ids", axis=0), to=onnx.TensorProto.INT32)
    values = b.node("Gather", b.const(E4M3_VALUES, onnx.TensorProto.FLOAT), codes, axis=0)  # [n, k, rows, cols]
    values = b.node("Reshape", values, b.const([0, 0, rows // block, block, cols]))
    scales = b.node("Gather", b.node("Gather", scale, "expert_ids", axis=0),
                    b.const([c // block for c in range(cols)]), axis=3)  # [n, k, rows/block, cols]
    scaled_vector = b.node("Mul", scales, b.node("Unsqueeze", vector, b.const([2])))
    out = b.node("MatMul", values, b.node("Unsqueeze", scaled_vector, b.const([4])))  # [n, k, rows/block, block, 1]
    return b.node("Reshape", out, b.const([0, 0, rows]))


def _chosen_swiglu(b: Body, f: int, m: int, block: int) -> str:
    """silu(G_e x) * (U_e x) for each chosen expert: -> [n, k, f]."""
    x_rows = b.node("Unsqueeze", "x", b.const([1]))  # [n, 1, m]
    gate = _chosen_experts_times(b, "gate_bits", "gate_scale", x_rows, f, m, block)  # [n, k, f]
    up = _chosen_experts_times(b, "up_bits", "up_scale", x_rows, f, m, block)
    return b.node("Mul", b.node("Mul", gate, b.node("Sigmoid", gate)), up)


def _chosen_down(b: Body, hidden: str, f: int, m: int, block: int) -> str:
    """sum over slots of route weight * D_e hidden: hidden [n, k, f] -> [n, m]."""
    down = _chosen_experts_times(b, "down_bits", "down_scale", hidden, m, f, block)  # [n, k, m]
    weighted = b.node("Mul", down, b.node("Unsqueeze", "route_weights", b.const([2])))
    return b.node("ReduceSum", weighted, b.const([1]), keepdims=0)


def _gathered_branch(f: int, m: int, block: int) -> onnx.GraphProto:
    """Decode: only the k chosen experts' weights are read and decoded."""
    b = Body("gathered")
    y = _chosen_down(b, _chosen_swiglu(b, f, m, block), f, m, block)
    return onnx.helper.make_graph(b.nodes, "gathered", [], [_float_output(y)])


def _one_expert_step(f: int, m: int, block: int) -> onnx.GraphProto:
    """Loop body: expert `expert` over the tokens routed to it, added into `total` [n, m]."""
    b = Body("step")
    hit = b.node("Equal", "expert_ids", "expert")  # [n, k]
    weight = b.node("ReduceSum", b.node("Where", hit, "route_weights", b.const(0.0, onnx.TensorProto.FLOAT)),
                    b.const([1]), keepdims=0)  # [n]
    routed = b.node("ReduceMax", b.node("Cast", hit, to=onnx.TensorProto.INT32), b.const([1]), keepdims=0)
    tokens = b.node("Squeeze", b.node("NonZero", routed), b.const([0]))  # [n_e]
    chosen = b.node("Gather", "x", tokens, axis=0)  # [n_e, m]
    gate = b.node("MatMul", chosen, b.node("Transpose", _dequantize(b, "gate_bits", "gate_scale", "expert", f, m, block)))
    up = b.node("MatMul", chosen, b.node("Transpose", _dequantize(b, "up_bits", "up_scale", "expert", f, m, block)))
    hidden = b.node("Mul", b.node("Mul", gate, b.node("Sigmoid", gate)), up)  # [n_e, f]
    out = b.node("MatMul", hidden, b.node("Transpose", _dequantize(b, "down_bits", "down_scale", "expert", m, f, block)))
    out = b.node("Mul", out, b.node("Unsqueeze", b.node("Gather", weight, tokens, axis=0), b.const([1])))
    b.rename(b.node("ScatterND", "total", b.node("Unsqueeze", tokens, b.const([1])), out, reduction="add"), "total_out")
    b.rename("keep_going", "keep_going_out")
    scalar = lambda name, dtype: onnx.helper.make_tensor_value_info(name, dtype, [])  # noqa: E731
    return onnx.helper.make_graph(
        b.nodes, "one_expert",
        [scalar("expert", onnx.TensorProto.INT64), scalar("keep_going", onnx.TensorProto.BOOL), _float_output("total")],
        [scalar("keep_going_out", onnx.TensorProto.BOOL), _float_output("total_out")])


def _per_expert_branch(e: int, f: int, m: int, block: int) -> onnx.GraphProto:
    """Prefill: a loop over the experts, each run once on the tokens routed to it; one expert's
    weights are dequantised at a time, so memory stays at one expert whatever e is."""
    b = Body("loop")
    zeros = b.node("ConstantOfShape", b.node("Shape", "x"),
                   value=onnx.helper.make_tensor("value", onnx.TensorProto.FLOAT, [1], [0.0]))
    y = b.node("Loop", b.const(e), "", zeros, body=_one_expert_step(f, m, block))
    return onnx.helper.make_graph(b.nodes, "per_expert", [], [_float_output(y)])


def _float_output(name: str) -> onnx.ValueInfoProto:
    return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, ["n", "m"])


def moe_experts_function(n_experts: int, expert_width: int, hidden: int, block: int) -> onnx.FunctionProto:
    b = Body("experts")
    pairs = b.node("Size", "expert_ids")  # n * k
    per_expert = b.node("Greater", pairs, b.const(n_experts))
    y = b.node("If", per_expert, then_branch=_per_expert_branch(n_experts, expert_width, hidden, block),
               else_branch=_gathered_branch(expert_width, hidden, block))
    b.rename(y, "y")
    return EXPERTS.function(b)


def moe_experts_up_function(expert_width: int, hidden: int, block: int) -> onnx.FunctionProto:
    """MoeExpertsUp's body (the TensorRT copy's first half of MoeExperts), for running that copy elsewhere."""
    b = Body("experts_up")
    b.rename(_chosen_swiglu(b, expert_width, hidden, block), "hidden")
    return EXPERTS_UP.function(b)


def moe_experts_down_function(expert_width: int, hidden: int, block: int) -> onnx.FunctionProto:
    """MoeExpertsDown's body (the second half)."""
    b = Body("experts_down")
    b.rename(_chosen_down(b, "hidden", expert_width, hidden, block), "y")
    return EXPERTS_DOWN.function(b)
