"""MoE routing: sigmoid scores, choice on score + correction bias, weights from the scores.

The eager code, the op's declaration `ROUTE` (its torch op, ONNX node and TensorRT plugin with
its AOT kernel launch), and the ONNX body. Ties in the choice go to the lower expert id (ONNX
TopK's rule), so every face of the op picks the same experts for the same input.
"""

from __future__ import annotations

import onnx
import torch

from .onnx_domain import Body
from .op_spec import FLOAT, INT64, KernelLaunch, OpSpec, Plugin, fixed, is_int, need, tensor


def top_k_lowest_id_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim, ties broken towards the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
          n_group: int, topk_group: int, normalise: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, m], router_weight [e, m], correction_bias [e] -> route_weights [n, k] float32, expert_ids [n, k] int64."""
    scores = torch.sigmoid(x.float() @ router_weight.float().T)  # [n, e]
    choice = scores + correction_bias
    if n_group > 1:
        grouped = choice.view(x.shape[0], n_group, -1)  # [n, groups, e / groups]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [n, groups]
        kept = torch.zeros_like(group_scores).scatter(1, top_k_lowest_id_first(group_scores, topk_group), 1.0)
        choice = grouped.masked_fill(kept[..., None] == 0, float("-inf")).flatten(1)
    expert_ids = top_k_lowest_id_first(choice, top_k)
    route_weights = scores.gather(1, expert_ids)
    if normalise:
        route_weights = route_weights / (route_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return route_weights * scaling, expert_ids


# -- the op: one declaration, from which its torch op, ONNX node and TensorRT plugin come -------

def _check_routing(dims: dict) -> None:
    top_k, n_group, topk_group, experts = dims["top_k"], dims["n_group"], dims["topk_group"], dims["e"]
    need(top_k >= 1, f"top_k must be at least 1, got {top_k}")
    need(n_group >= 1 and 1 <= topk_group <= n_group, f"bad groups: n_group {n_group}, topk_group {topk_group}")
    if is_int(experts):
        need(experts % n_group == 0, f"n_group {n_group} does not divide the {experts} experts")
        need(top_k <= topk_group * (experts // n_group), f"top_k {top_k} exceeds the experts of {topk_group} group(s)")


def _route_launch(dims: dict, *, top_k: int, n_group: int, topk_group: int, normalise: bool,
                  scaling: float) -> KernelLaunch:
    """One program per token."""
    from . import triton_kernels as tk

    n = dims["n"]
    experts, hidden = fixed(dims, "e", "m")
    return KernelLaunch(tk.moe_route_kernel, tk.route_constants(experts, hidden, top_k, n_group, topk_group,
                                                                normalise, scaling),
                        grid=(n,), scalars=(n, hidden, experts))


ROUTE = OpSpec(
    "MoeRoute",
    inputs={"x": tensor("n m", FLOAT), "router_weight": tensor("e m", FLOAT), "correction_bias": tensor("e", FLOAT)},
    outputs={"route_weights": tensor("n top_k", FLOAT), "expert_ids": tensor("n top_k", INT64)},
    attributes={"top_k": int, "n_group": int, "topk_group": int, "normalise": bool, "scaling": float},
    check=_check_routing,
    plugin=Plugin("moe_route", "one Triton kernel per token (scores, sigmoid, bias, group limit, top-k, normalise, "
                               "scale); AOT PTX", _route_launch))
moe_route = ROUTE.torch_op("moe_route", route)


# -- ONNX: the body ONNX Runtime runs for the MoeRoute node ----------------------------------

def moe_route_function(top_k: int, n_group: int, topk_group: int, normalise: bool, scaling: float) -> onnx.FunctionProto:
    """The body for one model's routing settings (they also travel as the node's attributes)."""
    b = Body("route")
    scores = b.node("Sigmoid", b.node("MatMul", "x", b.node("Transpose", "router_weight", perm=[1, 0])))  # [n, e]
    choice = b.node("Add", scores, "correction_bias")
    if n_group > 1:
        grouped = b.node("Reshape", choice, b.const([0, n_group, -1]))  # [n, groups, e / groups]
        best_two, _ = b.node("TopK", grouped, b.const([2]), axis=-1, outputs=2)
        group_scores = b.node("ReduceSum", best_two, b.const([-1]), keepdims=0)  # [n, groups]
        _, kept_groups = b.node("TopK", group_scores, b.const([topk_group]), axis=-1, outputs=2)
        zeros = b.node("ConstantOfShape", b.node("Shape", group_scores), value=_float_tensor(0.0))
        ones = b.node("ConstantOfShape", b.node("Shape", kept_groups), value=_float_tensor(1.0))
        kept = b.node("ScatterElements", zeros, kept_groups, ones, axis=1)
        dropped = b.node("Equal", b.node("Unsqueeze", kept, b.const([-1])), b.const(0.0, onnx.TensorProto.FLOAT))
        masked = b.node("Where", dropped, b.const(float("-inf"), onnx.TensorProto.FLOAT), grouped)
        choice = b.node("Reshape", masked, b.const([0, -1]))
    _, expert_ids = b.node("TopK", choice, b.const([top_k]), axis=-1, largest=1, sorted=1, outputs=2)
    weights = b.node("GatherElements", scores, expert_ids, axis=1)
    if normalise:
        total = b.node("Add", b.node("ReduceSum", weights, b.const([-1]), keepdims=1), b.const(1e-20, onnx.TensorProto.FLOAT))
        weights = b.node("Div", weights, total)
    b.rename(b.node("Mul", weights, b.const(scaling, onnx.TensorProto.FLOAT)), "route_weights")
    b.rename(expert_ids, "expert_ids")
    return ROUTE.function(b)


def _float_tensor(value: float) -> onnx.TensorProto:
    return onnx.helper.make_tensor("value", onnx.TensorProto.FLOAT, [1], [value])
