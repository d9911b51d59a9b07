"""The cpu lowering's ops: FP8 (or BF16) weights re-quantised to int8 blocks along the input dim.

ONNX Runtime's CPU provider has no FP8 matrix kernel; it has int8 ones that read one byte per
weight and multiply with int8 activations (VNNI dot products): `com.microsoft.MatMulNBits`
(bits 8) for a linear and `com.microsoft.QMoE` (8-bit experts) for the routed experts. The cpu
target stores each weight in their format: a row's input dim cut into blocks of `block`
values, each block one float32 scale (absmax / 127) and codes q + 128 as uint8, so that
W[r, c] = (code - 128) * scale[r, c // block]. Every int8 block lies inside one 128x128 FP8
block. The error this adds is stated and tested (tests/test_cpu_lowering.py).

Each op here has the faces of the other plugins: the eager code (torch), the torch.library op
that torch.export traces, and its ONNX lowering, here to ONNX Runtime's own contrib ops.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from onnx.defs import OpSchema
from onnxscript.values import Op, Opset

from ..core.cache_format import INT8_ZERO_POINT
from ..core.quant_blocks import int8_block  # noqa: F401 (export/passes.py and the tests pick blocks by it)
from .fp8 import E4M3_VALUES
from .op_spec import BFLOAT16, FLOAT, FLOAT16, INT64, UINT8, OpSpec, tensor

ZERO_POINT = INT8_ZERO_POINT  # MatMulNBits' and QMoE's default 8-bit zero point, the int8 cache's and the native step's
ORT_DOMAIN = "com.microsoft"
INT8_COMPUTE = 4  # accuracy_level: int8 activations, int8 dot-product kernels


# -- re-quantisation (numpy; the exporter streams it into the artifact) ----------------------

def block_scales(weight: np.ndarray, block: int) -> np.ndarray:
    """float32 [rows, cols] -> each block's scale, absmax / 127: float32 [rows, cols / block]."""
    rows, cols = weight.shape
    return (np.abs(weight.reshape(rows, cols // block, block)).max(axis=-1) / 127.0).astype(np.float32)


def quantize_rows(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 [rows, cols] -> codes [rows, cols / block, block] uint8 and scales [rows, cols / block] float32."""
    rows, cols = weight.shape
    scales = block_scales(weight, block)
    safe = np.where(scales > 0, scales, 1.0)
    codes = np.clip(np.rint(weight.reshape(rows, cols // block, block) / safe[..., None]), -127, 127) + ZERO_POINT
    return codes.astype(np.uint8), scales


# FP8 straight to int8 blocks. An int8 block lies inside one FP8 block, so its absmax is that block's scale times
# the largest e4m3 magnitude in it, and the scale cancels from every code: code = rint(127 E[bits] / E[largest]).
# One table holds that code for every (largest magnitude, bits) pair, so the checkpoint's bytes become the
# artifact's in a pass of byte operations, with no float32 copy of the weight.
NAN_MAGNITUDE = 0x7F  # e4m3fn's NaN, without its sign bit
FP8_CHUNK_ROWS = 64  # rows mapped at a time: a chunk's 16-bit table indices stay in cache


def _fp8_code_table() -> np.ndarray:
    """-> uint8 [128 * 256]: at largest << 8 | bits, the code + ZERO_POINT of e4m3 `bits` in a block whose largest
    magnitude's bits are `largest` (0 for a block of zeros and for NaN)."""
    magnitudes = E4M3_VALUES[:128].astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = magnitudes[None, :] * 127 / magnitudes[:, None]  # [largest, magnitude bits]
    codes = np.where(np.isfinite(ratio), np.clip(np.rint(ratio), 0, 127), 0).astype(np.int16)
    return np.concatenate([ZERO_POINT + codes, ZERO_POINT - codes], axis=1).astype(np.uint8).reshape(-1)


_FP8_CODES = _fp8_code_table()


def fp8_block_maxima(bits: np.ndarray, block: int) -> np.ndarray:
    """e4m3 bits [rows, cols] uint8 -> the largest magnitude's bits in each int8 block, uint8 [rows, cols / block]
    (NAN_MAGNITUDE where a block holds a NaN)."""
    rows, cols = bits.shape
    return np.bitwise_and(bits, 0x7F).reshape(rows, cols // block, block).max(axis=-1)


def fp8_codes(bits: np.ndarray, largest: np.ndarray, block: int) -> np.ndarray:
    """e4m3 bits [rows, cols] and their blocks' fp8_block_maxima -> codes [rows, cols / block, block] uint8, as
    quantize_rows gives them for the dequantised weight."""
    rows, cols = bits.shape
    blocks = bits.reshape(rows, cols // block, block)
    codes = np.empty(blocks.shape, np.uint8)
    for start in range(0, rows, FP8_CHUNK_ROWS):
        part = slice(start, start + FP8_CHUNK_ROWS)
        np.take(_FP8_CODES, (largest[part, :, None].astype(np.uint16) << 8) | blocks[part], out=codes[part])
    return codes


def fp8_scales(largest: np.ndarray, row_scales: np.ndarray, fp8_block: int, block: int) -> np.ndarray:
    """fp8_block_maxima [rows, cols / block] and each row's FP8 block scales [rows, ceil(cols / fp8_block)] -> the
    int8 blocks' scales [rows, cols / block] float32 (block divides fp8_block)."""
    per_block = np.repeat(row_scales, fp8_block // block, axis=1)[:, : largest.shape[1]]
    return (per_block * (E4M3_VALUES[largest] / np.float32(127.0))).astype(np.float32)


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., rows, cols / block, block] uint8, scales [..., rows, cols / block] -> float32 [..., rows, cols]."""
    values = (codes.to(torch.float32) - ZERO_POINT) * scales.unsqueeze(-1)
    return values.flatten(-2)


# -- torch ops: what torch.export sees ----------------------------------------------------------

def _linear_int8_eager(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., k], codes [n, k / block, block], scales [n, k / block] -> [..., n] float32."""
    return F.linear(x.float(), dequantize_rows(codes, scales))


def _moe_experts_int8_eager(x, expert_ids, route_weights, fc1_codes, fc1_scales, fc2_codes, fc2_scales) -> torch.Tensor:
    """x [n, m], expert_ids / route_weights [n, k]; fc1 [e, 2f, m] (gate and up rows interleaved) and fc2 [e, m, f]
    as codes uint8 with scales [e, rows, cols / block] -> [n, m] float32."""
    _, rows, m = fc1_codes.shape
    block = m // fc1_scales.shape[-1]  # one block size for both (QMoE's block_size)
    return fused_swiglu_experts(
        x, expert_ids, route_weights,
        lambda e: dequantize_rows(fc1_codes[e].view(rows, -1, block), fc1_scales[e]),
        lambda e: dequantize_rows(fc2_codes[e].view(m, -1, block), fc2_scales[e]))


def fused_swiglu_experts(x, expert_ids, route_weights, fc1_of: Callable, fc2_of: Callable) -> torch.Tensor:
    """QMoE's maths in float32: each token's chosen experts' SwiGLU, weighted by its route weights and summed.
    x [n, m], expert_ids / route_weights [n, k]; fc1_of(e) -> expert e's [2f, m] float32 weight (gate and up rows
    interleaved), fc2_of(e) -> its [m, f] -> [n, m] float32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert in expert_ids.unique().tolist():
        tokens, slots = (expert_ids == expert).nonzero(as_tuple=True)
        both = x[tokens].float() @ fc1_of(expert).T  # [n_e, 2f]: gate, up, gate, up, ...
        hidden = F.silu(both[:, 0::2]) * both[:, 1::2]
        out.index_add_(0, tokens, (hidden @ fc2_of(expert).T) * route_weights[tokens, slots, None])
    return out


LINEAR_INT8 = OpSpec(
    "LinearInt8",
    {"x": tensor("... k", FLOAT, BFLOAT16, FLOAT16), "codes": tensor("n blocks block", UINT8),
     "scales": tensor("n blocks", FLOAT)},
    {"y": tensor("... n", FLOAT)}, {})
linear_int8 = LINEAR_INT8.torch_op("linear_int8", _linear_int8_eager)
EXPERTS_INT8 = OpSpec(
    "MoeExpertsInt8",
    {"x": tensor("n m", FLOAT), "expert_ids": tensor("n k", INT64), "route_weights": tensor("n k", FLOAT),
     "fc1_codes": tensor("e f2 m", UINT8), "fc1_scales": tensor("e f2 m_blocks", FLOAT),
     "fc2_codes": tensor("e m f", UINT8), "fc2_scales": tensor("e m f_blocks", FLOAT)},
    {"y": tensor("n m", FLOAT)}, {})
moe_experts_int8 = EXPERTS_INT8.torch_op("moe_experts_int8", _moe_experts_int8_eager)


# -- ONNX: ONNX Runtime's contrib ops -------------------------------------------------------------

def _contrib_op(name: str, inputs: list[str], attributes: dict[str, OpSchema.AttrType]) -> Op:
    """An onnxscript op that emits one com.microsoft node (the schema only shapes the call)."""
    parameter = OpSchema.FormalParameter
    types = ["tensor(float)", "tensor(uint8)", "tensor(int64)"]
    schema = OpSchema(name, ORT_DOMAIN, 1,
                      inputs=[parameter(n, f"T{i}", param_option=OpSchema.FormalParameterOption.Optional)
                              for i, n in enumerate(inputs)],
                      outputs=[parameter("Y", "U")],
                      type_constraints=[(f"T{i}", types, "") for i in range(len(inputs))] + [("U", types, "")],
                      attributes=[OpSchema.Attribute(n, t) for n, t in attributes.items()])
    return Op(Opset(ORT_DOMAIN, 1), name, schema)


_INT, _FLOAT, _STRING = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT, OpSchema.AttrType.STRING
_matmul_nbits = _contrib_op("MatMulNBits", ["A", "B", "scales"],
                            {"K": _INT, "N": _INT, "bits": _INT, "block_size": _INT, "accuracy_level": _INT})
QMOE_INPUTS = ["input", "router_probs", "fc1_experts_weights", "fc1_scales", "fc1_experts_bias", "fc2_experts_weights",
               "fc2_scales", "fc2_experts_bias", "fc3_experts_weights", "fc3_scales", "fc3_experts_bias",
               "fc1_zero_points", "fc2_zero_points", "fc3_zero_points", "router_weights"]
_qmoe = _contrib_op("QMoE", QMOE_INPUTS,
                    {"k": _INT, "activation_type": _STRING, "activation_alpha": _FLOAT, "activation_beta": _FLOAT,
                     "normalize_routing_weights": _INT, "swiglu_fusion": _INT, "expert_weight_bits": _INT,
                     "block_size": _INT, "accuracy_level": _INT, "quant_type": _STRING})


def linear_int8_onnx(x, codes, scales):
    n, k_blocks, block = codes.shape
    return _matmul_nbits(x, codes, scales, K=k_blocks * block, N=n, bits=8, block_size=block,
                         accuracy_level=INT8_COMPUTE)


def moe_experts_int8_onnx(x, expert_ids, route_weights, fc1_codes, fc1_scales, fc2_codes, fc2_scales):
    e, _, m = fc1_codes.shape
    return qmoe_node(x, expert_ids, route_weights, fc1_codes, fc1_scales, fc2_codes, fc2_scales, bits=8,
                     block=m // fc1_scales.shape[-1], accuracy_level=INT8_COMPUTE)


def qmoe_node(x, expert_ids, route_weights, fc1_codes, fc1_scales, fc2_codes, fc2_scales, bits: int, block: int,
              accuracy_level: int):
    """One QMoE node over experts whose codes are `bits` wide (fc1: gate and up rows interleaved, fused SwiGLU).
    QMoE chooses top-k of router_probs and mixes with router_weights: both are the routing's own choice,
    scattered to [n, e] (ones on the chosen experts, and their route weights)."""
    from onnxscript import opset21 as op

    e = fc1_codes.shape[0]
    k = expert_ids.shape[-1]
    zeros = op.ConstantOfShape(op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[e]), axis=0))
    chosen = op.ScatterElements(zeros, expert_ids, op.Expand(op.Constant(value_float=1.0), op.Shape(expert_ids)), axis=1)
    mixing = op.ScatterElements(zeros, expert_ids, route_weights, axis=1)
    return _qmoe(x, chosen, fc1_codes, fc1_scales, None, fc2_codes, fc2_scales, None, None, None, None, None, None,
                 None, mixing, k=k, activation_type="swiglu", activation_alpha=1.0, activation_beta=0.0,
                 normalize_routing_weights=0, swiglu_fusion=1, expert_weight_bits=bits, block_size=block,
                 accuracy_level=accuracy_level, quant_type="int")
