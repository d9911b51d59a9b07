"""MoE routing, eager: sigmoid scores, choice on score + correction bias, weights from the scores.

Ties in the choice go to the lower expert id (ONNX TopK's rule), so every face of the op
picks the same experts for the same input.
"""

from __future__ import annotations

import onnx
import torch

from .onnx_domain import Body, FunctionSpec, custom_node


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


# -- torch op: what torch.export sees ------------------------------------------------------

@torch.library.custom_op("k2deploy::moe_route", mutates_args=())
def moe_route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
              n_group: int, topk_group: int, normalise: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    return route(x, router_weight, correction_bias, top_k, n_group, topk_group, normalise, scaling)


@moe_route.register_fake
def _(x, router_weight, correction_bias, top_k, n_group, topk_group, normalise, scaling):
    n = x.shape[0]
    return x.new_empty((n, top_k), dtype=torch.float32), x.new_empty((n, top_k), dtype=torch.int64)


# -- ONNX: one MoeRoute node, and the body ONNX Runtime runs for it --------------------------

ROUTE = FunctionSpec("MoeRoute", ["x", "router_weight", "correction_bias"], ["route_weights", "expert_ids"],
                     ["top_k", "n_group", "topk_group", "normalise", "scaling"])
_route_node = custom_node(ROUTE.name, ROUTE.inputs, ROUTE.outputs,
                          {"top_k": int, "n_group": int, "topk_group": int, "normalise": int, "scaling": float})


def moe_route_onnx(x, router_weight, correction_bias, top_k: int, n_group: int, topk_group: int,
                   normalise: bool, scaling: float):
    route_weights, expert_ids = _route_node(x, router_weight, correction_bias, top_k=top_k, n_group=n_group,
                                            topk_group=topk_group, normalise=int(normalise), scaling=scaling)
    return route_weights, expert_ids


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
