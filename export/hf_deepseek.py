"""Builds Hugging Face transformers' DeepseekV3ForCausalLM from one of our checkpoints, as an
independent implementation to check the eager reference (k2deploy.export) against.

Our config.json says model_type "kimi_k2", which transformers' AutoConfig does not know, so the
DeepseekV3Config is built field by field from our ModelConfig; the weights are the very float32
arrays the reference loads (`Checkpoint.float32`, FP8 blocks dequantised), so any difference in
the logits comes from the maths, not from the weights.

What has to be mapped (transformers 5.x, checked against models/deepseek_v3/modeling_deepseek_v3.py):

* Routed experts are fused per layer: `mlp.experts.gate_up_proj` [e, 2f, m] is gate_proj rows then
  up_proj rows (the forward does `linear(x, gate_up_proj[e]).chunk(2)` -> gate, up), and
  `mlp.experts.down_proj` [e, m, f]. Every other tensor keeps its checkpoint name.
* RoPE: `rope_scaling` (with "type") becomes `rope_parameters` (with "rope_type" and "rope_theta");
  `rope_interleave=True` because the checkpoint's rope rows are interleaved pairs. transformers
  rotates (x[2i], x[2i+1]) but writes the result de-interleaved (evens then odds) while we write it
  back interleaved; q and k are permuted alike, so q.k, and hence the logits, do not change.
* Attention and experts use the "eager" implementations (no sdpa, no grouped_mm kernels).
* `num_nextn_predict_layers` is `num_mtp_layers` there (0: no MTP head).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from k2deploy.core.checkpoint import layout
from k2deploy.core.checkpoint.reader import Checkpoint
from k2deploy.core.config import ModelConfig, yarn_mscale

# transformers' YaRN reads these keys of rope_parameters; ours has "type" on top (dropped).
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def rope_parameters(config: ModelConfig) -> dict:
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    params = {"rope_type": "yarn", "rope_theta": config.rope_theta}
    params.update({k: config.rope_scaling[k] for k in YARN_KEYS if k in config.rope_scaling})
    # Our YaRN (like DeepSeek's own modeling code) scales cos/sin by
    # mscale(factor, mscale=1 by default) / mscale(factor, mscale_all_dim=0 by default).
    # transformers only takes that ratio when both are truthy and otherwise uses
    # mscale(factor, 1); pin its attention_factor where the two readings part.
    mscale, all_dim = config.rope_scaling.get("mscale", 1), config.rope_scaling.get("mscale_all_dim", 0)
    if not (mscale and all_dim):
        params["attention_factor"] = float(yarn_mscale(params["factor"], mscale) / yarn_mscale(params["factor"], all_dim))
    return params


def hf_config(config: ModelConfig) -> DeepseekV3Config:
    c = config
    # transformers' q_a_layernorm and kv_a_layernorm use their default eps (1e-6), not rms_norm_eps;
    # ours use rms_norm_eps. Equal for Kimi K2 and every preset.
    assert c.rms_norm_eps == 1e-6, "transformers hard-codes eps=1e-6 in the MLA latent norms"
    return DeepseekV3Config(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        n_shared_experts=c.n_shared_experts,
        n_routed_experts=c.n_routed_experts,
        routed_scaling_factor=c.routed_scaling_factor,
        kv_lora_rank=c.kv_lora_rank,
        q_lora_rank=c.q_lora_rank,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        qk_nope_head_dim=c.qk_nope_head_dim,
        n_group=c.n_group,
        topk_group=c.topk_group,
        num_experts_per_tok=c.num_experts_per_tok,
        first_k_dense_replace=c.first_k_dense_replace,
        norm_topk_prob=c.norm_topk_prob,
        hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
        attention_dropout=0.0,
        rope_parameters=rope_parameters(c),
        rope_interleave=True,
        num_mtp_layers=c.num_nextn_predict_layers,
        use_cache=False,
        attn_implementation="eager",
        experts_implementation="eager",
    )


def _tensor(checkpoint: Checkpoint, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(checkpoint.float32(name)))


def hf_state_dict(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor (scales folded in) under transformers' names, experts fused."""
    c = checkpoint.config
    state: dict[str, torch.Tensor] = {}
    for spec in layout.all_tensors(c):
        if spec.role == "scale" or layout.is_routed_expert(spec.name):
            continue
        state[spec.name] = _tensor(checkpoint, spec.name)
    for layer in range(c.num_hidden_layers):
        if not c.is_moe_layer(layer):
            continue
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for expert in range(c.n_routed_experts):
            gate, up, down_e = (_tensor(checkpoint, f"{prefix}.{expert}.{part}.weight") for part in EXPERT_PARTS)
            gate_up.append(torch.cat([gate, up], dim=0))  # [2f, m]: gate rows first, as .chunk(2) reads them
            down.append(down_e)  # [m, f]
        state[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        state[f"{prefix}.down_proj"] = torch.stack(down)
    return state


def _non_persistent_buffers(model: torch.nn.Module) -> set[str]:
    names = set()
    for module_name, module in model.named_modules():
        for buffer in module._non_persistent_buffers_set:
            names.add(f"{module_name}.{buffer}" if module_name else buffer)
    return names


def build_hf_model(checkpoint: Checkpoint) -> DeepseekV3ForCausalLM:
    """transformers' DeepseekV3ForCausalLM in float32 and eval mode, holding the checkpoint's weights."""
    c = checkpoint.config
    assert c.moe_layer_freq == 1  # transformers makes every layer from first_k_dense_replace on MoE
    config = hf_config(c)
    with torch.device("cpu"):
        model = DeepseekV3ForCausalLM(config).to(torch.float32)
    state = hf_state_dict(checkpoint)
    expected = set(model.state_dict())
    if not c.n_shared_experts:
        # transformers always builds a shared expert, of width 0 here: its empty weights add nothing.
        for name, value in model.state_dict().items():
            if ".mlp.shared_experts." in name:
                assert value.numel() == 0
                state[name] = torch.zeros_like(value)
    assert set(state) == expected, (
        f"state dict mismatch: missing {sorted(expected - set(state))[:8]}, unexpected {sorted(set(state) - expected)[:8]}"
    )
    result = model.load_state_dict(state, strict=False)
    allowed = _non_persistent_buffers(model)
    assert set(result.missing_keys) <= allowed, f"missing keys: {result.missing_keys}"
    assert not result.unexpected_keys, f"unexpected keys: {result.unexpected_keys}"
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    assert model.config._experts_implementation == "eager", model.config._experts_implementation
    return model.eval()
