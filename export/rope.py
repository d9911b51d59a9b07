"""Rotary position embedding with DeepSeek's YaRN frequencies.

The rope dims are rotated as interleaved pairs (x[2i], x[2i+1]), the layout the checkpoint's
q_b_proj and kv_a_proj_with_mqa rows are trained for.
"""

from __future__ import annotations

import math

import torch

from ..core.config import ModelConfig, yarn_mscale


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """[r/2] float32 frequencies and the factor cos/sin are scaled by."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    extrapolated = 1.0 / base ** exponents
    yarn = config.rope_scaling
    if yarn is None:
        return extrapolated.float(), 1.0
    factor = yarn["factor"]
    original = yarn["original_max_position_embeddings"]
    low = max(math.floor(_correction_dim(yarn.get("beta_fast", 32), dim, base, original)), 0)
    high = min(math.ceil(_correction_dim(yarn.get("beta_slow", 1), dim, base, original)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1: high-frequency dims keep their original frequency
    frequencies = extrapolated / factor * (1 - keep) + extrapolated * keep
    scale = yarn_mscale(factor, yarn.get("mscale", 1)) / yarn_mscale(factor, yarn.get("mscale_all_dim", 0))
    return frequencies.float(), scale


class Rope(torch.nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        frequencies, scale = inverse_frequencies(config)
        self.register_buffer("frequencies", frequencies, persistent=False)
        self.scale = scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [b, s, ..., r], positions [b, s] -> x rotated, same shape: each pair (even, odd) becomes
        (even cos - odd sin, odd cos + even sin), written as x * cos + swapped(x) * signed sin over the whole
        row, the same products and sums in fewer graph nodes (the pair swap is one Gather)."""
        dim = x.shape[-1]
        lanes = torch.arange(dim, device=x.device)
        swap = lanes + 1 - 2 * (lanes % 2)  # 1, 0, 3, 2, ...: each value's partner in its pair
        sign = (2 * (lanes % 2) - 1).to(torch.float32)  # -1 on the even lane, +1 on the odd
        angles = positions.to(torch.float32)[..., None] * self.frequencies.repeat_interleave(2)  # [b, s, r]
        cos, sin = torch.cos(angles) * self.scale, torch.sin(angles) * (sign * self.scale)
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
        return x * cos + torch.index_select(x, -1, swap) * sin
