"""What each group of an artifact's weights is stored as, and how many bytes it takes, for its manifest.

Groups: the routed experts; the linears (attention, shared experts, the dense layers' MLP); the head; the
embedding; the rest (norms, router, correction bias, derived tables). Their formats follow from the checkpoint's
and the target's (core/targets.py); their bytes are read off the written graphs' initializers.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from ..core.config import ModelConfig
from ..core.quant_blocks import INT4_GROUP
from ..core.targets import get_target

EXPERTS, LINEARS, HEAD, EMBEDDING, OTHER = "routed experts", "linears", "head", "embedding", "norms, router, tables"
_INT8 = "int8 blocks (re-quantised)"


def group_formats(config: ModelConfig, target: str, weights: str = "checkpoint") -> dict[str, str]:
    """Each group's storage, in a few words."""
    int8 = "int8_weights" in get_target(target).passes
    if config.int4 is not None:
        experts = f"int4, the checkpoint's codes (groups of {config.int4.group}, float32 scales)"
        checkpoint_linears = "bf16"
    else:
        checkpoint_linears = "fp8 e4m3, 128x128 blocks"
        experts = _INT8 if int8 else checkpoint_linears
        if weights == "int4":
            experts = f"int4 re-quantised from fp8 (groups of {INT4_GROUP}, float32 scales)"
    return {EXPERTS: experts, LINEARS: _INT8 if int8 else checkpoint_linears, HEAD: _INT8 if int8 else "bf16",
            EMBEDDING: "bf16", OTHER: "bf16 / float32"}


def _group(stem: str, name: str) -> str:
    if stem == "embed":
        return EMBEDDING
    if name.startswith("mlp.experts_"):
        return EXPERTS
    if stem == "head":
        return HEAD if name.startswith("lm_head") else OTHER
    return LINEARS if "_proj." in name else OTHER  # q_a_proj.weight, o_proj.weight_int8, kv_b_proj.w_uk_int8, ...


def _initializer_bytes(tensor: onnx.TensorProto) -> int:
    for entry in tensor.external_data:
        if entry.key == "length":
            return int(entry.value)
    return len(tensor.raw_data)


def weight_formats(graphs: list[Path], config: ModelConfig, target: str, weights: str = "checkpoint") -> dict[str, dict]:
    """{group: {"format": ..., "bytes": ...}} over the graphs (each `<stem>.onnx`), read without their data."""
    formats = group_formats(config, target, weights)
    totals = dict.fromkeys(formats, 0)
    for path in graphs:
        for tensor in onnx.load(str(path), load_external_data=False).graph.initializer:
            totals[_group(path.stem, tensor.name)] += _initializer_bytes(tensor)
    return {group: {"format": formats[group], "bytes": totals[group]} for group in formats}
