"""The memory-bandwidth bound of one decode step: bytes it must read / the machine's bandwidth.

Bytes read by one decode step of `batch` rows at `context` cached tokens (sizes from the
checkpoint layout the artifact's weights copy byte for byte: FP8 projections at 1 byte per
value plus their float32 128x128 block scales, BF16 norms, router, embedding and head):

  embedding   one row per sequence: batch x hidden x 2 bytes
  each layer  attention and norms; the dense MLP (dense layers) or the router, the shared
              expert and the routed experts chosen (MoE layers)
  head        final norm and the whole lm_head (every vocabulary row is read)
  cache       batch x context x (cache bytes per token per layer) x layers

Routed experts read at batch 1: exactly k of e. At batch b the rows choose independently, so
the distinct experts read are expected to be e x (1 - (1 - k/e)^b) (uniform routing assumed;
at most e). The bound counts each byte read once per step and nothing written: a lower bound
on the step time no implementation can beat on this memory system.
"""

from __future__ import annotations

from .checkpoint import layout
from .config import ModelConfig

DTYPE_BYTES = {layout.FP8: 1, layout.BF16: 2, layout.F32: 4, layout.I32: 4, layout.I64: 8}


def tensor_bytes(spec: layout.TensorSpec) -> int:
    return spec.numel * DTYPE_BYTES[spec.dtype]


def expected_experts(config: ModelConfig, batch: int) -> float:
    e, k = config.n_routed_experts, config.num_experts_per_tok
    if batch <= 1:
        return float(k)
    return min(float(e), e * (1 - (1 - k / e) ** batch))


def layer_read_bytes(config: ModelConfig, layer: int, batch: int = 1) -> float:
    """Weight bytes one decode step reads in one decoder layer."""
    specs = layout.layer_tensors(config, layer)
    fixed = sum(tensor_bytes(s) for s in specs if not layout.is_routed_expert(s.name))
    if not config.is_moe_layer(layer):
        return float(fixed)
    per_expert = sum(tensor_bytes(s) for s in layout.mlp(config, f"model.layers.{layer}.mlp.experts.0",
                                                          config.moe_intermediate_size))
    return fixed + expected_experts(config, batch) * per_expert


def decode_step_bytes(config: ModelConfig, cache_bytes_per_token_per_layer: int, batch: int, context: float) -> dict:
    """{embedding, layers: [...], head, weights, cache, total} bytes read by one decode step."""
    embedding = batch * config.hidden_size * DTYPE_BYTES[layout.BF16]
    layers = [layer_read_bytes(config, i, batch) for i in range(config.num_hidden_layers)]
    head = sum(tensor_bytes(s) for s in layout.head_tensors(config))
    weights = embedding + sum(layers) + head
    cache = batch * context * cache_bytes_per_token_per_layer * config.num_hidden_layers
    return {"embedding": embedding, "layers": layers, "head": head, "weights": weights, "cache": cache,
            "total": weights + cache, "experts_per_moe_layer": expected_experts(config, batch)}


def resident_weight_bytes(config: ModelConfig) -> int:
    """Every weight byte of the model in the checkpoint's formats (what the artifact's .data files hold)."""
    return sum(tensor_bytes(s) for s in layout.all_tensors(config))
