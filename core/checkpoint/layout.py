"""Every tensor a Kimi K2 / DeepSeek-V3 checkpoint holds, by name, shape and dtype.

The one place the Hugging Face tensor layout is written down: the reader checks a
checkpoint against it, the synthetic writer produces it, inspect counts from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import K2Error

FP8 = "F8_E4M3"
BF16 = "BF16"
F32 = "F32"
I32 = "I32"
I64 = "I64"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string
    role: str  # "proj" (a weight matrix), "scale" (its block scales), "norm", "router", "bias", "embedding", "head";
               # INT4: "int4" (the packed codes), "int4_scale", "int4_shape"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def parameters(self) -> int:
        """The model parameters the tensor holds: none for scales and shapes, eight per INT4 word."""
        if self.role in ("scale", "int4_scale", "int4_shape"):
            return 0
        return self.numel * (8 if self.role == "int4" else 1)


def projection(config: ModelConfig, name: str, out_features: int, in_features: int) -> list[TensorSpec]:
    """A `*_proj.weight` [out, in]: FP8 with its `weight_scale_inv` blocks; INT4 as compressed-tensors packs it
    (`weight_packed` int32 [out, in/8], `weight_scale` BF16 [out, in/group], `weight_shape` [2], core/int4.py)
    where the INT4 scheme does not ignore it; else BF16."""
    scheme = config.int4
    if scheme is not None:
        if not scheme.quantizes(name):
            return [TensorSpec(f"{name}.weight", (out_features, in_features), BF16, "proj")]
        if in_features % scheme.group:
            raise K2Error(f"config: quantization_config group_size {scheme.group} does not divide the input width "
                          f"{in_features} of {name}.weight_packed")
        return [
            TensorSpec(f"{name}.weight_packed", (out_features, in_features // 8), I32, "int4"),
            TensorSpec(f"{name}.weight_scale", (out_features, in_features // scheme.group), BF16, "int4_scale"),
            TensorSpec(f"{name}.weight_shape", (2,), I64, "int4_shape"),
        ]
    block = config.fp8_block
    if block is None:
        return [TensorSpec(f"{name}.weight", (out_features, in_features), BF16, "proj")]
    scale_shape = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
    return [
        TensorSpec(f"{name}.weight", (out_features, in_features), FP8, "proj"),
        TensorSpec(f"{name}.weight_scale_inv", scale_shape, F32, "scale"),
    ]


def mlp(config: ModelConfig, prefix: str, width: int) -> list[TensorSpec]:
    hidden = config.hidden_size
    return [
        *projection(config, f"{prefix}.gate_proj", width, hidden),
        *projection(config, f"{prefix}.up_proj", width, hidden),
        *projection(config, f"{prefix}.down_proj", hidden, width),
    ]


def attention(config: ModelConfig, prefix: str) -> list[TensorSpec]:
    c = config
    heads, hidden = c.num_attention_heads, c.hidden_size
    specs: list[TensorSpec] = []
    if c.q_lora_rank is None:
        specs += projection(c, f"{prefix}.q_proj", heads * c.qk_head_dim, hidden)
    else:
        specs += projection(c, f"{prefix}.q_a_proj", c.q_lora_rank, hidden)
        specs.append(TensorSpec(f"{prefix}.q_a_layernorm.weight", (c.q_lora_rank,), BF16, "norm"))
        specs += projection(c, f"{prefix}.q_b_proj", heads * c.qk_head_dim, c.q_lora_rank)
    specs += projection(c, f"{prefix}.kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, hidden)
    specs.append(TensorSpec(f"{prefix}.kv_a_layernorm.weight", (c.kv_lora_rank,), BF16, "norm"))
    specs += projection(c, f"{prefix}.kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    specs += projection(c, f"{prefix}.o_proj", hidden, heads * c.v_head_dim)
    return specs


def routed_expert(config: ModelConfig, layer: int, expert: int) -> list[TensorSpec]:
    return mlp(config, f"model.layers.{layer}.mlp.experts.{expert}", config.moe_intermediate_size)


def layer_tensors(config: ModelConfig, layer: int, routed: bool = True) -> list[TensorSpec]:
    """In checkpoint order; routed=False: all but the routed experts (`routed_expert` gives those one by one)."""
    c = config
    p = f"model.layers.{layer}"
    specs = [
        TensorSpec(f"{p}.input_layernorm.weight", (c.hidden_size,), BF16, "norm"),
        *attention(c, f"{p}.self_attn"),
        TensorSpec(f"{p}.post_attention_layernorm.weight", (c.hidden_size,), BF16, "norm"),
    ]
    if not c.is_moe_layer(layer):
        return specs + mlp(c, f"{p}.mlp", c.intermediate_size)
    specs += [
        TensorSpec(f"{p}.mlp.gate.weight", (c.n_routed_experts, c.hidden_size), BF16, "router"),
        TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (c.n_routed_experts,), F32, "bias"),
    ]
    for expert in range(c.n_routed_experts if routed else 0):
        specs += routed_expert(c, layer, expert)
    if c.n_shared_experts:
        specs += mlp(c, f"{p}.mlp.shared_experts", c.moe_intermediate_size * c.n_shared_experts)
    return specs


def embedding_tensors(config: ModelConfig) -> list[TensorSpec]:
    return [TensorSpec("model.embed_tokens.weight", (config.vocab_size, config.hidden_size), BF16, "embedding")]


def head_tensors(config: ModelConfig) -> list[TensorSpec]:
    return [
        TensorSpec("model.norm.weight", (config.hidden_size,), BF16, "norm"),
        TensorSpec("lm_head.weight", (config.vocab_size, config.hidden_size), BF16, "head"),
    ]


def all_tensors(config: ModelConfig) -> list[TensorSpec]:
    """In checkpoint order: embedding, layers 0..L-1, final norm and head."""
    specs = embedding_tensors(config)
    for layer in range(config.num_hidden_layers):
        specs += layer_tensors(config, layer)
    return specs + head_tensors(config)


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name
