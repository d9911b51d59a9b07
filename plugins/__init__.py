"""Custom ops (MoE routing, MoE dispatch, absorbed MLA attention, the cpu target's int8 ops), each in its
own file with every face: the eager implementation, its one declaration (an `OpSpec`, plugins/op_spec.py)
from which the torch.library op and its fake kernel (what torch.export traces), the ONNX lowering to
one node of the `k2deploy` domain and the TensorRT plugin(s) come, and the ONNX function body ONNX
Runtime runs."""

from __future__ import annotations

import onnx
import torch

from ..core.config import ModelConfig
from .experts import EXPERTS, moe_experts, moe_experts_down_function, moe_experts_function, moe_experts_up_function
from .int4 import EXPERTS_INT4, moe_experts_int4, moe_experts_int4_onnx
from .int8 import EXPERTS_INT8, LINEAR_INT8, linear_int8, linear_int8_onnx, moe_experts_int8, moe_experts_int8_onnx
from .mla import (ATTENTION, ATTENTION_INT8_CACHE, mla_attention, mla_attention_function, mla_attention_int8_cache,
                  mla_attention_int8_cache_function)
from .onnx_domain import DOMAIN, VERSION
from .op_spec import OpSpec
from .routing import ROUTE, moe_route, moe_route_function

__all__ = ["DOMAIN", "OPS", "VERSION", "moe_experts", "mla_attention", "moe_route", "mla_attention_int8_cache",
           "linear_int8", "moe_experts_int8", "moe_experts_int4", "onnx_functions", "split_functions", "translation_table"]

# every custom op's declaration (plugins/op_spec.py), from which its torch op, ONNX node and TensorRT plugin(s)
# come; the two plugins a TensorRT copy runs MoeExperts as are EXPERTS.split_into
OPS: tuple[OpSpec, ...] = (ROUTE, EXPERTS, ATTENTION, ATTENTION_INT8_CACHE, LINEAR_INT8, EXPERTS_INT8, EXPERTS_INT4)


def translation_table() -> dict:
    """torch op -> ONNX lowering, for torch.onnx.export(custom_translation_table=...): one `k2deploy` node each,
    or ONNX Runtime's contrib ops for the int8 ones."""
    return {
        torch.ops.k2deploy.moe_route.default: ROUTE.onnx_lowering(),
        torch.ops.k2deploy.moe_experts.default: EXPERTS.onnx_lowering(),
        torch.ops.k2deploy.mla_attention.default: ATTENTION.onnx_lowering(),
        torch.ops.k2deploy.mla_attention_int8_cache.default: ATTENTION_INT8_CACHE.onnx_lowering(),
        torch.ops.k2deploy.linear_int8.default: linear_int8_onnx,
        torch.ops.k2deploy.moe_experts_int8.default: moe_experts_int8_onnx,
        torch.ops.k2deploy.moe_experts_int4.default: moe_experts_int4_onnx,
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
