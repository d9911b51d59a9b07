"""Parameter counts and KV-cache bytes: from the config by formula, and from tensor headers.

The two must agree for every checkpoint this project writes (a test holds them together);
the header count is what `inspect` reports for a checkpoint it did not write.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cache_format import CacheFormat
from .config import ModelConfig

# prompt tokens per sequence in one step: the runtime's prefill chunk (it bounds how long one step holds the
# decoding sequences back), and the activations a plan sizes for
PREFILL_CHUNK = 512
MIN_PREFILL_CHUNK = 64  # fewer rows prefill together rather than each with a chunk smaller than this
# the largest float32 attention scores [rows, s * heads, keys] one prefill forward may make: the chunk shrinks as
# the context grows, so that a prefill's transient memory stays flat however long the prompt (the attention
# holds a few tensors of this size at once)
ATTENTION_SCORES_BYTES = 16 << 20
LIVE_SCORE_TENSORS = 4  # score-sized tensors the attention holds at once (scores, masked, probabilities, quantised)


def attention_workspace_bytes() -> int:
    """The attention's transient memory in one forward, whatever the context: what `plan` counts."""
    return LIVE_SCORE_TENSORS * ATTENTION_SCORES_BYTES


def prefill_chunk(rows: int, heads: int, past: int, budget: int | None = ATTENTION_SCORES_BYTES) -> int:
    """Prompt tokens per row in one prefill forward of `rows` rows after `past` cached positions: PREFILL_CHUNK,
    halved until the scores [rows, s * heads, past + s] float32 fit `budget` bytes (at least 1); budget None: a
    model whose attention's memory does not grow with the chunk (the native step's row tiles), PREFILL_CHUNK."""
    size = PREFILL_CHUNK
    while budget is not None and size > 1 and rows * size * heads * (past + size) * 4 > budget:
        size //= 2
    return size


@dataclass(frozen=True)
class ParameterCount:
    total: int
    active_per_token: int  # embedding and head included; routed experts counted k of E


def attention_parameters(c: ModelConfig) -> int:
    if c.q_lora_rank is None:
        q = c.hidden_size * c.num_attention_heads * c.qk_head_dim
    else:
        q = c.hidden_size * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.num_attention_heads * c.qk_head_dim
    kv = c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
    kv += c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
    out = c.num_attention_heads * c.v_head_dim * c.hidden_size
    return q + kv + out


def expert_parameters(c: ModelConfig) -> int:
    return 3 * c.hidden_size * c.moe_intermediate_size


def count_parameters(c: ModelConfig) -> ParameterCount:
    """Every stored tensor but the FP8 block scales."""
    embedding_and_head = 2 * c.vocab_size * c.hidden_size + c.hidden_size
    total = active = embedding_and_head
    for layer in range(c.num_hidden_layers):
        common = 2 * c.hidden_size + attention_parameters(c)
        if not c.is_moe_layer(layer):
            dense = common + 3 * c.hidden_size * c.intermediate_size
            total, active = total + dense, active + dense
            continue
        shared = common + c.n_routed_experts * (c.hidden_size + 1) + c.n_shared_experts * expert_parameters(c)
        total += shared + c.n_routed_experts * expert_parameters(c)
        active += shared + c.num_experts_per_tok * expert_parameters(c)
    return ParameterCount(total, active)


def kv_cache_bytes_per_token(c: ModelConfig) -> dict[str, int]:
    """Bytes one token occupies in one layer's cache, by cache format (the latent ones as the artifacts hold them)."""
    # keys [h, nope + rope] and values [h, v], as a plain MHA cache would hold them
    sizes = {"bf16_decompressed": c.num_attention_heads * (c.qk_head_dim + c.v_head_dim) * 2}
    return sizes | {f"{name}_latent": CacheFormat.for_config(c, name).bytes_per_token_per_layer
                    for name in ("bf16", "fp8", "int8")}
