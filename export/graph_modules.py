"""The modules the exporter traces: embedding, one decoder layer, final norm + head.

They hold the weights in the checkpoint's own formats (FP8 e4m3 with float32 block scales,
BF16 norms, router, embedding and head), so that each ONNX initializer is a byte-for-byte
copy of checkpoint tensors; `initializer_sources` names those tensors. They are built on the
`meta` device for tracing: no weight is in memory while a graph is exported.

The layer graph reads and writes the latent cache in its stored format:
- fp8:  latent [t, b, c] e4m3 with one float32 scale per group of 128 values [t, b, c/128],
        rope [t, b, r] float16: 512 + 16 + 128 = 656 bytes per token per layer on Kimi K2.
- int8: the latent as int8 codes with one float32 scale per token (absmax / 127), each code q stored
        as the byte q + 128 [t, b, c] uint8: the cpu target's cache, which attention multiplies in
        integer arithmetic as it is stored (plugins/mla.py); 512 + 4 + 128 = 644 bytes on Kimi K2.
- bf16: latent [t, b, c] bfloat16, rope [t, b, r] float16 (1152 bytes on Kimi K2).
The cache is time-major so that the first t positions of every row are one contiguous block.

The target decides how the weights are lowered (`targets.py`): `cuda` and `tensorrt` keep every
FP8 weight as it is; `cpu` stores the dense linears, the head and the routed experts as int8
blocks for ONNX Runtime's int8 kernels (`plugins/int8.py`), re-quantised from the checkpoint's
bytes as the exporter streams them (`int8_pieces`). The layer's code is the same for all three.
"""

from __future__ import annotations


import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.cache_format import CacheFormat
from ..core.config import ModelConfig
from ..core.checkpoint.reader import Checkpoint
from ..plugins import int8
from ..plugins.fp8 import dequantize
from ..plugins.mla import CODE_ZERO, absorbed_int8
from . import model
from .rope import inverse_frequencies

FP8_MAX = 448.0
INT8_MAX = 127.0
CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.uint8, "bf16": torch.bfloat16}


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


class Int8Linear(nn.Module):
    """y = x W^T with W kept as int8 blocks along the input dim (the cpu target; see plugins/int8.py)."""

    def __init__(self, in_features: int, out_features: int, block: int):
        super().__init__()
        self.register_buffer("weight_int8", torch.empty(out_features, in_features // block, block, dtype=torch.uint8))
        self.register_buffer("weight_int8_scale", torch.empty(out_features, in_features // block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.k2deploy.linear_int8(x, self.weight_int8, self.weight_int8_scale)


class AbsorbedInt8(nn.Module):
    """kv_b_proj taken apart for absorbed attention, as int8: W_UK [h, d, c] and W_UV^T [h, c, v] with one
    scale per output column (plugins/mla.py `absorbed_int8`); the int8 cache's attention multiplies them."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d, v, c = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.register_buffer("w_uk_int8", torch.empty(h, d, c, dtype=torch.int8))
        self.register_buffer("w_uk_scale", torch.empty(h, 1, c))
        self.register_buffer("w_uv_int8", torch.empty(h, c, v, dtype=torch.int8))
        self.register_buffer("w_uv_scale", torch.empty(h, 1, v))


def linear_maker(target: str, fp8_block: int):
    """(in, out) -> the linear module of this target: int8 blocks on cpu where a block fits the input dim."""
    def make(in_features: int, out_features: int) -> nn.Module:
        block = int8.int8_block(in_features) if target == "cpu" else None
        return Int8Linear(in_features, out_features, block) if block else Fp8Linear(in_features, out_features, fp8_block)
    return make


def experts_int8_block(config: ModelConfig, target: str) -> int | None:
    """The cpu target's int8 block for the routed experts (it must divide hidden and expert width), else None."""
    return int8.int8_block(config.hidden_size, config.moe_intermediate_size) if target == "cpu" else None


class ExportMoE(nn.Module):
    """Routing and dispatch through the plugin ops. Routed experts stacked per projection as e4m3 bits
    [e, rows, cols] uint8 with their block scales; on cpu as int8 blocks, gate and up interleaved in fc1."""

    def __init__(self, config: ModelConfig, block: int, target: str):
        super().__init__()
        c = config
        e, f, m = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.config, self.block = c, block
        self.gate = nn.Module()
        self.gate.register_buffer("weight", torch.empty(e, m, dtype=torch.bfloat16))
        self.gate.register_buffer("e_score_correction_bias", torch.empty(e, dtype=torch.float32))
        self.int8_block = experts_int8_block(c, target)
        if self.int8_block:
            for fc, (rows, cols) in {"fc1": (2 * f, m), "fc2": (m, f)}.items():
                self.register_buffer(f"experts_{fc}_weight", torch.empty(e, rows, cols, dtype=torch.uint8))
                self.register_buffer(f"experts_{fc}_scale", torch.empty(e, rows, cols // self.int8_block))
        else:
            for proj, (rows, cols) in {"gate_proj": (f, m), "up_proj": (f, m), "down_proj": (m, f)}.items():
                self.register_buffer(f"experts_{proj}_weight", torch.empty(e, rows, cols, dtype=torch.uint8))
                self.register_buffer(f"experts_{proj}_scale", torch.empty(e, -(-rows // block), -(-cols // block)))
        self.shared_experts = (model.MLP(m, f * c.n_shared_experts, linear_maker(target, block))
                               if c.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [n, m]
        route_weights, expert_ids = torch.ops.k2deploy.moe_route(
            tokens, self.gate.weight.float(), self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
            c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        if self.int8_block:
            out = torch.ops.k2deploy.moe_experts_int8(
                tokens, expert_ids, route_weights, self.experts_fc1_weight, self.experts_fc1_scale,
                self.experts_fc2_weight, self.experts_fc2_scale)
        else:
            out = torch.ops.k2deploy.moe_experts(
                tokens, expert_ids, route_weights, self.experts_gate_proj_weight, self.experts_gate_proj_scale,
                self.experts_up_proj_weight, self.experts_up_proj_scale, self.experts_down_proj_weight,
                self.experts_down_proj_scale, self.block)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)


class ExportLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, cache_format: str, target: str):
        super().__init__()
        c = config
        if c.fp8_block is None:
            raise ValueError("export needs an FP8 checkpoint (quantization_config with weight_block_size)")
        block = c.fp8_block[0]
        self.config, self.cache_format = c, cache_format
        self.group = CacheFormat.for_config(c, cache_format).scale_group  # latent values per scale
        make_linear = linear_maker(target, block)
        self.input_layernorm = model.RMSNorm(c.hidden_size, c.rms_norm_eps, torch.bfloat16)
        self.self_attn = model.MLA(c, absorb=True, make_linear=make_linear, norm_dtype=torch.bfloat16)
        # absorbed attention takes W_UK and W_UV apart per head: as int8 for the int8 cache's attention,
        # else FP8, dequantised once at load
        self.self_attn.kv_b_proj = (AbsorbedInt8(c) if cache_format == "int8" else
                                    Fp8Linear(c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                              block))
        self.post_attention_layernorm = model.RMSNorm(c.hidden_size, c.rms_norm_eps, torch.bfloat16)
        self.mlp = (ExportMoE(c, block, target) if c.is_moe_layer(layer)
                    else model.MLP(c.hidden_size, c.intermediate_size, make_linear))

    def forward(self, hidden, positions, past_latent, past_rope, past_latent_scale=None):
        """hidden [b, s, m] float32, positions [b, s] int64 (row i's cache holds positions[i, 0] tokens),
        past_* the first t cache slots (see the module doc) -> hidden [b, s, m] and the s new cache entries
        in the cache's format: latent [b, s, c], rope [b, s, r], and for fp8 / int8 latent_scale [b, s, c/128]."""
        c = self.config
        b, s, _ = hidden.shape
        t = past_latent.shape[0]
        attention = self.self_attn
        q_nope, q_pe, new_latent, new_rope = attention.project(self.input_layernorm(hidden), positions)
        cached = torch.arange(t, device=positions.device)[None, None, :] < positions[:, :1, None]  # [b, 1, t]
        step = torch.arange(s, device=positions.device)
        causal = step[None, :, None] >= step[None, None, :]  # [1, s, s]
        mask = torch.cat([cached.expand(b, s, t), causal.expand(b, s, s)], dim=-1)  # [b, s, t + s]
        if self.cache_format == "int8":  # the codes read in place, the per-token scale applied to the scores
            kv_b = attention.kv_b_proj
            attended = torch.ops.k2deploy.mla_attention_int8_cache(
                q_nope, q_pe, past_latent, past_latent_scale, past_rope, new_latent, new_rope, kv_b.w_uk_int8,
                kv_b.w_uk_scale, kv_b.w_uv_int8, kv_b.w_uv_scale, mask, c.qk_nope_head_dim, c.v_head_dim,
                c.softmax_scale)
        else:
            latent_past = past_latent.float()
            if past_latent_scale is not None:
                grouped = latent_past.view(t, b, -1, self.group) * past_latent_scale.unsqueeze(-1)
                latent_past = grouped.view(t, b, c.kv_lora_rank)
            latent = torch.cat([latent_past.transpose(0, 1), new_latent], dim=1)  # [b, t + s, c]
            rope = torch.cat([past_rope.float().transpose(0, 1), new_rope], dim=1)  # [b, t + s, r]
            attended = torch.ops.k2deploy.mla_attention(q_nope, q_pe, latent, rope, attention.kv_b_proj.dequantized(),
                                                        mask, c.qk_nope_head_dim, c.v_head_dim, c.softmax_scale)
        hidden = hidden + attention.o_proj(attended.reshape(b, s, -1))
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        new_rope = new_rope.to(torch.float16)
        if self.cache_format == "bf16":
            return hidden, new_latent.to(torch.bfloat16), new_rope
        grouped = new_latent.view(b, s, -1, self.group)
        largest = FP8_MAX if self.cache_format == "fp8" else INT8_MAX
        scale = (grouped.abs().amax(dim=-1, keepdim=True) / largest).clamp(min=1e-12)
        codes = grouped / scale
        if self.cache_format == "int8":
            codes = codes.round().clamp(-INT8_MAX, INT8_MAX) + CODE_ZERO
        quantised = codes.to(CACHE_TORCH_DTYPES[self.cache_format]).view(b, s, c.kv_lora_rank)
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
    def __init__(self, config: ModelConfig, target: str):
        super().__init__()
        self.norm = model.RMSNorm(config.hidden_size, config.rms_norm_eps, torch.bfloat16)
        block = int8.int8_block(config.hidden_size) if target == "cpu" else None
        if block:  # the BF16 head as int8 blocks: half the bytes every step reads
            self.lm_head = Int8Linear(config.hidden_size, config.vocab_size, block)
        else:
            self.register_buffer("lm_head", torch.empty(config.vocab_size, config.hidden_size, dtype=torch.bfloat16))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, s, m] -> logits [b, s, vocab] float32."""
        if isinstance(self.lm_head, Int8Linear):
            return self.lm_head(self.norm(hidden))
        return F.linear(self.norm(hidden), self.lm_head.float())


def initializer_sources(config: ModelConfig, kind: str, layer: int | None, name: str) -> list[str]:
    """The checkpoint tensors whose bytes, concatenated, are the initializer `name` of a graph."""
    if kind == "embed":
        return ["model.embed_tokens.weight"]
    if kind == "head":
        return {"norm.weight": ["model.norm.weight"], "lm_head": ["lm_head.weight"]}[name]
    prefix = f"model.layers.{layer}."
    if name.startswith("mlp.experts_fc"):
        return []  # re-quantised: see int8_pieces
    if name.startswith("mlp.experts_"):
        proj, _, part = name.removeprefix("mlp.experts_").rpartition("_")
        suffix = "weight" if part == "weight" else "weight_scale_inv"
        return [f"{prefix}mlp.experts.{expert}.{proj}.{suffix}" for expert in range(config.n_routed_experts)]
    return [prefix + name]


# -- the cpu target's int8 initializers, re-quantised from the checkpoint as they are written --------

ROWS_PER_PIECE = 1024  # rows re-quantised at a time: a real-size linear never sits in memory as float32


def int8_pieces(config: ModelConfig, checkpoint: Checkpoint, kind: str, layer: int | None, name: str):
    """The pieces of an int8 initializer of the cpu target, or None when `name` is a checkpoint copy."""
    prefix = "" if kind == "head" else f"model.layers.{layer}."
    if name.endswith((".weight_int8", ".weight_int8_scale")):
        module, _, part = name.rpartition(".")
        source = prefix + module + ".weight"
        rows, cols = checkpoint.entries[source].shape
        block = int8.int8_block(cols)
        return (_int8_part(_float_rows(config, checkpoint, source, start, start + ROWS_PER_PIECE), block,
                           part.endswith("scale"))
                for start in range(0, rows, ROWS_PER_PIECE))
    if name.startswith("self_attn.kv_b_proj.w_u"):
        weight = torch.from_numpy(checkpoint.float32(prefix + "self_attn.kv_b_proj.weight"))
        parts = absorbed_int8(weight, config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim)
        names = ("w_uk_int8", "w_uk_scale", "w_uv_int8", "w_uv_scale")
        return [parts[names.index(name.rpartition(".")[2])].numpy()]
    if name.startswith("mlp.experts_fc"):
        fc, part = name.removeprefix("mlp.experts_").split("_")
        block = experts_int8_block(config, "cpu")
        expert = f"{prefix}mlp.experts.{{}}."
        return (_int8_part(_expert_fc(config, checkpoint, expert.format(e), fc), block, part == "scale")
                for e in range(config.n_routed_experts))
    return None


def _int8_part(weight: np.ndarray, block: int, scales: bool) -> np.ndarray:
    codes, block_scales = int8.quantize_rows(weight, block)
    return block_scales if scales else codes


def _float_rows(config: ModelConfig, checkpoint: Checkpoint, name: str, start: int, stop: int) -> np.ndarray:
    """Rows start:stop of a checkpoint weight in float32 (FP8 dequantised with its block scales; BF16 widened)."""
    raw = checkpoint.raw(name)[start:stop]
    if raw.dtype.itemsize != 1:
        return raw.astype(np.float32)
    fp8 = config.fp8_block[0]
    scale = checkpoint.raw(name + "_scale_inv")[start // fp8 : -(-stop // fp8)]
    return int8.fp8_to_float(raw.view(np.uint8), scale, fp8)


def _expert_fc(config: ModelConfig, checkpoint: Checkpoint, expert: str, fc: str) -> np.ndarray:
    """fc1: gate and up rows interleaved [2f, m] (QMoE's fused SwiGLU layout); fc2: down [m, f]."""
    whole = lambda proj: _float_rows(config, checkpoint, f"{expert}{proj}.weight", 0, 1 << 62)  # noqa: E731
    if fc == "fc2":
        return whole("down_proj")
    gate, up = whole("gate_proj"), whole("up_proj")
    return np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], gate.shape[1])
