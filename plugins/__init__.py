"""Custom ops (MoE routing, MoE dispatch, absorbed MLA attention), each defined once with every face:
the eager implementation, the torch.library op and its fake kernel (what torch.export traces), the
ONNX lowering to one node of the `k2deploy` domain, and the ONNX function body ONNX Runtime runs."""

from __future__ import annotations

import onnx
import torch

from ..core.config import ModelConfig
from .int8 import linear_int8, linear_int8_onnx, moe_experts_int8, moe_experts_int8_onnx
from .experts import moe_experts, moe_experts_down_function, moe_experts_function, moe_experts_onnx, moe_experts_up_function
from .mla import (mla_attention, mla_attention_function, mla_attention_int8_cache, mla_attention_int8_cache_function,
                  mla_attention_int8_cache_onnx, mla_attention_onnx)
from .onnx_domain import DOMAIN, VERSION
from .routing import moe_route, moe_route_function, moe_route_onnx

__all__ = ["DOMAIN", "VERSION", "moe_experts", "mla_attention", "moe_route", "mla_attention_int8_cache", "linear_int8", "moe_experts_int8", "onnx_functions", "split_functions",
           "translation_table"]


def translation_table() -> dict:
    """torch op -> ONNX lowering, for torch.onnx.export(custom_translation_table=...)."""
    return {
        torch.ops.k2deploy.moe_route.default: moe_route_onnx,
        torch.ops.k2deploy.moe_experts.default: moe_experts_onnx,
        torch.ops.k2deploy.mla_attention.default: mla_attention_onnx,
        torch.ops.k2deploy.mla_attention_int8_cache.default: mla_attention_int8_cache_onnx,
        torch.ops.k2deploy.linear_int8.default: linear_int8_onnx,
        torch.ops.k2deploy.moe_experts_int8.default: moe_experts_int8_onnx,
    }


def _block(config: ModelConfig) -> int:
    return config.fp8_block[0] if config.fp8_block else 128


def onnx_functions(config: ModelConfig) -> list[onnx.FunctionProto]:
    """The function bodies of every custom node, for this model's dimensions and settings."""
    block = _block(config)
    return [
        moe_route_function(config.num_experts_per_tok, config.n_group, config.topk_group, config.norm_topk_prob,
                           config.routed_scaling_factor),
        moe_experts_function(config.n_routed_experts, config.moe_intermediate_size, config.hidden_size, block),
        mla_attention_function(config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim,
                               config.softmax_scale),
        mla_attention_int8_cache_function(config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim,
                                          config.softmax_scale),
    ]


def split_functions(config: ModelConfig) -> list[onnx.FunctionProto]:
    """The bodies of the two plugins a TensorRT copy runs MoeExperts as (MoeExpertsUp, MoeExpertsDown):
    with these, ONNX Runtime runs a TensorRT copy of a graph, to check it against the original."""
    f, m, block = config.moe_intermediate_size, config.hidden_size, _block(config)
    return [moe_experts_up_function(f, m, block), moe_experts_down_function(f, m, block)]
