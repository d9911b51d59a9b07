"""Model configurations the synthetic checkpoint writer knows by name.

`k2` is the released Kimi-K2-Instruct config.json. `tiny` keeps every structural feature
(dense first layer, MoE layers with a shared expert, sigmoid routing with a correction bias,
q_lora, FP8 blocks with partial edges, YaRN) at a size the test suite runs in seconds.
`small` has Kimi K2's attention dimensions and a 1024-wide model, for benchmarks. Each comes in Kimi-K2-Instruct's
FP8 layout or Kimi-K2-Thinking's INT4 one (`weights="int4"`).
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from ..config import ModelConfig
from ..errors import K2Error
from ..int4 import Int4Scheme

KIMI_K2 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 131072,
    "model_type": "kimi_k2",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

PRESET_CHANGES: dict[str, dict[str, Any]] = {
    "k2": {},
    "tiny": {
        "hidden_size": 192,  # 1.5 FP8 blocks: partial edge blocks on every input side
        "num_hidden_layers": 3,
        "intermediate_size": 320,
        "moe_intermediate_size": 96,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "vocab_size": 1024,
        "bos_token_id": 768,
        "eos_token_id": 769,
        "max_position_embeddings": 4096,
        "rope_scaling": {**KIMI_K2["rope_scaling"], "original_max_position_embeddings": 128},
    },
    "small": {
        "hidden_size": 1024,
        "num_hidden_layers": 4,
        "intermediate_size": 2816,
        "moe_intermediate_size": 256,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 384,
        "vocab_size": 32768,
        "bos_token_id": 32512,
        "eos_token_id": 32513,
    },
}

# Shards are cut at this many bytes, so that even `tiny` has several and a layer that spans two.
SHARD_BYTES = {"tiny": 1 << 20, "small": 1 << 28, "k2": 5 << 30}


# Kimi-K2-Thinking's INT4 layout: routed experts INT4 in groups of 32; attention, shared experts, the dense
# layer's MLP and the head stay BF16 (its config's `ignore` list).
K2_THINKING_INT4 = Int4Scheme(32, ("lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                   r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"))
WEIGHT_FORMATS = ("fp8", "int4")  # fp8: Kimi-K2-Instruct's layout; int4: Kimi-K2-Thinking's


def preset_config(name: str, layers: int | None = None, overrides: list[str] | tuple[str, ...] = (),
                  weights: str = "fp8") -> ModelConfig:
    """The preset's config in the checkpoint format `weights` (WEIGHT_FORMATS), then `overrides` applied."""
    if name not in PRESET_CHANGES:
        raise K2Error(f"unknown preset {name!r}; choose one of {', '.join(PRESET_CHANGES)}")
    if weights not in WEIGHT_FORMATS:
        raise K2Error(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    raw = json.loads(json.dumps(KIMI_K2))
    raw.update(json.loads(json.dumps(PRESET_CHANGES[name])))
    if weights == "int4":
        raw["quantization_config"] = K2_THINKING_INT4.to_dict()
    if layers is not None:
        raw["num_hidden_layers"] = layers
    for item in overrides:
        _apply_override(raw, item)
    if raw["model_type"] == "deepseek_v3" and not any(o.startswith(("bos_token_id=", "eos_token_id=")) for o in overrides):
        raw.update(bos_token_id=0, eos_token_id=1)  # DeepSeek-V3's tokenizer layout, as its synthetic one writes it
    return ModelConfig.from_dict(raw, source=f"preset {name}")


def _apply_override(raw: dict, item: str) -> None:
    """`key=value` or `outer.inner=value`; the value is read as JSON, else taken as a string."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise K2Error(f"--set {item!r}: expected key=value, e.g. n_routed_experts=384")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    *parents, leaf = key.split(".")
    target = raw
    for part in parents:
        if not isinstance(target.get(part), dict):
            raise K2Error(f"--set {item!r}: {part!r} is not an object field of the config")
        target = target[part]
    if leaf not in target:
        close = difflib.get_close_matches(leaf, list(target), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise K2Error(f"--set {item!r}: the config has no field {leaf!r}{hint}")
    target[leaf] = value
