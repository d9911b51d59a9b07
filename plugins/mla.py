"""Absorbed MLA attention over the latent cache.

W_UK is folded into the query and W_UV into the output, so scores and values are taken
directly over the cached latent c_kv [t, c] and rope keys k_pe [t, r]: no per-head key or
value is ever materialised. Shapes: b batch, s new positions, t key positions, h heads,
d nope / value head dim, c latent, r rope.
"""

from __future__ import annotations

import onnx
import torch

from ..core.cache_format import INT8_ZERO_POINT
from .onnx_domain import Body
from .op_spec import BOOL, FLOAT, FLOAT16, UINT8, KernelLaunch, OpSpec, Plugin, fixed, is_int, need, tensor


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


# -- the op: one declaration, from which its torch op, ONNX node and TensorRT plugin come -------

def _check_attention(dims: dict) -> None:
    """kv_b_weight stacks each head's W_UK and W_UV rows: [h * (d + v), c]."""
    h, rows, nope_dim, v_dim = dims["h"], dims["hdv"], dims["nope_dim"], dims["v_dim"]
    if is_int(h) and is_int(rows):
        need(rows == h * (nope_dim + v_dim), f"kv_b_weight has {rows} rows, expected heads * (nope_dim + v_dim) = "
                                             f"{h} * ({nope_dim} + {v_dim})")
    need(dims["softmax_scale"] > 0, f"softmax_scale must be positive, got {dims['softmax_scale']}")


def _attention_launch(dims: dict, *, nope_dim: int, v_dim: int, softmax_scale: float) -> KernelLaunch:
    """One program per (row and new position, block of heads); latent [b, t, c] and rope [b, t, r] contiguous,
    so their strides are (t * c, c) and (t * r, r)."""
    from . import triton_kernels as tk

    seq, keys = dims["s"], dims["t"]
    heads, latent_dim, rope_dim = fixed(dims, "h", "c", "r")
    constants = tk.mla_constants(nope_dim, v_dim, latent_dim, rope_dim, softmax_scale)
    return KernelLaunch(tk.mla_attention_kernel, constants, grid=(dims["b"] * seq, -(-heads // constants["BLOCK_H"])),
                        scalars=(seq, keys, heads, keys * latent_dim, latent_dim, keys * rope_dim, rope_dim),
                        options={"num_stages": tk.MLA_STAGES})


_QUERY = {"q_nope": tensor("b s h nope_dim", FLOAT), "q_pe": tensor("b s h r", FLOAT)}
_ATTENTION_ATTRIBUTES = {"nope_dim": int, "v_dim": int, "softmax_scale": float}
_OUT = {"out": tensor("b s h v_dim", FLOAT)}
ATTENTION = OpSpec(
    "MlaAttention",
    {**_QUERY, "latent": tensor("b t c", FLOAT), "rope": tensor("b t r", FLOAT), "kv_b_weight": tensor("hdv c", FLOAT),
     "mask": tensor("b s t", BOOL)},
    _OUT, _ATTENTION_ATTRIBUTES, _check_attention,
    Plugin("mla_attention", "one Triton kernel per (row, position, head block): absorbed attention over the latent "
                            "with an online softmax; AOT PTX", _attention_launch))
mla_attention = ATTENTION.torch_op("mla_attention", mla_attention_eager)


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
    """The absorbed query: q_nope through W_UK to the latent, both parts as [b, s*h, .] rows; and the output
    back through W_UV. Here W_UK and W_UV are float32 slices of kv_b_weight; `_Int8Query` multiplies int8 ones."""

    def __init__(self, b: Body, heads: int, nope_dim: int, v_dim: int):
        self.b, self.heads, self.nope_dim, self.v_dim = b, heads, nope_dim, v_dim
        self.batch, self.seq = b.node("Shape", "q_nope", start=0, end=1), b.node("Shape", "q_nope", start=1, end=2)
        self.rows = b.node("Mul", self.batch, self.seq)
        q_latent = b.node("Transpose", self.to_latent(self._heads_first("q_nope")), perm=[1, 0, 2])  # [b*s, h, c]
        self.latent = b.node("Reshape", q_latent, self._batch_rows(q_latent, 2))  # [b, s*h, c]
        self.pe = b.node("Reshape", "q_pe", self._batch_rows("q_pe", 3))  # [b, s*h, r]

    def to_latent(self, q_nope: str) -> str:
        """[h, b*s, d] through W_UK [h, d, c] -> [h, b*s, c]."""
        return self.b.node("MatMul", q_nope, self._w_kv_part(0, self.nope_dim))

    def from_latent(self, out_latent: str) -> str:
        """[h, b*s, c] through W_UV^T [h, c, v] -> [h, b*s, v]."""
        w_uv = self._w_kv_part(self.nope_dim, self.nope_dim + self.v_dim)
        return self.b.node("MatMul", out_latent, self.b.node("Transpose", w_uv, perm=[0, 2, 1]))

    def _w_kv_part(self, start: int, stop: int) -> str:
        b = self.b
        w_kv = b.node("Reshape", "kv_b_weight", b.const([self.heads, self.nope_dim + self.v_dim, -1]))  # [h, d + v, c]
        return b.node("Slice", w_kv, b.const([start]), b.const([stop]), b.const([1]))

    def _heads_first(self, tensor: str) -> str:
        """[b, s, h, .] or [b, s*h, .] -> [h, b*s, .]"""
        b = self.b
        rows = b.node("Reshape", tensor, b.node("Concat", self.rows, b.const([self.heads, -1]), axis=0))
        return b.node("Transpose", rows, perm=[1, 0, 2])

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
        out = b.node("Transpose", self.from_latent(self._heads_first(out_latent)), perm=[1, 0, 2])  # [b*s, h, v]
        return b.node("Reshape", out, b.node("Concat", self.batch, self.seq, b.const([self.heads, self.v_dim]), axis=0))


class _Int8Query(_Query):
    """W_UK and W_UV as int8 per output column, stored as bytes code + 128 (w_uk_codes [h, d, c] with w_uk_scale
    [h, 1, c]; w_uv_codes [h, c, v] with w_uv_scale [h, 1, v]); the rows they multiply are quantised per row on
    the fly to the same kind of bytes."""

    def to_latent(self, q_nope: str) -> str:
        return self._times_int8(q_nope, "w_uk_codes", "w_uk_scale")

    def from_latent(self, out_latent: str) -> str:
        return self._times_int8(out_latent, "w_uv_codes", "w_uv_scale")

    def _times_int8(self, rows: str, codes: str, scale: str) -> str:
        b = self.b
        row_codes, row_scale = _quantized_rows(b, rows, 127.0, onnx.TensorProto.UINT8, offset=CODE_ZERO)
        zero = b.const(CODE_ZERO, onnx.TensorProto.UINT8)
        product = b.node("MatMulInteger", row_codes, codes, zero, zero)
        return b.node("Mul", b.node("Mul", b.node("Cast", product, to=onnx.TensorProto.FLOAT), row_scale), scale)


ORT_OPSET = onnx.helper.make_opsetid("com.microsoft", 1)


def _times_transposed(b: Body, rows: str, keys: str) -> str:
    """rows [b, n, k] times keys [b, t, k] transposed -> [b, n, t], reading keys in place."""
    return b.node("FusedMatMul", rows, keys, transB=1, alpha=1.0, domain="com.microsoft")


# -- over an int8 cache read in place (the cpu target) ----------------------------------------------

# the int8 cache, W_UK and W_UV store code q in [-127, 127] as the byte q + CODE_ZERO (128), and the rows they
# meet are quantised to such bytes too: every integer product is uint8 x uint8. ONNX Runtime's uint8 x int8
# product sums byte pairs in 16 bits on x86 CPUs without VNNI (AVX2, AVX-512 before VNNI) and saturates there
# (255 x 127 x 2 > 32767: measured off by up to 67,891 in a 512-long sum); uint8 x uint8 is exact on every CPU.
CODE_ZERO = INT8_ZERO_POINT


def absorbed_int8(kv_b_weight: torch.Tensor, heads: int, nope_dim: int, v_dim: int) -> tuple:
    """kv_b_weight [h * (d + v), c] float -> W_UK as int8 codes [h, d, c] with scales [h, 1, c] and W_UV^T as int8
    codes [h, c, v] with scales [h, 1, v]: symmetric, absmax / 127 over the dimension each product sums; each code
    stored as the uint8 byte code + CODE_ZERO."""
    w_kv = kv_b_weight.float().view(heads, nope_dim + v_dim, -1)
    parts = []
    for weight in (w_kv[:, :nope_dim], w_kv[:, nope_dim:].transpose(1, 2)):
        scale = (weight.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-30)
        parts += [((weight / scale).round().clamp(-127, 127) + CODE_ZERO).to(torch.uint8), scale]
    return tuple(parts)


def mla_attention_int8_cache_eager(q_nope, q_pe, past_codes, past_scale, past_rope, new_codes, new_scale, new_rope,
                                   w_uk_codes, w_uk_scale, w_uv_codes, w_uv_scale, mask, nope_dim: int, v_dim: int,
                                   softmax_scale: float) -> torch.Tensor:
    """past_codes [t, b, c] uint8 (code + 128) with one scale per token past_scale [t, b, 1], past_rope [t, b, r]
    float16 (the cache, time-major); the chunk's own entries as stored, batch-major: new_codes [b, s, c] uint8,
    new_scale [b, s, 1], new_rope [b, s, r] float16; W_UK and W_UV^T as their uint8 bytes (see absorbed_int8), mask
    [b, s, t + s] -> [b, s, h, v]. The new entries are read back exactly as the past is (the chunk's own entries
    are attended as stored)."""
    codes = torch.cat([past_codes.transpose(0, 1), new_codes], dim=1)  # [b, t + s, c]
    scale = torch.cat([past_scale.transpose(0, 1), new_scale], dim=1)  # [b, t + s, 1]
    latent = (codes.float() - CODE_ZERO) * scale
    rope = torch.cat([past_rope.transpose(0, 1), new_rope], dim=1).float()
    w_uk = (w_uk_codes.float() - CODE_ZERO) * w_uk_scale  # [h, d, c]
    w_uv = ((w_uv_codes.float() - CODE_ZERO) * w_uv_scale).transpose(1, 2)  # [h, v, c]
    kv_b_weight = torch.cat([w_uk, w_uv], dim=1).reshape(-1, w_uk.shape[-1])
    return mla_attention_eager(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim, v_dim, softmax_scale)


def _check_int8_cache_attention(dims: dict) -> None:
    """The mask covers the past and the new positions: [b, s, t + s]."""
    t, s, keys = dims["t"], dims["s"], dims["keys"]
    if is_int(t) and is_int(s) and is_int(keys):
        need(keys == t + s, f"the mask covers {keys} key positions, not past + new = {t} + {s}")
    need(dims["softmax_scale"] > 0, f"softmax_scale must be positive, got {dims['softmax_scale']}")


ATTENTION_INT8_CACHE = OpSpec(
    "MlaAttentionInt8Cache",
    {**_QUERY, "past_codes": tensor("t b c", UINT8), "past_scale": tensor("t b 1", FLOAT),
     "past_rope": tensor("t b r", FLOAT16), "new_codes": tensor("b s c", UINT8), "new_scale": tensor("b s 1", FLOAT),
     "new_rope": tensor("b s r", FLOAT16),
     "w_uk_codes": tensor("h nope_dim c", UINT8), "w_uk_scale": tensor("h 1 c", FLOAT),
     "w_uv_codes": tensor("h c v_dim", UINT8), "w_uv_scale": tensor("h 1 v_dim", FLOAT),
     "mask": tensor("b s keys", BOOL)},
    _OUT, _ATTENTION_ATTRIBUTES, _check_int8_cache_attention)
mla_attention_int8_cache = ATTENTION_INT8_CACHE.torch_op("mla_attention_int8_cache", mla_attention_int8_cache_eager)


def mla_attention_int8_cache_function(heads: int, nope_dim: int, v_dim: int, softmax_scale: float) -> onnx.FunctionProto:
    """Scores and values over the cached codes as they are, in integer arithmetic: the absorbed queries and the
    probabilities are quantised per row (as bytes code + 128 and as uint8), multiplied with the uint8 codes by
    MatMulInteger, and the per-row and per-token scales are applied to the small [b, s*h, t + s] results. The
    chunk's own entries are attended as stored: their codes, scales and float16 rope go through the same products
    as the past's. They are multiplied apart (the past is never widened, rescaled or copied) and the int32
    products added: integer sums are exact, so this is the product over the joined codes, and a position scores
    the same whether it is in the chunk or in the cache. Only the rope part is float32. W_UK and W_UV are int8
    too, so that every weight and cached byte is read as one byte."""
    b = Body("mla8")
    query = _Int8Query(b, heads, nope_dim, v_dim)
    zero = b.const(CODE_ZERO, onnx.TensorProto.UINT8)
    past_codes = b.node("Transpose", "past_codes", perm=[1, 0, 2])  # [b, t, c] uint8, batch-major
    scale = b.node("Concat", b.node("Transpose", "past_scale", perm=[1, 2, 0]),
                   b.node("Transpose", "new_scale", perm=[0, 2, 1]), axis=2)  # [b, 1, t + s]
    past_rope = b.node("Cast", b.node("Transpose", "past_rope", perm=[1, 0, 2]), to=onnx.TensorProto.FLOAT)
    new_rope = b.node("Cast", "new_rope", to=onnx.TensorProto.FLOAT)
    # [b, s*h, c] bytes, [b, s*h, 1]
    q_codes, q_scale = _quantized_rows(b, query.latent, 127.0, onnx.TensorProto.UINT8, offset=CODE_ZERO)
    q_codes = b.node("Transpose", q_codes, perm=[0, 2, 1])  # [b, c, s*h]

    def scored(codes: str, rope: str) -> str:
        """[b, k, c] codes, [b, k, r] rope -> unscaled latent scores [b, s*h, k] float32 and rope scores."""
        # transposed, so that the cached codes are the left operand, read in place: [b, k, c] x [b, c, s*h]
        products = b.node("Transpose", b.node("MatMulInteger", codes, q_codes, zero, zero), perm=[0, 2, 1])
        return b.node("Cast", products, to=onnx.TensorProto.FLOAT), _times_transposed(b, query.pe, rope)

    (past_latent, past_pe), (new_latent, new_pe) = scored(past_codes, past_rope), scored("new_codes", new_rope)
    latent_scores = b.node("Mul", b.node("Mul", b.node("Concat", past_latent, new_latent, axis=-1), q_scale), scale)
    scores = b.node("Add", latent_scores, b.node("Concat", past_pe, new_pe, axis=-1))  # [b, s*h, t + s]
    probs = b.node("Mul", query.softmax(scores, softmax_scale, "mask"), scale)
    p_codes, p_scale = _quantized_rows(b, probs, 255.0, onnx.TensorProto.UINT8)  # over the whole row, t + s
    t = b.node("Shape", "past_codes", start=0, end=1)
    past_p = b.node("Slice", p_codes, b.const([0]), t, b.const([2]))
    new_p = b.node("Slice", p_codes, t, b.const([1 << 62]), b.const([2]))
    # ONNX Runtime leaves a MatMulInteger over an empty inner dimension unwritten: an empty past (t = 0) counts 0
    any_past = b.node("Cast", b.node("Min", t, b.const([1])), to=onnx.TensorProto.INT32)
    past_products = b.node("Mul", b.node("MatMulInteger", past_p, past_codes, "", zero), any_past)
    products = b.node("Add", past_products, b.node("MatMulInteger", new_p, "new_codes", "", zero))  # int32 [b, s*h, c]
    out_latent = b.node("Mul", b.node("Cast", products, to=onnx.TensorProto.FLOAT), p_scale)
    b.rename(query.output(out_latent), "out")
    return ATTENTION_INT8_CACHE.function(b, extra_opsets=[ORT_OPSET])


def _quantized_rows(b: Body, rows: str, largest: float, dtype: int, offset: int = 0) -> tuple[str, str]:
    """rows [..., n] float -> codes round(rows / scale) + offset of dtype, and the per-row scale [..., 1] =
    absmax / largest."""
    absmax = b.node("ReduceMax", b.node("Abs", rows), b.const([-1]), keepdims=1)
    row_scale = b.node("Max", b.node("Div", absmax, b.const(largest, onnx.TensorProto.FLOAT)),
                       b.const(1e-30, onnx.TensorProto.FLOAT))
    codes = b.node("Round", b.node("Div", rows, row_scale))
    if offset:
        codes = b.node("Add", codes, b.const(float(offset), onnx.TensorProto.FLOAT))
    return b.node("Cast", codes, to=dtype), row_scale


# The op that attends over each latent cache format (core/cache_format.py): over int8 the stored codes (the past's
# and the chunk's own) are read in place; fp8 and bf16 are widened to float32, the new entries from their stored
# form, and joined first.
CACHE_ATTENTION = {"fp8": mla_attention, "bf16": mla_attention, "int8": mla_attention_int8_cache}
