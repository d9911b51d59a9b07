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
    """The einsums of `mla_attention_eager` as batched MatMuls over the latent in place: the keys side
    through com.microsoft FusedMatMul with transB, so the [b, t, c] latent is never transposed or copied."""
    b = Body("mla")
    query = _Query(b, heads, nope_dim, v_dim)
    scores = b.node("Add", _times_transposed(b, query.latent, "latent"), _times_transposed(b, query.pe, "rope"))
    probs = query.softmax(scores, softmax_scale, "mask")  # [b, s*h, t]
    b.rename(query.output(b.node("MatMul", probs, "latent")), "out")
    return ATTENTION.function(b, extra_opsets=[ORT_OPSET])


class _Query:
    """The absorbed query: q_nope through W_UK to the latent, both parts as [b, s*h, .] rows."""

    def __init__(self, b: Body, heads: int, nope_dim: int, v_dim: int):
        self.b, self.heads, self.nope_dim, self.v_dim = b, heads, nope_dim, v_dim
        w_kv = self.w_kv = b.node("Reshape", "kv_b_weight", b.const([heads, nope_dim + v_dim, -1]))  # [h, d + v, c]
        w_uk = b.node("Slice", w_kv, b.const([0]), b.const([nope_dim]), b.const([1]))  # [h, d, c]
        self.batch, self.seq = b.node("Shape", "q_nope", start=0, end=1), b.node("Shape", "q_nope", start=1, end=2)
        self.rows = b.node("Mul", self.batch, self.seq)
        heads_first = b.node("Transpose", b.node("Reshape", "q_nope", b.node("Concat", self.rows, b.const([heads, -1]),
                                                                              axis=0)), perm=[1, 0, 2])  # [h, b*s, d]
        q_latent = b.node("Transpose", b.node("MatMul", heads_first, w_uk), perm=[1, 0, 2])  # [b*s, h, c]
        self.latent = b.node("Reshape", q_latent, self._batch_rows(q_latent, 2))  # [b, s*h, c]
        self.pe = b.node("Reshape", "q_pe", self._batch_rows("q_pe", 3))  # [b, s*h, r]

    def _batch_rows(self, tensor: str, last_axis: int) -> str:
        b = self.b
        return b.node("Concat", self.batch, b.const([-1]), b.node("Shape", tensor, start=last_axis), axis=0)

    def softmax(self, scores: str, softmax_scale: float, mask: str) -> str:
        """scores [b, s*h, t] -> masked softmax [b, s*h, t]; mask [b, s, t] (True: may attend)."""
        b = self.b
        scaled = b.node("Mul", scores, b.const(softmax_scale, onnx.TensorProto.FLOAT))
        per_head = b.node("Reshape", scaled, b.node("Concat", self.batch, self.seq, b.const([self.heads, -1]), axis=0))
        allowed = b.node("Unsqueeze", mask, b.const([2]))  # [b, s, 1, t]
        masked = b.node("Where", allowed, per_head, b.const(float("-inf"), onnx.TensorProto.FLOAT))
        return b.node("Reshape", b.node("Softmax", masked, axis=-1), b.node("Shape", scores))

    def output(self, out_latent: str) -> str:
        """out_latent [b, s*h, c] through W_UV -> [b, s, h, v]."""
        b = self.b
        w_uv = b.node("Transpose", b.node("Slice", self.w_kv, b.const([self.nope_dim]),
                                          b.const([self.nope_dim + self.v_dim]), b.const([1])), perm=[0, 2, 1])  # [h, c, v]
        heads_first = b.node("Transpose", b.node("Reshape", out_latent, b.node("Concat", self.rows,
                                                                                b.const([self.heads, -1]), axis=0)),
                             perm=[1, 0, 2])  # [h, b*s, c]
        out = b.node("Transpose", b.node("MatMul", heads_first, w_uv), perm=[1, 0, 2])  # [b*s, h, v]
        return b.node("Reshape", out, b.node("Concat", self.batch, self.seq, b.const([self.heads, self.v_dim]), axis=0))


ORT_OPSET = onnx.helper.make_opsetid("com.microsoft", 1)


def _times_transposed(b: Body, rows: str, keys: str) -> str:
    """rows [b, n, k] times keys [b, t, k] transposed -> [b, n, t], reading keys in place."""
    return b.node("FusedMatMul", rows, keys, transB=1, alpha=1.0, domain="com.microsoft")


# -- over an int8 cache read in place (the cpu target) ------------------------------------------------

def mla_attention_int8_cache_eager(q_nope, q_pe, past_codes, past_scale, past_rope, new_latent, new_rope, kv_b_weight,
                                   mask, nope_dim: int, v_dim: int, softmax_scale: float) -> torch.Tensor:
    """past_codes [t, b, c] int8 with one scale per token past_scale [t, b, 1], past_rope [t, b, r] float16 (the
    cache, time-major), new_latent [b, s, c], new_rope [b, s, r], mask [b, s, t + s] -> [b, s, h, v]."""
    past = (past_codes.float() * past_scale).transpose(0, 1)
    latent = torch.cat([past, new_latent], dim=1)
    rope = torch.cat([past_rope.float().transpose(0, 1), new_rope], dim=1)
    return mla_attention_eager(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim, v_dim, softmax_scale)


@torch.library.custom_op("k2deploy::mla_attention_int8_cache", mutates_args=())
def mla_attention_int8_cache(q_nope: torch.Tensor, q_pe: torch.Tensor, past_codes: torch.Tensor, past_scale: torch.Tensor,
                             past_rope: torch.Tensor, new_latent: torch.Tensor, new_rope: torch.Tensor,
                             kv_b_weight: torch.Tensor, mask: torch.Tensor, nope_dim: int, v_dim: int,
                             softmax_scale: float) -> torch.Tensor:
    return mla_attention_int8_cache_eager(q_nope, q_pe, past_codes, past_scale, past_rope, new_latent, new_rope,
                                          kv_b_weight, mask, nope_dim, v_dim, softmax_scale)


@mla_attention_int8_cache.register_fake
def _(q_nope, q_pe, past_codes, past_scale, past_rope, new_latent, new_rope, kv_b_weight, mask, nope_dim, v_dim,
      softmax_scale):
    b, s, h, _ = q_nope.shape
    return q_nope.new_empty((b, s, h, v_dim), dtype=torch.float32)


ATTENTION_INT8_CACHE = FunctionSpec(
    "MlaAttentionInt8Cache",
    ["q_nope", "q_pe", "past_codes", "past_scale", "past_rope", "new_latent", "new_rope", "kv_b_weight", "mask"],
    ["out"], ["nope_dim", "v_dim", "softmax_scale"])
_attention_int8_cache_node = custom_node(ATTENTION_INT8_CACHE.name, ATTENTION_INT8_CACHE.inputs,
                                         ATTENTION_INT8_CACHE.outputs,
                                         {"nope_dim": int, "v_dim": int, "softmax_scale": float})


def mla_attention_int8_cache_onnx(q_nope, q_pe, past_codes, past_scale, past_rope, new_latent, new_rope, kv_b_weight,
                                  mask, nope_dim: int, v_dim: int, softmax_scale: float):
    return _attention_int8_cache_node(q_nope, q_pe, past_codes, past_scale, past_rope, new_latent, new_rope,
                                      kv_b_weight, mask, nope_dim=nope_dim, v_dim=v_dim, softmax_scale=softmax_scale)


def mla_attention_int8_cache_function(heads: int, nope_dim: int, v_dim: int, softmax_scale: float) -> onnx.FunctionProto:
    """Scores and values over the cached codes as they are: each code widened once, the per-token scale applied to
    the [b, s*h, t] scores and probabilities (not to the cache), the new entries taken apart (no concatenation)."""
    b = Body("mla8")
    query = _Query(b, heads, nope_dim, v_dim)
    batch_major = lambda name: b.node("Transpose", name, perm=[1, 0, 2])  # noqa: E731  [t, b, .] -> [b, t, .]
    past = b.node("Cast", batch_major("past_codes"), to=onnx.TensorProto.FLOAT)  # [b, t, c]
    scale = b.node("Transpose", "past_scale", perm=[1, 2, 0])  # [b, 1, t]
    past_rope = b.node("Cast", batch_major("past_rope"), to=onnx.TensorProto.FLOAT)  # [b, t, r]
    past_scores = b.node("Add", b.node("Mul", _times_transposed(b, query.latent, past), scale),
                         _times_transposed(b, query.pe, past_rope))  # [b, s*h, t]
    new_scores = b.node("Add", _times_transposed(b, query.latent, "new_latent"),
                        _times_transposed(b, query.pe, "new_rope"))  # [b, s*h, s]
    probs = query.softmax(b.node("Concat", past_scores, new_scores, axis=-1), softmax_scale, "mask")
    t = b.node("Shape", "past_codes", start=0, end=1)
    past_probs = b.node("Mul", b.node("Slice", probs, b.const([0]), t, b.const([2])), scale)
    new_probs = b.node("Slice", probs, t, b.const([1 << 62]), b.const([2]))
    out_latent = b.node("Add", b.node("MatMul", past_probs, past), b.node("MatMul", new_probs, "new_latent"))
    b.rename(query.output(out_latent), "out")
    return ATTENTION_INT8_CACHE.function(b, extra_opsets=[ORT_OPSET])
