"""Routed experts in 4 bits, as an INT4 checkpoint holds them: ONNX Runtime's `com.microsoft.QMoE` with
expert_weight_bits 4, fed the checkpoint's own codes and group scales (nothing is re-quantised).

compressed-tensors packs eight codes (value + 8) into each int32 word, the first in the lowest bits
(core/int4.py); read as bytes, a row is [in / 2] uint8 with code 2j in the low nibble of byte j and 2j + 1
in the high one, which is QMoE's 4-bit layout with its default zero point 8. So the graph's codes are the
checkpoint's bytes; only the rows are reordered, gate and up interleaved into fc1 [e, 2f, m / 2] for the
fused SwiGLU, and the BF16 group scales are widened to float32 (exactly) [e, rows, cols / group].

`accuracy_level` says how QMoE multiplies: the cpu target's int8 activations (4, ONNX Runtime's int8 dot
products) or float32 activations against the exact dequantised weights (0, the exact targets).
"""

from __future__ import annotations

import torch

from .int8 import fused_swiglu_experts, qmoe_node
from .op_spec import FLOAT, INT64, UINT8, OpSpec, tensor

ZERO_POINT = 8  # QMoE's default 4-bit zero point, compressed-tensors' code offset
EXACT, INT8_ACTIVATIONS = 0, 4  # QMoE accuracy_level: float32 compute; int8 activations


def dequantize_nibbles(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [rows, cols / 2] uint8 (two 4-bit codes a byte, low nibble first), scales [rows, cols / group]
    -> float32 [rows, cols]: (code - 8) x its group's scale."""
    rows = codes.shape[0]
    values = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(rows, -1).to(torch.float32) - ZERO_POINT
    return (values.view(rows, scales.shape[-1], -1) * scales.unsqueeze(-1)).view(rows, -1)


def _moe_experts_int4_eager(x, expert_ids, route_weights, fc1_codes, fc1_scales, fc2_codes, fc2_scales,
                            accuracy_level: int) -> torch.Tensor:
    """x [n, m], expert_ids / route_weights [n, k]; fc1 [e, 2f, m / 2] (gate and up rows interleaved) and fc2
    [e, m, f / 2] as 4-bit codes with float32 group scales [e, rows, cols / group] -> [n, m] float32 (the exact
    maths, whatever the accuracy level)."""
    return fused_swiglu_experts(x, expert_ids, route_weights,
                                lambda e: dequantize_nibbles(fc1_codes[e], fc1_scales[e]),
                                lambda e: dequantize_nibbles(fc2_codes[e], fc2_scales[e]))


EXPERTS_INT4 = OpSpec(
    "MoeExpertsInt4",
    {"x": tensor("n m", FLOAT), "expert_ids": tensor("n k", INT64), "route_weights": tensor("n k", FLOAT),
     "fc1_codes": tensor("e f2 m_half", UINT8), "fc1_scales": tensor("e f2 m_groups", FLOAT),
     "fc2_codes": tensor("e m f_half", UINT8), "fc2_scales": tensor("e m f_groups", FLOAT)},
    {"y": tensor("n m", FLOAT)}, {"accuracy_level": int})
moe_experts_int4 = EXPERTS_INT4.torch_op("moe_experts_int4", _moe_experts_int4_eager)


def moe_experts_int4_onnx(x, expert_ids, route_weights, fc1_codes, fc1_scales, fc2_codes, fc2_scales,
                          accuracy_level: int):
    _, _, half = fc1_codes.shape
    return qmoe_node(x, expert_ids, route_weights, fc1_codes, fc1_scales, fc2_codes, fc2_scales, bits=4,
                     block=2 * half // fc1_scales.shape[-1], accuracy_level=accuracy_level)
