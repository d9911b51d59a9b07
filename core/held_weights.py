"""How a plan holds the model's weights (`plan --weights`): the bytes of each decoder layer, the embedding and the
head in one of three formats, by formula from the config (checkpoint.layout's tensors, converted).

  stored  as the checkpoint stores them: FP8 e4m3 projections [out, in] at 1 byte per value plus one float32 scale
          per 128x128 block, BF16 norms, router, embedding and head, a float32 correction bias
  int8    what the cpu target lowers them to (export/passes.py, int8_weights): a projection [out, in] whose input
          dim an int8 block b = int8_block(in) divides as uint8 codes plus one float32 scale per b values:
          out x in x (1 + 4 / b) bytes (out rounded up to whole tiles of 64 rows, as the cpu target holds them); the head (BF16 in the checkpoint) too; the routed experts with the one
          block b = int8_block(hidden, moe_intermediate) of QMoE; kv_b_proj, with the int8 cache, as W_UK
          [h, d, c] and W_UV [h, c, v] int8 with one float32 scale per output column per head:
          h x (d x c + c x v) + 4 x h x (c + v) bytes (with another cache it stays FP8); a projection no block
          divides, the norms, router, bias and embedding as stored
  int4    the routed experts as 4-bit codes in groups of 32 along the input dim with one float32 scale per group
          (Kimi-K2-Thinking's codes as ONNX Runtime's 4-bit QMoE takes them, export/graph_modules.py):
          out x ceil(in / 2) + 4 x out x ceil(in / 32) bytes, i.e. 0.5 + 4 / 32 bytes per value; everything else
          as int8. An INT4 checkpoint's experts are held so by every format but `stored` (BF16 scales there)
"""

from __future__ import annotations

from dataclasses import dataclass

from . import native_tiles
from .checkpoint import layout
from .checkpoint.layout import BF16, F32, TensorSpec
from .config import ModelConfig
from .errors import K2Error
from .quant_blocks import INT4_GROUP, int8_block

WEIGHTS = ("stored", "int8", "int4")
U8 = "U8"  # uint8 codes: int8 with zero point 128, or two 4-bit codes per byte
DTYPE_BYTES = {layout.FP8: 1, BF16: 2, F32: 4, U8: 1, layout.I32: 4, layout.I64: 8}


def tensor_bytes(spec: TensorSpec) -> int:
    return spec.numel * DTYPE_BYTES[spec.dtype]


def _held_rows(name: str, rows: int) -> int:
    """A projection's rows as the cpu target holds them, in whole tiles of the native step (core/native_tiles.py);
    a routed expert's gate and up rows are one weight of twice the rows, interleaved, tiled as one."""
    paired = layout.is_routed_expert(name) and name.rsplit(".", 2)[-2] in ("gate_proj", "up_proj")
    return native_tiles.tiles(2 * rows if paired else rows) * native_tiles.TILE // (2 if paired else 1)


def _int8(name: str, rows: int, in_features: int, block: int) -> list[TensorSpec]:
    return [TensorSpec(f"{name}.weight_int8", (rows, in_features), U8, "proj"),
            TensorSpec(f"{name}.weight_int8_scale", (rows, in_features // block), F32, "scale")]


def _int4(name: str, rows: int, in_features: int) -> list[TensorSpec]:
    return [TensorSpec(f"{name}.weight_packed", (rows, -(-in_features // 2)), U8, "proj"),
            TensorSpec(f"{name}.weight_scale", (rows, -(-in_features // INT4_GROUP)), F32, "scale")]


def _absorbed_kv_b(config: ModelConfig, name: str) -> list[TensorSpec]:
    h, d, v, c = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    return [TensorSpec(f"{name}.w_uk_int8", (h, d, c), U8, "proj"),
            TensorSpec(f"{name}.w_uk_scale", (h, 1, c), F32, "scale"),
            TensorSpec(f"{name}.w_uv_int8", (h, c, v), U8, "proj"),
            TensorSpec(f"{name}.w_uv_scale", (h, 1, v), F32, "scale")]


def held_tensors(config: ModelConfig, specs: list[TensorSpec], weights: str, cache_format: str) -> list[TensorSpec]:
    """The checkpoint's tensors `specs` as `weights` holds them (see the module doc)."""
    if weights == "stored":
        return list(specs)
    scales = {s.name.removesuffix("_scale_inv"): s for s in specs if s.role == "scale"}
    expert_block = int8_block(config.hidden_size, config.moe_intermediate_size)
    held = []
    for spec in specs:
        if spec.role in ("scale", "int4_scale", "int4_shape"):
            continue
        if spec.role == "int4":  # an INT4 checkpoint's own codes, their scales widened for QMoE
            held += _int4(spec.name.removesuffix(".weight_packed"), _held_rows(spec.name, spec.shape[0]),
                          spec.shape[1] * 8)
            continue
        if spec.role not in ("proj", "head"):
            held.append(spec)
            continue
        name, (out_features, in_features) = spec.name.removesuffix(".weight"), spec.shape
        routed = layout.is_routed_expert(spec.name)
        block = expert_block if routed else int8_block(in_features)
        rows = _held_rows(spec.name, out_features)
        if routed and weights == "int4":
            held += _int4(name, rows, in_features)
        elif name.endswith(".kv_b_proj"):
            held += _absorbed_kv_b(config, name) if cache_format == "int8" else [spec, *_scale(scales, spec)]
        elif block is None:
            held += [spec, *_scale(scales, spec)]
        else:
            held += _int8(name, rows, in_features, block)
    return held


def _scale(scales: dict[str, TensorSpec], spec: TensorSpec) -> list[TensorSpec]:
    """The block scales of a projection kept as stored (none for a BF16 one)."""
    return [scales[spec.name]] if spec.name in scales else []


@dataclass(frozen=True)
class LayerBytes:
    """One decoder layer's weights as held, in bytes."""
    fixed: int  # every tensor but the routed experts: norms, attention, the dense MLP or router, bias, shared experts
    expert: int  # one routed expert (0 in a dense layer)
    experts: int  # routed experts in the layer (0 in a dense layer)

    @property
    def total(self) -> int:
        return self.fixed + self.experts * self.expert


@dataclass(frozen=True)
class ModelBytes:
    """The model's weights as one format holds them: per decoder layer, the embedding, the final norm and head."""
    weights: str
    layers: tuple[LayerBytes, ...]
    embedding: int
    head: int

    @property
    def total(self) -> int:
        return self.embedding + sum(layer.total for layer in self.layers) + self.head

    @classmethod
    def of(cls, config: ModelConfig, weights: str = "stored", cache_format: str = "fp8") -> ModelBytes:
        if weights not in WEIGHTS:
            raise K2Error(f"--weights {weights}: choose one of {', '.join(WEIGHTS)}")

        def size(specs: list[TensorSpec]) -> int:
            return sum(tensor_bytes(s) for s in held_tensors(config, specs, weights, cache_format))

        def layer(i: int) -> LayerBytes:  # a layer's sizes depend on its index only through dense or MoE
            specs = layout.layer_tensors(config, i)
            fixed = size([s for s in specs if not layout.is_routed_expert(s.name)])
            if not config.is_moe_layer(i):
                return LayerBytes(fixed, 0, 0)
            expert = size(layout.mlp(config, f"model.layers.{i}.mlp.experts.0", config.moe_intermediate_size))
            return LayerBytes(fixed, expert, config.n_routed_experts)

        kinds: dict[bool, LayerBytes] = {}
        layers = []
        for i in range(config.num_hidden_layers):
            moe = config.is_moe_layer(i)
            if moe not in kinds:
                kinds[moe] = layer(i)
            layers.append(kinds[moe])
        return cls(weights, tuple(layers), size(layout.embedding_tensors(config)), size(layout.head_tensors(config)))
