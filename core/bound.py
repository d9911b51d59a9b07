"""The memory-bandwidth bound of one decode step: bytes it must read / the machine's bandwidth.

Bytes read by one decode step of `batch` rows at `context` cached tokens (sizes from the
checkpoint layout the artifact's weights copy byte for byte: FP8 projections at 1 byte per
value plus their float32 128x128 block scales, BF16 norms, router, embedding and head):

  embedding   one row per sequence: batch x hidden x 2 bytes
  each layer  attention and norms; the dense MLP (dense layers) or the router, the shared
              expert and the routed experts chosen (MoE layers)
  head        final norm and the whole lm_head (every vocabulary row is read)
  cache       batch x context x (cache bytes per token per layer) x layers

Weights in another format (`plan --weights int8|int4`, core/held_weights.py) are read at their
held sizes; the embedding rows stay BF16 in every format.

Routed experts read at batch 1: exactly k of e. At batch b the rows choose independently, so
the distinct experts read are expected to be e x (1 - (1 - k/e)^b) (uniform routing assumed;
at most e); of a shard of s of the e experts (one device under expert parallelism), each expert
is chosen by a row with probability k/e, so s x (1 - (1 - k/e)^b) of them. The bound counts
each byte read once per step and nothing written: a lower bound on the step time no
implementation can beat on this memory system.
"""

from __future__ import annotations

from .checkpoint import layout
from .config import ModelConfig
from .held_weights import DTYPE_BYTES, ModelBytes


def expected_shard_experts(config: ModelConfig, batch: int, shard: int) -> float:
    """Distinct experts of a shard of `shard` routed experts that `batch` rows choose: shard x (1 - (1 - k/e)^batch)."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return min(float(shard), shard * (1 - (1 - k / e) ** max(batch, 1)))


def expected_experts(config: ModelConfig, batch: int) -> float:
    """Distinct routed experts `batch` rows choose in one layer: exactly k at batch 1, e x (1 - (1 - k/e)^batch)."""
    if batch <= 1:
        return float(config.num_experts_per_tok)
    return expected_shard_experts(config, batch, config.n_routed_experts)


def layer_read_bytes(config: ModelConfig, layer: int, batch: int = 1, held: ModelBytes | None = None) -> float:
    """Weight bytes one decode step reads in one decoder layer (`held`: the weights' format, default as stored)."""
    sizes = (held or ModelBytes.of(config)).layers[layer]
    return sizes.fixed + (expected_experts(config, batch) * sizes.expert if sizes.experts else 0)


def decode_step_bytes(config: ModelConfig, cache_bytes_per_token_per_layer: int, batch: int, context: float,
                      held: ModelBytes | None = None) -> dict:
    """{embedding, layers: [...], head, weights, cache, total} bytes read by one decode step."""
    held = held or ModelBytes.of(config)
    embedding = batch * config.hidden_size * DTYPE_BYTES[layout.BF16]
    layers = [layer_read_bytes(config, i, batch, held) for i in range(config.num_hidden_layers)]
    weights = embedding + sum(layers) + held.head
    cache = batch * context * cache_bytes_per_token_per_layer * config.num_hidden_layers
    return {"embedding": embedding, "layers": layers, "head": held.head, "weights": weights, "cache": cache,
            "total": weights + cache, "experts_per_moe_layer": expected_experts(config, batch)}

