"""MoE routing, eager: sigmoid scores, choice on score + correction bias, weights from the scores.

Ties in the choice go to the lower expert id (ONNX TopK's rule), so every face of the op
picks the same experts for the same input.
"""

from __future__ import annotations

import torch


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
