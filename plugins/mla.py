"""Absorbed MLA attention over the latent cache.

W_UK is folded into the query and W_UV into the output, so scores and values are taken
directly over the cached latent c_kv [t, c] and rope keys k_pe [t, r]: no per-head key or
value is ever materialised. Shapes: b batch, s new positions, t key positions, h heads,
d nope / value head dim, c latent, r rope.
"""

from __future__ import annotations

import onnx
import torch

from .onnx_domain import Body, FunctionSpec, custom_node


def mla_attention_eager(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim: int, v_dim: int,
                        softmax_scale: float) -> torch.Tensor:
    """q_nope [b, s, h, d], q_pe [b, s, h, r], latent [b, t, c], rope [b, t, r], kv_b_weight [h * (d + v), c],
    mask [b, s, t] (True: may attend) -> [b, s, h, v]."""
    heads = q_nope.shape[2]
    w_kv = kv_b_weight.view(heads, nope_dim + v_dim, -1)
    w_uk, w_uv = w_kv[:, :nope_dim], w_kv[:, nope_dim:]  # [h, d, c], [h, v, c]
    q_latent = torch.einsum("bshd,hdc->bshc", q_nope, w_uk)
    scores = torch.einsum("bshc,btc->bsht", q_latent, latent) + torch.einsum("bshr,btr->bsht", q_pe, rope)
    scores = (scores * softmax_scale).masked_fill(~mask[:, :, None, :], float("-inf"))
    out_latent = torch.einsum("bsht,btc->bshc", scores.softmax(dim=-1), latent)
    return torch.einsum("bshc,hdc->bshd", out_latent, w_uv)


@torch.library.custom_op("k2deploy::mla_attention", mutates_args=())
def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                  kv_b_weight: torch.Tensor, mask: torch.Tensor, nope_dim: int, v_dim: int,
                  softmax_scale: float) -> torch.Tensor:
    return mla_attention_eager(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim, v_dim, softmax_scale)


@mla_attention.register_fake
def _(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim, v_dim, softmax_scale):
    b, s, h, _ = q_nope.shape
    return q_nope.new_empty((b, s, h, v_dim), dtype=torch.float32)


# -- ONNX -----------------------------------------------------------------------------------

ATTENTION = FunctionSpec("MlaAttention", ["q_nope", "q_pe", "latent", "rope", "kv_b_weight", "mask"], ["out"],
                         ["nope_dim", "v_dim", "softmax_scale"])
_attention_node = custom_node(ATTENTION.name, ATTENTION.inputs, ATTENTION.outputs,
                              {"nope_dim": int, "v_dim": int, "softmax_scale": float})


def mla_attention_onnx(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim: int, v_dim: int, softmax_scale: float):
    return _attention_node(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim=nope_dim, v_dim=v_dim,
                           softmax_scale=softmax_scale)


def mla_attention_function(heads: int, nope_dim: int, v_dim: int, softmax_scale: float) -> onnx.FunctionProto:
    b = Body("mla")
    w_kv = b.node("Reshape", "kv_b_weight", b.const([heads, nope_dim + v_dim, -1]))
    w_uk = b.node("Slice", w_kv, b.const([0]), b.const([nope_dim]), b.const([1]))
    w_uv = b.node("Slice", w_kv, b.const([nope_dim]), b.const([nope_dim + v_dim]), b.const([1]))
    q_latent = b.node("Einsum", "q_nope", w_uk, equation="bshd,hdc->bshc")
    scores = b.node("Add", b.node("Einsum", q_latent, "latent", equation="bshc,btc->bsht"),
                    b.node("Einsum", "q_pe", "rope", equation="bshr,btr->bsht"))
    scores = b.node("Mul", scores, b.const(softmax_scale, onnx.TensorProto.FLOAT))
    allowed = b.node("Unsqueeze", "mask", b.const([2]))  # [b, s, 1, t]
    scores = b.node("Where", allowed, scores, b.const(float("-inf"), onnx.TensorProto.FLOAT))
    out_latent = b.node("Einsum", b.node("Softmax", scores, axis=-1), "latent", equation="bsht,btc->bshc")
    b.rename(b.node("Einsum", out_latent, w_uv, equation="bshc,hdc->bshd"), "out")
    return ATTENTION.function(b)
