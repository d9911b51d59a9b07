"""The latent cache's layout, in one place: what the exporter writes into the graphs and the manifest, what the
runtimes allocate and bind, what sizes, plans and inspect report.

Per layer and token MLA keeps the latent c_kv [c] and the rope key k_pe [r]:

fp8:  c_kv as e4m3 bytes with one float32 scale per group of 128 values (or of gcd(c, 128) when c is
      not a multiple of 128), k_pe float16 -> 656 bytes at Kimi K2's c = 512, r = 64.
int8: c_kv as int8 codes stored as code + 128 (uint8) with one float32 scale per token (the cpu
      target's cache: attention applies the scale to scores, not to the cache) -> 644 bytes.
bf16: c_kv bfloat16, k_pe float16 -> 1152 bytes.

Paged: every array is a pool of pages of PAGE_SIZE tokens per layer, [pages, PAGE_SIZE, width]; a request holds
a page table (its pages in position order) and a layer graph gathers its rows' pages itself, from the pool
it is given whole (`page_table` [b, n] -> past [n * PAGE_SIZE, b, width], the positions past each row's
length masked). 64 tokens: a full page is the unit of prefix reuse (a request reuses whole pages, so at
most 63 tokens of a shared prefix are prefilled again), and 64 x 644 bytes = 41 KB per page and layer at
Kimi K2's int8 cache is one large contiguous read per page for the gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .config import ModelConfig
from .errors import K2Error

PAGE_SIZE = 64  # tokens per page of the latent cache's pools (see the module doc)

@dataclass(frozen=True)
class LatentCoding:
    """How a format stores the latent: everything the exporter's quantisation and the runtimes need of it."""

    onnx_type: str  # the graphs' element type of the latent (its bits are stored as uint8 / uint16 on the host)
    group: Callable[[int], int | None]  # latent width c -> latent values per float32 scale; None: unscaled
    largest: float | None = None  # scaled formats: the largest code, absmax / largest being the scale
    zero_point: int | None = None  # integer codes: rounded, each code q stored as the byte q + zero_point


# One entry per cache format: a new format is its entry here (and the targets that offer it, core/targets.py,
# and the attention op that reads it, plugins/mla.py CACHE_ATTENTION).
CODINGS = {
    "fp8": LatentCoding("FLOAT8E4M3FN", lambda c: math.gcd(c, 128), largest=448.0),
    "int8": LatentCoding("UINT8", lambda c: c, largest=127.0, zero_point=128),
    "bf16": LatentCoding("BFLOAT16", lambda c: None),
}
LATENT_TYPES = {name: coding.onnx_type for name, coding in CODINGS.items()}
NAMES = tuple(CODINGS)
INT8_ZERO_POINT = CODINGS["int8"].zero_point


@dataclass(frozen=True)
class ElementType:
    """An ONNX element type as a runtime holds it: its TensorProto number (onnx itself is not needed at run time)
    and the numpy dtype that stores its bits on the host (e4m3 and bfloat16 have none of their own)."""

    number: int
    storage: str  # numpy dtype name
    itemsize: int  # bytes per value


ELEMENT_TYPES = {"FLOAT": ElementType(1, "float32", 4), "UINT8": ElementType(2, "uint8", 1),
                 "FLOAT16": ElementType(10, "float16", 2), "BFLOAT16": ElementType(16, "uint16", 2),
                 "FLOAT8E4M3FN": ElementType(17, "uint8", 1)}


@dataclass(frozen=True)
class CacheArray:
    """One array a cache keeps per layer and token: a layer graph takes the pool as <name>_pages [pages, PAGE_SIZE,
    width] and writes its new entries as new_<name> [b, s, width]."""

    name: str  # latent, rope or latent_scale
    width: int  # values per token
    onnx_type: str  # the graphs' element type of the new entries, a key of ELEMENT_TYPES

    @property
    def element(self) -> ElementType:
        return ELEMENT_TYPES[self.onnx_type]

    @property
    def pages_type(self) -> str:
        """The element type of the pool a graph takes: e4m3 as its bits (UINT8), since ONNX gathers no e4m3; the
        graph widens the gathered bits through a 256-entry table."""
        return "UINT8" if self.onnx_type == "FLOAT8E4M3FN" else self.onnx_type

    @property
    def pages_element(self) -> ElementType:
        return ELEMENT_TYPES[self.pages_type]

    @property
    def token_bytes(self) -> int:
        """Bytes per token, layer and row."""
        return self.width * self.element.itemsize


@dataclass(frozen=True)
class CacheFormat:
    name: str  # fp8, int8 or bf16
    latent_dim: int  # c = kv_lora_rank
    rope_dim: int  # r = qk_rope_head_dim
    scale_group: int | None  # latent values per float32 scale; None: unscaled (bf16)

    @classmethod
    def for_config(cls, config: ModelConfig, name: str) -> CacheFormat:
        if name not in LATENT_TYPES:
            raise K2Error(f"unknown latent cache format {name!r}; choose one of {', '.join(NAMES)}")
        c = config.kv_lora_rank
        group = CODINGS[name].group(c)
        return cls(name, c, config.qk_rope_head_dim, group)

    @classmethod
    def from_manifest(cls, kv: dict) -> CacheFormat:
        """The format a manifest's kv_cache entry describes; a K2Error when it is not one this runtime reads."""
        name = kv.get("format")
        if name not in LATENT_TYPES:
            raise K2Error(f"unknown latent cache format {name!r}; this runtime reads {', '.join(NAMES)}")
        fmt = cls(name, kv.get("latent_dim"), kv.get("rope_dim"), kv.get("latent_scale_group"))
        if (fmt.scale_group is None) != (name == "bf16") or (fmt.scale_group and fmt.latent_dim % fmt.scale_group):
            raise K2Error(f"the manifest's kv_cache format {name!r} does not go with its latent_scale_group "
                          f"{fmt.scale_group} ({fmt.latent_dim} latent values); the manifest was edited or mixes "
                          f"artifacts, re-export it")
        if kv.get("page_size") != PAGE_SIZE:
            raise K2Error(f"the artifact's latent cache is not paged in pages of {PAGE_SIZE} tokens (manifest page_size "
                          f"{kv.get('page_size')!r}): it was exported by another version of k2deploy; re-export it")
        return fmt

    @classmethod
    def for_artifact(cls, kv: dict, config: ModelConfig, where: object) -> CacheFormat:
        """A manifest's kv_cache entry as from_manifest reads it, its dims first checked against its model's (where:
        the artifact, named in the error)."""
        if kv.get("latent_dim") != config.kv_lora_rank or kv.get("rope_dim") != config.qk_rope_head_dim:
            raise K2Error(f"{where}: manifest.json's kv_cache dims ({kv.get('latent_dim')}, {kv.get('rope_dim')}) are "
                          f"not its model's ({config.kv_lora_rank}, {config.qk_rope_head_dim}); re-export the artifact")
        return cls.from_manifest(kv)

    @property
    def coding(self) -> LatentCoding:
        return CODINGS[self.name]

    @property
    def scaled(self) -> bool:
        return self.scale_group is not None

    @property
    def latent_type(self) -> str:
        """The ONNX element type of the graphs' latent inputs and outputs."""
        return LATENT_TYPES[self.name]

    @property
    def arrays(self) -> tuple[CacheArray, ...]:
        """What the cache keeps per layer and token, in the graphs' order: latent, rope[, latent_scale]."""
        arrays = (CacheArray("latent", self.latent_dim, self.latent_type), CacheArray("rope", self.rope_dim, "FLOAT16"))
        return arrays + ((CacheArray("latent_scale", self.scales_per_token, "FLOAT"),) if self.scaled else ())

    @property
    def scales_per_token(self) -> int:
        return self.latent_dim // self.scale_group if self.scaled else 0

    @property
    def bytes_per_token_per_layer(self) -> int:
        latent = self.latent_dim * (1 if self.scaled else 2)
        return latent + 4 * self.scales_per_token + 2 * self.rope_dim

    def description(self) -> dict:
        """The manifest's kv_cache entry."""
        return {
            "format": self.name,
            "layout": "per layer, paged: page_table [b, n] into latent_pages [pages, page_size, c], rope_pages "
                      "[pages, page_size, r]" + (", latent_scale_pages [pages, page_size, c / group]" if self.scaled else ""),
            "page_size": PAGE_SIZE,
            "latent_dtype": self.latent_type,
            "latent_zero_point": self.coding.zero_point,
            "latent_scale_group": self.scale_group,
            "latent_scale_dtype": "FLOAT" if self.scaled else None,
            "rope_dtype": "FLOAT16",
            "latent_dim": self.latent_dim,
            "rope_dim": self.rope_dim,
            "bytes_per_token_per_layer": self.bytes_per_token_per_layer,
        }
