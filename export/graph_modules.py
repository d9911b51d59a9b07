"""The modules the exporter traces: embedding, one decoder layer, final norm + head.

They hold the weights in the checkpoint's own formats (FP8 e4m3 with float32 block scales,
BF16 norms, router, embedding and head), so that each ONNX initializer is a byte-for-byte
copy of checkpoint tensors; `initializer_sources` names those tensors. They are built on the
`meta` device for tracing: no weight is in memory while a graph is exported.

The layer graph reads and writes the latent cache in its stored format:
- fp8:  latent [t, b, c] e4m3 with one float32 scale per group of 128 values [t, b, c/128],
        rope [t, b, r] float16: 512 + 16 + 128 = 656 bytes per token per layer on Kimi K2.
- bf16: latent [t, b, c] bfloat16, rope [t, b, r] float16 (1152 bytes on Kimi K2).
The cache is time-major so that the first t positions of every row are one contiguous block.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..plugins.fp8 import dequantize
from . import model
from .rope import inverse_frequencies

FP8_MAX = 448.0
CACHE_FORMATS = ("fp8", "bf16")


def latent_group(config: ModelConfig) -> int:
    """Latent values that share one FP8 cache scale: 128, or the whole latent when it is not a multiple of 128."""
    return math.gcd(config.kv_lora_rank, 128)


class Fp8Linear(nn.Module):
    """y = x W^T with W kept as e4m3 [out, in] and its float32 block scales `weight_scale_inv`."""

    def __init__(self, in_features: int, out_features: int, block: int):
        super().__init__()
        self.block = block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        blocks = (-(-out_features // block), -(-in_features // block))
        self.register_buffer("weight_scale_inv", torch.empty(blocks, dtype=torch.float32))

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized())


class ExportMoE(nn.Module):
    """Routing and dispatch through the plugin ops; routed experts stacked as e4m3 bits [e, ...] uint8."""

    def __init__(self, config: ModelConfig, block: int):
        super().__init__()
        c = config
        e, f, m = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.config, self.block = c, block
        self.gate = nn.Module()
        self.gate.register_buffer("weight", torch.empty(e, m, dtype=torch.bfloat16))
        self.gate.register_buffer("e_score_correction_bias", torch.empty(e, dtype=torch.float32))
        for proj, (rows, cols) in {"gate_proj": (f, m), "up_proj": (f, m), "down_proj": (m, f)}.items():
            self.register_buffer(f"experts_{proj}_weight", torch.empty(e, rows, cols, dtype=torch.uint8))
            self.register_buffer(f"experts_{proj}_scale", torch.empty(e, -(-rows // block), -(-cols // block)))
        self.shared_experts = (model.MLP(m, f * c.n_shared_experts, lambda i, o: Fp8Linear(i, o, block))
                               if c.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [n, m]
        route_weights, expert_ids = torch.ops.k2deploy.moe_route(
            tokens, self.gate.weight.float(), self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
            c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        out = torch.ops.k2deploy.moe_experts(
            tokens, expert_ids, route_weights, self.experts_gate_proj_weight, self.experts_gate_proj_scale,
            self.experts_up_proj_weight, self.experts_up_proj_scale, self.experts_down_proj_weight,
            self.experts_down_proj_scale, self.block)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)


class ExportLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, cache_format: str):
        super().__init__()
        c = config
        if c.fp8_block is None:
            raise ValueError("export needs an FP8 checkpoint (quantization_config with weight_block_size)")
        block = c.fp8_block[0]
        self.config, self.cache_format, self.group = c, cache_format, latent_group(c)
        fp8_linear = lambda i, o: Fp8Linear(i, o, block)  # noqa: E731
        self.input_layernorm = model.RMSNorm(c.hidden_size, c.rms_norm_eps, torch.bfloat16)
        self.self_attn = model.MLA(c, absorb=True, make_linear=fp8_linear, norm_dtype=torch.bfloat16)
        self.post_attention_layernorm = model.RMSNorm(c.hidden_size, c.rms_norm_eps, torch.bfloat16)
        self.mlp = ExportMoE(c, block) if c.is_moe_layer(layer) else model.MLP(c.hidden_size, c.intermediate_size, fp8_linear)

    def forward(self, hidden, positions, past_latent, past_rope, past_latent_scale=None):
        """hidden [b, s, m] float32, positions [b, s] int64 (row i's cache holds positions[i, 0] tokens),
        past_* the first t cache slots (see the module doc) -> hidden [b, s, m] and the s new cache entries
        in the cache's format: latent [b, s, c], rope [b, s, r], and for fp8 latent_scale [b, s, c/128]."""
        c = self.config
        b, s, _ = hidden.shape
        t = past_latent.shape[0]
        latent_past = past_latent.float()
        if past_latent_scale is not None:
            grouped = latent_past.view(t, b, -1, self.group) * past_latent_scale.unsqueeze(-1)
            latent_past = grouped.view(t, b, c.kv_lora_rank)
        attention = self.self_attn
        q_nope, q_pe, new_latent, new_rope = attention.project(self.input_layernorm(hidden), positions)
        latent = torch.cat([latent_past.transpose(0, 1), new_latent], dim=1)  # [b, t + s, c]
        rope = torch.cat([past_rope.float().transpose(0, 1), new_rope], dim=1)  # [b, t + s, r]
        cached = torch.arange(t, device=positions.device)[None, None, :] < positions[:, :1, None]  # [b, 1, t]
        step = torch.arange(s, device=positions.device)
        causal = step[None, :, None] >= step[None, None, :]  # [1, s, s]
        mask = torch.cat([cached.expand(b, s, t), causal.expand(b, s, s)], dim=-1)  # [b, s, t + s]
        attended = torch.ops.k2deploy.mla_attention(q_nope, q_pe, latent, rope, attention.kv_b_proj.dequantized(), mask,
                                                    c.qk_nope_head_dim, c.v_head_dim, c.softmax_scale)
        hidden = hidden + attention.o_proj(attended.reshape(b, s, -1))
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        new_rope = new_rope.to(torch.float16)
        if self.cache_format == "bf16":
            return hidden, new_latent.to(torch.bfloat16), new_rope
        grouped = new_latent.view(b, s, -1, self.group)
        scale = (grouped.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        quantised = (grouped / scale).to(torch.float8_e4m3fn).view(b, s, c.kv_lora_rank)
        return hidden, quantised, new_rope, scale.squeeze(-1)

    def derived_initializers(self) -> dict[str, np.ndarray]:
        """Initializers that are not checkpoint tensors: the rope frequencies."""
        return {"self_attn.rotary.frequencies": inverse_frequencies(self.config)[0].numpy()}


class ExportEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("weight", torch.empty(config.vocab_size, config.hidden_size, dtype=torch.bfloat16))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [b, s] int64 -> hidden [b, s, m] float32."""
        return F.embedding(token_ids, self.weight).float()


class ExportHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = model.RMSNorm(config.hidden_size, config.rms_norm_eps, torch.bfloat16)
        self.register_buffer("lm_head", torch.empty(config.vocab_size, config.hidden_size, dtype=torch.bfloat16))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, s, m] -> logits [b, s, vocab] float32."""
        return F.linear(self.norm(hidden), self.lm_head.float())


def initializer_sources(config: ModelConfig, kind: str, layer: int | None, name: str) -> list[str]:
    """The checkpoint tensors whose bytes, concatenated, are the initializer `name` of a graph."""
    if kind == "embed":
        return ["model.embed_tokens.weight"]
    if kind == "head":
        return {"norm.weight": ["model.norm.weight"], "lm_head": ["lm_head.weight"]}[name]
    prefix = f"model.layers.{layer}."
    if name.startswith("mlp.experts_"):
        proj, _, part = name.removeprefix("mlp.experts_").rpartition("_")
        suffix = "weight" if part == "weight" else "weight_scale_inv"
        return [f"{prefix}mlp.experts.{expert}.{proj}.{suffix}" for expert in range(config.n_routed_experts)]
    return [prefix + name]
