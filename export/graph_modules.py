"""The modules the exporter traces: embedding, one decoder layer, final norm + head.

They hold the weights in the checkpoint's own formats (FP8 e4m3 with float32 block scales,
BF16 norms, router, embedding and head), so that each ONNX initializer is a byte-for-byte
copy of checkpoint tensors; `initializer_sources` names those tensors. They are built on the
`meta` device for tracing: no weight is in memory while a graph is exported.

The decoder layer is the reference's `model.Block`, built from the faces of the target and the cache
format: the target's passes (export/passes.py) choose its linears and routed experts and whether their int8 and
4-bit weights are held in the native step's tiles (export/tiled_buffers.py), and the cache format chooses the
attention op (plugins/mla.py `CACHE_ATTENTION`) and the form of kv_b_proj it reads.
`ExportLayer` adds only the cache I/O: the past entries gathered from the layer's pages in their stored format
(`page_table` [b, n] page ids into `<array>_pages` [pages, PAGE_SIZE, width], core/cache_format.py) and the
new ones quantised into it (`stored_entries`, the faces' `store`). The chunk's own entries are attended as
stored: read back from the stored form exactly as the past is, so that a text's logits are the same whatever
its chunking, prefix reuse or batching, to float rounding:
- fp8:  latent [t, b, c] e4m3 with one float32 scale per group of 128 values [t, b, c/128],
        rope [t, b, r] float16: 512 + 16 + 128 = 656 bytes per token per layer on Kimi K2.
- int8: the latent as int8 codes with one float32 scale per token (absmax / 127), each code q stored
        as the byte q + 128 [t, b, c] uint8: the cpu target's cache, which attention multiplies in
        integer arithmetic as it is stored (plugins/mla.py); 512 + 4 + 128 = 644 bytes on Kimi K2.
- bf16: latent [t, b, c] bfloat16, rope [t, b, r] float16 (1152 bytes on Kimi K2).
The gathered past is time-major, [n * PAGE_SIZE, b, width], as the attention ops take it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.cache_format import CODINGS, CacheArray, CacheFormat
from ..core import int4, native_tiles
from ..core.checkpoint.reader import Checkpoint
from ..core.config import ModelConfig
from ..plugins import mla
from ..plugins.fp8 import E4M3_VALUES, dequantize
from . import model
from .passes import Lowering
from .rope import inverse_frequencies
from .tiled_buffers import held_rows, hold


class Fp8Linear(nn.Module):
    """y = x W^T with W kept as e4m3 [out, in] and its float32 block scales `weight_scale_inv`."""

    def __init__(self, in_features: int, out_features: int, block: int):
        super().__init__()
        self.block = block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        blocks = (-(-out_features // block), -(-in_features // block))
        self.register_buffer("weight_scale_inv", torch.empty(blocks, dtype=torch.float32))

    def dequantized(self) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized())


class Bf16Linear(nn.Module):
    """y = x W^T with W kept as the checkpoint's BF16 [out, in] (an INT4 checkpoint's unquantised projections)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.bfloat16))

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized())


def checkpoint_linear(config: ModelConfig, in_features: int, out_features: int) -> nn.Module:
    """A projection as the checkpoint stores it: FP8 blocks, or BF16 beside an INT4 checkpoint's experts."""
    if config.fp8_block is None:
        return Bf16Linear(in_features, out_features)
    return Fp8Linear(in_features, out_features, config.fp8_block[0])


class Int8Linear(nn.Module):
    """y = x W^T with W kept as int8 blocks along the input dim (see plugins/int8.py): codes [out, in] and block
    scales [out, in / block], in the native step's tiles where `tiled` (export/tiled_buffers.py)."""

    def __init__(self, in_features: int, out_features: int, block: int, tiled: bool):
        super().__init__()
        self.shape = out_features, in_features // block, block
        hold(self, "weight_int8", (), out_features, in_features, True, tiled)
        hold(self, "weight_int8_scale", (), out_features, in_features // block, False, tiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.shape[0]
        weight = held_rows(self, "weight_int8", rows).reshape(self.shape)
        return torch.ops.k2deploy.linear_int8(x, weight, held_rows(self, "weight_int8_scale", rows))


def int8_linear(lowering: Lowering, in_features: int, out_features: int) -> Int8Linear | None:
    """A projection as int8 blocks, where the target's passes re-quantise it; None where they keep it."""
    block = lowering.linear_block(in_features)
    return Int8Linear(in_features, out_features, block, lowering.tiled()) if block else None


def lowered_linear(lowering: Lowering, config: ModelConfig):
    """(in, out) -> the target's linear: what its passes lower it to, else as in the checkpoint."""
    def make(in_features: int, out_features: int) -> nn.Module:
        return int8_linear(lowering, in_features, out_features) or checkpoint_linear(config, in_features, out_features)
    return make


# -- the latent cache as stored ------------------------------------------------------------------------

# the stored latent's torch dtype, by the graphs' element type (core/cache_format.py CODINGS)
TORCH_TYPES = {"FLOAT8E4M3FN": torch.float8_e4m3fn, "UINT8": torch.uint8, "BFLOAT16": torch.bfloat16}
CACHE_TORCH_DTYPES = {name: TORCH_TYPES[coding.onnx_type] for name, coding in CODINGS.items()}
# the latent pool's torch dtype: e4m3 as its bits, since ONNX gathers no e4m3 (core/cache_format.py pages_type)
PAGES_TORCH_DTYPES = {name: torch.uint8 if dtype == torch.float8_e4m3fn else dtype
                      for name, dtype in CACHE_TORCH_DTYPES.items()}


def pages_dtype(cache_format: str, array: CacheArray) -> torch.dtype:
    """The torch dtype of one array's pool [pages, PAGE_SIZE, width] as the layer graph takes it."""
    if array.name == "latent":
        return PAGES_TORCH_DTYPES[cache_format]
    return {"FLOAT16": torch.float16, "FLOAT": torch.float32}[array.onnx_type]


class StoredPast(NamedTuple):
    """The cache's first t entries as the layer graph takes them (see the module doc)."""

    latent: torch.Tensor  # [t, b, c] in the stored format (e4m3 as its bits, uint8)
    rope: torch.Tensor  # [t, b, r] float16
    scale: torch.Tensor | None  # [t, b, c / group] float32; None when unscaled
    group: int | None  # latent values per scale
    e4m3_values: torch.Tensor | None  # [256] float32, the value of each e4m3 bit pattern; None unless fp8

    def widened(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> latent [b, t, c], rope [b, t, r] float32 (FP8 codes times their group's scale)."""
        latent = self.latent.float() if self.e4m3_values is None else self.e4m3_values[self.latent.long()]
        return _scaled(latent, self.scale).transpose(0, 1), self.rope.float().transpose(0, 1)


def _scaled(latent: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """latent [x, y, c] float32 codes, scale [x, y, c / group] or None -> the values [x, y, c]: each code times its
    group's scale, the one product both the past and the new entries are read back with."""
    if scale is None:
        return latent
    x, y, c = latent.shape
    return (latent.view(x, y, scale.shape[-1], -1) * scale.unsqueeze(-1)).view(x, y, c)


def stored_entries(cache: CacheFormat, new_latent: torch.Tensor, new_rope: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """new_latent [b, s, c], new_rope [b, s, r] float32 -> the entries as the cache stores them: latent [b, s, c] in
    its format, rope [b, s, r] float16 and, for a scaled format, latent_scale [b, s, c / group]. The layer
    graph's new cache outputs, and what its attention reads for the chunk's own positions."""
    new_rope = new_rope.to(torch.float16)
    coding, dtype = cache.coding, CACHE_TORCH_DTYPES[cache.name]
    if coding.largest is None:
        return new_latent.to(dtype), new_rope
    b, s, c = new_latent.shape
    grouped = new_latent.view(b, s, -1, cache.scale_group)
    scale = (grouped.abs().amax(dim=-1, keepdim=True) / coding.largest).clamp(min=1e-12)
    codes = grouped / scale
    if coding.zero_point is not None:
        codes = codes.round().clamp(-coding.largest, coding.largest) + coding.zero_point
    return codes.to(dtype).view(b, s, c), new_rope, scale.squeeze(-1)


def widened_entries(new: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The new entries as stored (fp8 or bf16: `stored_entries`) -> latent [b, s, c], rope [b, s, r] float32, the
    values `StoredPast.widened` gives for the same bytes once they are in the cache."""
    latent, rope, *scale = new
    return _scaled(latent.float(), scale[0] if scale else None), rope.float()


# -- attention over the cache, per op of plugins/mla.py `CACHE_ATTENTION` -------------------------------

def _attention_over_widened(attention: model.MLA, q_nope, q_pe, new: tuple, past: StoredPast, mask):
    """mla_attention: the past widened to float32 and joined with the new entries widened from their stored form
    (the chunk's own entries are attended as stored), W_UK and W_UV from the FP8 kv_b_proj dequantised in the
    graph."""
    past_latent, past_rope = past.widened()
    new_latent, new_rope = widened_entries(new)
    latent = torch.cat([past_latent, new_latent], dim=1)  # [b, t + s, c]
    rope = torch.cat([past_rope, new_rope], dim=1)  # [b, t + s, r]
    return torch.ops.k2deploy.mla_attention(q_nope, q_pe, latent, rope, attention.kv_b_proj.dequantized(), mask,
                                            attention.nope, attention.v_dim, attention.softmax_scale)


class AbsorbedInt8(nn.Module):
    """kv_b_proj taken apart for absorbed attention, as int8 codes stored as bytes code + 128: W_UK [h, d, c] and
    W_UV^T [h, c, v] with one scale per output column (plugins/mla.py `absorbed_int8`); the int8 cache's attention
    multiplies them. Four rows interleaved where the target holds its weights in the native step's layout."""

    def __init__(self, config: ModelConfig, lowering: Lowering):
        super().__init__()
        h, d, v, c = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.shapes = {"w_uk_int8": (h, d, c), "w_uv_int8": (h, c, v)}
        for name, (heads, rows, cols) in self.shapes.items():
            four = lowering.tiled() and rows % 4 == 0
            held = (heads, rows // 4, cols, 4) if four else (heads, rows, cols)
            self.register_buffer(name + (native_tiles.FOUR_ROWS if four else ""), torch.empty(held, dtype=torch.uint8))
        self.register_buffer("w_uk_scale", torch.empty(h, 1, c))
        self.register_buffer("w_uv_scale", torch.empty(h, 1, v))

    def weight(self, name: str) -> torch.Tensor:
        """w_uk_int8 or w_uv_int8 [h, k, n] (rows taken back apart where they are held four interleaved)."""
        held = getattr(self, name + native_tiles.FOUR_ROWS, None)
        return getattr(self, name) if held is None else held.transpose(-1, -2).reshape(self.shapes[name])


def _attention_over_int8(attention: model.MLA, q_nope, q_pe, new: tuple, past: StoredPast, mask):
    """mla_attention_int8_cache: the past's stored codes and the chunk's own (the chunk's own entries are attended
    as stored) read in place, the per-token scale applied to the scores."""
    kv_b = attention.kv_b_proj
    new_codes, new_rope, new_scale = new
    return torch.ops.k2deploy.mla_attention_int8_cache(
        q_nope, q_pe, past.latent, past.scale, past.rope, new_codes, new_scale, new_rope, kv_b.weight("w_uk_int8"),
        kv_b.w_uk_scale, kv_b.weight("w_uv_int8"), kv_b.w_uv_scale, mask, attention.nope, attention.v_dim,
        attention.softmax_scale)


def _checkpoint_kv_b(config: ModelConfig, lowering: Lowering) -> nn.Module:
    """kv_b_proj as the checkpoint stores it, whatever the target: the attention dequantizes it whole."""
    c = config
    return checkpoint_linear(c, c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim))


# op -> (kv_b_proj's module of (config, the target's lowering), the attention face that feeds the op)
ATTENTION_FACES = {mla.mla_attention: (_checkpoint_kv_b, _attention_over_widened),
                   mla.mla_attention_int8_cache: (AbsorbedInt8, _attention_over_int8)}


def computed_pieces(config: ModelConfig, checkpoint: Checkpoint, layer: int, name: str):
    """The bytes of a layer initializer that every target computes rather than copies (absorbed int8 kv_b_proj,
    INT4 experts in QMoE's order); None for any other name."""
    if name.startswith("self_attn.kv_b_proj.w_u"):
        return _absorbed_int8_pieces(config, checkpoint, layer, name)
    if config.int4 is not None and name.startswith("mlp.experts_fc"):
        return _int4_expert_pieces(config, checkpoint, layer, name)
    return None


def _int4_expert_pieces(config: ModelConfig, checkpoint: Checkpoint, layer: int, name: str):
    """One expert at a time: fc1 codes, gate and up rows interleaved [2f, m / 2] (the checkpoint's bytes, rows
    reordered), fc2 codes [m, f / 2]; their BF16 group scales widened to float32 in the same row order."""
    fc, part = name.removeprefix("mlp.experts_").split("_")
    prefix = f"model.layers.{layer}.mlp.experts."
    suffix = "weight_packed" if part == "codes" else "weight_scale"

    def rows(expert: int, proj: str) -> np.ndarray:
        array = checkpoint.read(f"{prefix}{expert}.{proj}.{suffix}")
        return int4.nibble_bytes(array) if part == "codes" else array.astype(np.float32)

    for expert in range(config.n_routed_experts):
        if fc == "fc2":
            yield np.ascontiguousarray(rows(expert, "down_proj"))
        else:
            gate, up = rows(expert, "gate_proj"), rows(expert, "up_proj")
            yield np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], gate.shape[1])


def _absorbed_int8_pieces(config: ModelConfig, checkpoint: Checkpoint, layer: int, name: str):
    """The bytes of an `AbsorbedInt8` initializer, from the layer's kv_b_proj."""
    weight = torch.from_numpy(checkpoint.float32(f"model.layers.{layer}.self_attn.kv_b_proj.weight"))
    parts = mla.absorbed_int8(weight, config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim)
    names = ("w_uk_int8", "w_uk_scale", "w_uv_int8", "w_uv_scale")
    return [parts[names.index(name.rpartition(".")[2])].numpy()]


# -- the layer ----------------------------------------------------------------------------------------

class ExportMoE(nn.Module):
    """Routing and dispatch through the plugin ops. Routed experts stacked per projection as e4m3 bits
    [e, rows, cols] uint8 with their block scales; where the target's passes give an int8 block, as int8
    blocks with gate and up interleaved in fc1; an INT4 checkpoint's experts as its own 4-bit codes, gate and
    up interleaved in fc1, multiplied at the accuracy the target's passes ask (plugins/int4.py)."""

    def __init__(self, config: ModelConfig, lowering: Lowering):
        super().__init__()
        c = config
        e, f, m = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.config, self.block = c, c.fp8_block[0] if c.fp8_block else None
        self.gate = nn.Module()
        self.gate.register_buffer("weight", torch.empty(e, m, dtype=torch.bfloat16))
        self.gate.register_buffer("e_score_correction_bias", torch.empty(e, dtype=torch.float32))
        group = c.int4.group if c.int4 is not None else lowering.int4_group()
        self.int4_accuracy = lowering.int4_accuracy() if group else None
        self.int8_block = lowering.experts_block(c) if not group else None
        tiled = lowering.tiled()  # held in the native step's tiles (export/tiled_buffers.py)
        self.rows = {"fc1": 2 * f, "fc2": m}
        if group:  # 4-bit codes for QMoE (plugins/int4.py): the checkpoint's, or FP8 re-quantised
            for fc, (rows, cols) in {"fc1": (2 * f, m), "fc2": (m, f)}.items():
                hold(self, f"experts_{fc}_codes", (e,), rows, cols // 2, True, tiled)
                hold(self, f"experts_{fc}_scales", (e,), rows, cols // group, False, tiled)
        elif self.int8_block:
            for fc, (rows, cols) in {"fc1": (2 * f, m), "fc2": (m, f)}.items():
                hold(self, f"experts_{fc}_weight", (e,), rows, cols, True, tiled)
                hold(self, f"experts_{fc}_scale", (e,), rows, cols // self.int8_block, False, tiled)
        else:
            for proj, (rows, cols) in {"gate_proj": (f, m), "up_proj": (f, m), "down_proj": (m, f)}.items():
                self.register_buffer(f"experts_{proj}_weight", torch.empty(e, rows, cols, dtype=torch.uint8))
                self.register_buffer(f"experts_{proj}_scale",
                                     torch.empty(e, -(-rows // self.block), -(-cols // self.block)))
        self.shared_experts = (model.MLP(m, f * c.n_shared_experts, lowered_linear(lowering, c))
                               if c.n_shared_experts else None)

    def _stack(self, fc: str, part: str) -> torch.Tensor:
        """experts_{fc}_{part} [e, rows, width] as the op takes it (untiled where held in tiles)."""
        return held_rows(self, f"experts_{fc}_{part}", self.rows[fc])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [n, m]
        route_weights, expert_ids = torch.ops.k2deploy.moe_route(
            tokens, self.gate.weight.float(), self.gate.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
            c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
        if self.int4_accuracy is not None:
            out = torch.ops.k2deploy.moe_experts_int4(
                tokens, expert_ids, route_weights, self._stack("fc1", "codes"), self._stack("fc1", "scales"),
                self._stack("fc2", "codes"), self._stack("fc2", "scales"), self.int4_accuracy)
        elif self.int8_block:
            out = torch.ops.k2deploy.moe_experts_int8(
                tokens, expert_ids, route_weights, self._stack("fc1", "weight"), self._stack("fc1", "scale"),
                self._stack("fc2", "weight"), self._stack("fc2", "scale"))
        else:
            out = torch.ops.k2deploy.moe_experts(
                tokens, expert_ids, route_weights, self.experts_gate_proj_weight, self.experts_gate_proj_scale,
                self.experts_up_proj_weight, self.experts_up_proj_scale, self.experts_down_proj_weight,
                self.experts_down_proj_scale, self.block)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)


def export_faces(config: ModelConfig, cache_format: str, target: str, weights: str = "checkpoint") -> model.Faces:
    """The layer's faces for a target, cache format and experts' weights (export/passes.py WEIGHT_CHOICES): BF16
    norms as in the checkpoint."""
    lowering = Lowering(target, weights)
    kv_b, attention = ATTENTION_FACES[mla.CACHE_ATTENTION[cache_format]]
    cache = CacheFormat.for_config(config, cache_format)
    return model.Faces(attention, lowered_linear(lowering, config), lambda c: kv_b(c, lowering),
                       lambda c: ExportMoE(c, lowering),
                       torch.bfloat16, lambda new_latent, new_rope: stored_entries(cache, new_latent, new_rope))


class ExportLayer(model.Block):
    """The decoder layer as traced: `model.Block` of the target's faces, with the cache I/O in its stored format."""

    def __init__(self, config: ModelConfig, layer: int, cache_format: str, target: str, weights: str = "checkpoint"):
        if config.fp8_block is None and config.int4 is None:
            raise ValueError("export needs an FP8 or INT4 checkpoint (a quantization_config)")
        super().__init__(config, layer, export_faces(config, cache_format, target, weights))
        self.config, self.cache = config, CacheFormat.for_config(config, cache_format)
        if CACHE_TORCH_DTYPES[cache_format] == torch.float8_e4m3fn:
            self.register_buffer("e4m3_values", torch.empty(256))
        else:
            self.e4m3_values = None

    def forward(self, hidden, positions, page_table, latent_pages, rope_pages, latent_scale_pages=None):
        """hidden [b, s, m] float32, positions [b, s] int64 (row i holds positions[i, 0] tokens), page_table [b, n]
        int64 (row i's pages in position order, enough for its past; the rest any page), <array>_pages the layer's
        pools [pages, PAGE_SIZE, width] (see the module doc) -> hidden [b, s, m] and the s new cache entries in
        the cache's format (`stored_entries`): latent [b, s, c], rope [b, s, r], and for fp8 / int8 latent_scale
        [b, s, c / group]. The chunk attends to its own entries as stored, as a later forward reads them."""
        b, s, _ = hidden.shape

        def gathered(pages: torch.Tensor) -> torch.Tensor:  # [pages, P, w] -> [n * P, b, w]
            rows = torch.index_select(pages, 0, page_table.reshape(-1))  # [b * n, P, w]
            return rows.reshape(b, -1, pages.shape[-1]).transpose(0, 1)

        past_latent = gathered(latent_pages)
        t = past_latent.shape[0]
        cached = torch.arange(t, device=positions.device)[None, None, :] < positions[:, :1, None]  # [b, 1, t]
        step = torch.arange(s, device=positions.device)
        causal = step[None, :, None] >= step[None, None, :]  # [1, s, s]
        mask = torch.cat([cached.expand(b, s, t), causal.expand(b, s, s)], dim=-1)  # [b, s, t + s]
        scale = gathered(latent_scale_pages) if latent_scale_pages is not None else None
        past = StoredPast(past_latent, gathered(rope_pages), scale, self.cache.scale_group, self.e4m3_values)
        return super().forward(hidden, positions, past, mask)  # hidden, then the new entries as stored

    def derived_initializers(self) -> dict[str, np.ndarray]:
        """Initializers that are not checkpoint tensors: the rope frequencies (and the e4m3 values)."""
        derived = {"self_attn.rotary.frequencies": inverse_frequencies(self.config)[0].numpy()}
        if self.e4m3_values is not None:
            derived["e4m3_values"] = E4M3_VALUES
        return derived


class ExportEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.register_buffer("weight", torch.empty(config.vocab_size, config.hidden_size, dtype=torch.bfloat16))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [b, s] int64 -> hidden [b, s, m] float32."""
        return F.embedding(token_ids, self.weight).float()


class ExportHead(nn.Module):
    def __init__(self, config: ModelConfig, target: str):
        super().__init__()
        self.norm = model.RMSNorm(config.hidden_size, config.rms_norm_eps, torch.bfloat16)
        lowered = int8_linear(Lowering(target), config.hidden_size, config.vocab_size)
        if lowered is not None:  # e.g. the BF16 head as int8 blocks: half the bytes every step reads
            self.lm_head = lowered
        else:
            self.register_buffer("lm_head", torch.empty(config.vocab_size, config.hidden_size, dtype=torch.bfloat16))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [b, s, m] -> logits [b, s, vocab] float32."""
        if isinstance(self.lm_head, nn.Module):
            return self.lm_head(self.norm(hidden))
        return F.linear(self.norm(hidden), self.lm_head.float())


def initializer_sources(config: ModelConfig, kind: str, layer: int | None, name: str) -> list[str]:
    """The checkpoint tensors whose bytes, concatenated, are the initializer `name` of a graph."""
    if kind == "embed":
        return ["model.embed_tokens.weight"]
    if kind == "head":
        return {"norm.weight": ["model.norm.weight"], "lm_head": ["lm_head.weight"]}[name]
    prefix = f"model.layers.{layer}."
    if name.startswith("mlp.experts_"):
        proj, _, part = name.removeprefix("mlp.experts_").rpartition("_")
        suffix = "weight" if part == "weight" else "weight_scale_inv"
        return [f"{prefix}mlp.experts.{expert}.{proj}.{suffix}" for expert in range(config.n_routed_experts)]
    return [prefix + name]
