"""The model configuration, read from a checkpoint's config.json and checked before use.

Fields and defaults follow the released Kimi K2 config.json (DeepSeek-V3 layout). A field
that decides a tensor's shape or the maths has no default: a checkpoint that lacks it is
rejected with the field's name, rather than silently run with a guessed value.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from . import int4
from .errors import K2Error
from .json_files import read_json

SUPPORTED_MODEL_TYPES = ("kimi_k2", "deepseek_v3")


# The largest value each size may take (Kimi K2's in comments), generous for later models yet small enough that
# nothing proportional to them is allocated or looped over for minutes before a config is refused.
SIZE_LIMITS = {
    "vocab_size": 1 << 22,  # 163,840
    "hidden_size": 1 << 16,  # 7,168
    "num_hidden_layers": 1024,  # 61
    "intermediate_size": 1 << 18,  # 18,432
    "moe_intermediate_size": 1 << 18,  # 2,048
    "n_routed_experts": 4096,  # 384
    "n_shared_experts": 64,  # 1
    "num_experts_per_tok": 256,  # 8
    "n_group": 4096,  # 1
    "topk_group": 4096,  # 1
    "num_attention_heads": 1024,  # 64
    "num_key_value_heads": 1024,  # 64
    "q_lora_rank": 1 << 16,  # 1,536
    "kv_lora_rank": 1 << 16,  # 512
    "qk_nope_head_dim": 4096,  # 128
    "qk_rope_head_dim": 4096,  # 64
    "v_head_dim": 4096,  # 128
    "max_position_embeddings": 1 << 24,  # 131,072
    "moe_layer_freq": 1024,  # 1
    "num_nextn_predict_layers": 64,  # 0 (K2's checkpoint holds no MTP layer)
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    first_k_dense_replace: int  # layers [0, first_k_dense_replace) are dense, the rest MoE
    intermediate_size: int  # dense MLP width
    moe_intermediate_size: int  # width of one routed or shared expert
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int  # routing first keeps topk_group of n_group expert groups
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int | None  # None: a plain q_proj instead of q_a_proj/q_b_proj
    kv_lora_rank: int  # c: the latent the cache holds
    qk_nope_head_dim: int  # d of the keys' non-rope part
    qk_rope_head_dim: int  # r: rope part, one head shared by all
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None  # YaRN: type, factor, original_max_position_embeddings, beta_*, mscale*
    quantization_config: dict | None = None  # fp8 e4m3 with weight_block_size, compressed-tensors INT4, or None: BF16
    hidden_act: str = "silu"
    moe_layer_freq: int = 1
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict)  # every other key of config.json, kept for round trips

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise K2Error(f"{source}: expected a JSON object")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise K2Error(
                f"{source}: unsupported model_type {model_type!r}; this tool reads "
                f"{' and '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
            )
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        values: dict[str, Any] = {}
        for name, f in known.items():
            if name in raw:
                values[name] = _coerce(name, raw[name], f.type, source)
            elif f.default is dataclasses.MISSING and name != "q_lora_rank":
                raise K2Error(f"{source}: missing field {name!r}")
        values.setdefault("q_lora_rank", None)
        values["extra"] = {k: v for k, v in raw.items() if k not in known}
        config = cls(**values)
        config.validate(source)
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        raw = read_json(path, "not found; a checkpoint directory holds a config.json")
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        out.update(self.extra)
        return dict(sorted(out.items()))

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with fields changed, validated again."""
        raw = self.to_dict()
        raw.update(changes)
        return ModelConfig.from_dict(raw, source="config")

    def validate(self, source: str = "config.json") -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise K2Error(f"{source}: field {name!r} {why}")

        for name, most in SIZE_LIMITS.items():  # checked first: later checks and every allocation trust them
            value = getattr(self, name)
            if name == "q_lora_rank" and value is None:
                continue
            least = 0 if name in ("n_shared_experts", "num_nextn_predict_layers") else 1
            need(least <= value <= most, name, f"must lie in [{least}, {most:,}], got {value:,}")
        for name in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
            value = getattr(self, name)
            need(math.isfinite(value) and value > 0, name, f"must be a finite positive number, got {value}")
        need(self.rms_norm_eps < 1, "rms_norm_eps", f"must be below 1, got {self.rms_norm_eps}")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"must lie in [0, num_hidden_layers={self.num_hidden_layers}]")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})")
        need(self.n_routed_experts % self.n_group == 0, "n_group",
             f"({self.n_group}) does not divide n_routed_experts ({self.n_routed_experts})")
        need(self.topk_group <= self.n_group, "topk_group", f"({self.topk_group}) exceeds n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        need(self.num_experts_per_tok <= self.topk_group * per_group, "num_experts_per_tok",
             f"({self.num_experts_per_tok}) exceeds the experts in topk_group groups ({self.topk_group * per_group})")
        need(self.n_group == 1 or per_group >= 2, "n_group", "leaves fewer than 2 experts per group")
        need(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads",
             "must equal num_attention_heads for MLA")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        need(self.scoring_func == "sigmoid", "scoring_func", f"is {self.scoring_func!r}; only 'sigmoid' is supported")
        need(self.topk_method == "noaux_tc", "topk_method", f"is {self.topk_method!r}; only 'noaux_tc' is supported")
        need(self.hidden_act == "silu", "hidden_act", f"is {self.hidden_act!r}; only 'silu' is supported")
        need(self.moe_layer_freq == 1, "moe_layer_freq", "must be 1")
        need(not self.attention_bias, "attention_bias", "must be false")
        need(not self.tie_word_embeddings, "tie_word_embeddings", "must be false (Kimi K2 has its own lm_head)")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            need(value is None or 0 <= value < self.vocab_size, name, f"({value}) is outside the vocabulary")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type", self.rope_scaling.get("rope_type"))
            need(kind == "yarn", "rope_scaling", f"type is {kind!r}; only 'yarn' is supported")
            for key in ("factor", "original_max_position_embeddings"):
                need(key in self.rope_scaling, "rope_scaling", f"lacks {key!r}")
            for key, value in self.rope_scaling.items():
                need(not isinstance(value, float) or math.isfinite(value), "rope_scaling", f"{key} is {value}")
            need(_is_number(self.rope_scaling["factor"]) and 1 <= self.rope_scaling["factor"] <= 1024, "rope_scaling",
                 f"factor must be a number in [1, 1024], got {self.rope_scaling['factor']!r}")
            original = self.rope_scaling["original_max_position_embeddings"]
            need(isinstance(original, int) and 0 < original <= SIZE_LIMITS["max_position_embeddings"], "rope_scaling",
                 f"original_max_position_embeddings must be a positive integer, got {original!r}")
        if self.quantization_config is not None:
            q = self.quantization_config
            method = q.get("quant_method")
            need(method in ("fp8", int4.QUANT_METHOD), "quantization_config",
                 f"quant_method is {method!r}; only 'fp8' and {int4.QUANT_METHOD!r} (INT4 pack-quantized) are supported")
            if method == int4.QUANT_METHOD:
                int4.parse_scheme(q, source)
                return
            need(q.get("fmt", "e4m3") == "e4m3", "quantization_config", f"fmt is {q.get('fmt')!r}; only 'e4m3' is supported")
            block = q.get("weight_block_size")
            need(isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
                 "quantization_config", f"weight_block_size must be two positive integers, got {block!r}")

    # -- derived quantities ---------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """The FP8 weights' block (rows, cols); None when the checkpoint is BF16 or INT4."""
        if self.quantization_config is None or self.int4 is not None:
            return None
        rows, cols = self.quantization_config["weight_block_size"]
        return rows, cols

    @cached_property
    def int4(self) -> int4.Int4Scheme | None:
        """The INT4 scheme of a compressed-tensors checkpoint (core/int4.py); None for FP8 and BF16 ones."""
        q = self.quantization_config
        if q is None or q.get("quant_method") != int4.QUANT_METHOD:
            return None
        return int4.parse_scheme(q, "config")

    @property
    def weight_format(self) -> str:
        """How the checkpoint stores its projections: fp8, int4 (routed experts, the rest BF16) or bf16."""
        return "int4" if self.int4 is not None else "fp8" if self.quantization_config is not None else "bf16"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None:
            all_dim = self.rope_scaling.get("mscale_all_dim", 0)
            if all_dim:
                mscale = yarn_mscale(self.rope_scaling["factor"], all_dim)
                scale *= mscale * mscale
        return scale


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _coerce(name: str, value: Any, annotation: Any, source: str) -> Any:
    """Checks a JSON value against the field's annotation (strings under `from __future__`)."""
    kind = str(annotation)
    if value is None and "None" in kind:
        return None
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise K2Error(f"{source}: field {name!r} must be an integer, got {value!r}")
        return value
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise K2Error(f"{source}: field {name!r} must be a number, got {value!r}")
        return float(value)
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise K2Error(f"{source}: field {name!r} must be true or false, got {value!r}")
        return value
    if kind.startswith("str"):
        if not isinstance(value, str):
            raise K2Error(f"{source}: field {name!r} must be a string, got {value!r}")
        return value
    if kind.startswith("dict"):
        if not isinstance(value, dict):
            raise K2Error(f"{source}: field {name!r} must be an object, got {value!r}")
        return value
    return value
