"""What each TensorRT plugin is, in plain Python: no TensorRT, no torch needed to call it.

One `PluginSpec` per plugin (`DOMAIN_OP_PLUGINS`: which plugins each custom op of the `k2deploy`
ONNX domain becomes; MoeExperts becomes two). The plugin's name, namespace and
version (what the ONNX parser looks a node up by), its inputs and outputs in node order, its
attributes with their Python types, whether an ahead-of-time (AOT) kernel exists, and its
shape/dtype function.

A shape/dtype function maps input `TensorSpec`s (a shape tuple and an ONNX dtype name) and the
node's attributes to output `TensorSpec`s. A dimension may be an int, a name ("batch") or any
object a TensorRT shape expression is: the functions only move dimensions around and compare
those that are ints, so the same code serves the tests (ints and names) and
`tensorrt.plugin.register` (symbolic `ShapeExpr`s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

NAMESPACE = "k2deploy"  # the plugin namespace: the ONNX domain of the custom nodes
VERSION = "1"  # tensorrt.plugin registers every plugin as version "1"

# ONNX dtype names (TensorProto.DataType names), as the manifest's io specs write them
FLOAT, INT64, BOOL, FP8, UINT8 = "FLOAT", "INT64", "BOOL", "FLOAT8E4M3FN", "UINT8"
EXPERT_BITS_DTYPES = (FP8, UINT8)  # the TensorRT copy types expert bits as FP8; the artifact as UINT8


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class PluginSpec:
    name: str  # the ONNX op type and the plugin name
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: dict[str, type]  # attribute -> int or float, as the ONNX node carries them
    shape_function: Callable[..., list[TensorSpec]]
    aot: bool  # an ahead-of-time (Triton -> PTX) implementation exists
    implementation: str  # what runs it on the GPU, in words

    @property
    def plugin_id(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    def outputs_for(self, inputs: Sequence[TensorSpec], attributes: dict[str, Any]) -> list[TensorSpec]:
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{self.name}: expected {len(self.inputs)} inputs ({', '.join(self.inputs)}), "
                             f"got {len(inputs)}")
        missing = [a for a in self.attributes if a not in attributes]
        if missing:
            raise ValueError(f"{self.name}: missing attribute(s) {', '.join(missing)}")
        values = {a: self.attributes[a](attributes[a]) for a in self.attributes}
        return self.shape_function(*inputs, **values)


def _is_int(dim) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool)


def _check(condition: bool, op: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{op}: {message}")


def _check_tensor(op: str, name: str, spec: TensorSpec, rank: int, dtypes: tuple[str, ...]) -> None:
    _check(spec.rank == rank, op, f"input {name} must have rank {rank}, got shape {spec.shape}")
    _check(spec.dtype in dtypes, op, f"input {name} must be {' or '.join(dtypes)}, got {spec.dtype}")


def _check_same(op: str, what: str, a, b) -> None:
    _check(not (_is_int(a) and _is_int(b)) or a == b, op, f"{what} disagree: {a} != {b}")


# -- MoeRoute -------------------------------------------------------------------------------

def moe_route_outputs(x: TensorSpec, router_weight: TensorSpec, correction_bias: TensorSpec, *, top_k: int,
                      n_group: int, topk_group: int, normalise: int, scaling: float) -> list[TensorSpec]:
    """x [n, m], router_weight [e, m], correction_bias [e] -> route_weights [n, k] FLOAT, expert_ids [n, k] INT64."""
    op = "MoeRoute"
    _check_tensor(op, "x", x, 2, (FLOAT,))
    _check_tensor(op, "router_weight", router_weight, 2, (FLOAT,))
    _check_tensor(op, "correction_bias", correction_bias, 1, (FLOAT,))
    _check_same(op, "hidden sizes of x and router_weight", x.shape[1], router_weight.shape[1])
    _check_same(op, "expert counts of router_weight and correction_bias", router_weight.shape[0],
                correction_bias.shape[0])
    experts = router_weight.shape[0]
    _check(top_k >= 1, op, f"top_k must be at least 1, got {top_k}")
    _check(n_group >= 1 and 1 <= topk_group <= n_group, op, f"bad groups: n_group {n_group}, topk_group {topk_group}")
    if _is_int(experts):
        _check(experts % n_group == 0, op, f"n_group {n_group} does not divide the {experts} experts")
        _check(top_k <= topk_group * (experts // n_group), op,
               f"top_k {top_k} exceeds the experts of {topk_group} group(s)")
    n = x.shape[0]
    return [TensorSpec((n, top_k), FLOAT), TensorSpec((n, top_k), INT64)]


# -- MoeExperts -----------------------------------------------------------------------------

def _check_expert_weights(op: str, name: str, bits: TensorSpec, scale: TensorSpec, block: int) -> None:
    """bits [e, rows, cols] FP8 (or its UINT8 bits), scale [e, ceil(rows/block), ceil(cols/block)] FLOAT."""
    _check(block >= 1, op, f"block must be positive, got {block}")
    _check_tensor(op, f"{name}_bits", bits, 3, EXPERT_BITS_DTYPES)
    _check_tensor(op, f"{name}_scale", scale, 3, (FLOAT,))
    _check_same(op, f"expert counts of {name}_bits and {name}_scale", bits.shape[0], scale.shape[0])
    for axis in (1, 2):
        if _is_int(bits.shape[axis]) and _is_int(scale.shape[axis]):
            _check(scale.shape[axis] == -(-bits.shape[axis] // block), op,
                   f"{name}_scale {scale.shape} does not hold one scale per {block}-block of {name}_bits {bits.shape}")


def moe_experts_up_outputs(x: TensorSpec, expert_ids: TensorSpec, gate_bits: TensorSpec, gate_scale: TensorSpec,
                           up_bits: TensorSpec, up_scale: TensorSpec, *, block: int) -> list[TensorSpec]:
    """x [n, m], expert_ids [n, k], gate/up bits [e, f, m] (FP8), scales [e, ceil(f/block), ceil(m/block)] FLOAT
    -> hidden [n, k, f] FLOAT: the SwiGLU of each token's chosen experts."""
    op = "MoeExpertsUp"
    _check_tensor(op, "x", x, 2, (FLOAT,))
    _check_tensor(op, "expert_ids", expert_ids, 2, (INT64,))
    for name, bits, scale in (("gate", gate_bits, gate_scale), ("up", up_bits, up_scale)):
        _check_expert_weights(op, name, bits, scale, block)
    for axis in range(3):
        _check_same(op, f"dim {axis} of gate_bits and up_bits", gate_bits.shape[axis], up_bits.shape[axis])
    _check_same(op, "hidden sizes of x and gate_bits", x.shape[1], gate_bits.shape[2])
    _check_same(op, "token counts of x and expert_ids", x.shape[0], expert_ids.shape[0])
    return [TensorSpec((x.shape[0], expert_ids.shape[1], gate_bits.shape[1]), FLOAT)]


def moe_experts_down_outputs(hidden: TensorSpec, expert_ids: TensorSpec, route_weights: TensorSpec,
                             down_bits: TensorSpec, down_scale: TensorSpec, *, block: int) -> list[TensorSpec]:
    """hidden [n, k, f], expert_ids / route_weights [n, k], down bits [e, m, f] (FP8), scale [e, ceil(m/block),
    ceil(f/block)] FLOAT -> y [n, m] FLOAT: the chosen experts' down projections, weighted and summed."""
    op = "MoeExpertsDown"
    _check_tensor(op, "hidden", hidden, 3, (FLOAT,))
    _check_tensor(op, "expert_ids", expert_ids, 2, (INT64,))
    _check_tensor(op, "route_weights", route_weights, 2, (FLOAT,))
    _check_expert_weights(op, "down", down_bits, down_scale, block)
    for axis, what in ((0, "token counts"), (1, "k")):
        _check_same(op, f"{what} of hidden and expert_ids", hidden.shape[axis], expert_ids.shape[axis])
        _check_same(op, f"{what} of expert_ids and route_weights", expert_ids.shape[axis], route_weights.shape[axis])
    _check_same(op, "expert widths of hidden and down_bits", hidden.shape[2], down_bits.shape[2])
    return [TensorSpec((hidden.shape[0], down_bits.shape[1]), FLOAT)]


# -- MlaAttention ---------------------------------------------------------------------------

def mla_attention_outputs(q_nope: TensorSpec, q_pe: TensorSpec, latent: TensorSpec, rope: TensorSpec,
                          kv_b_weight: TensorSpec, mask: TensorSpec, *, nope_dim: int, v_dim: int,
                          softmax_scale: float) -> list[TensorSpec]:
    """q_nope [b, s, h, d], q_pe [b, s, h, r], latent [b, t, c], rope [b, t, r], kv_b_weight [h * (d + v), c],
    mask [b, s, t] BOOL -> out [b, s, h, v] FLOAT."""
    op = "MlaAttention"
    for name, spec, rank in (("q_nope", q_nope, 4), ("q_pe", q_pe, 4), ("latent", latent, 3), ("rope", rope, 3),
                             ("kv_b_weight", kv_b_weight, 2)):
        _check_tensor(op, name, spec, rank, (FLOAT,))
    _check_tensor(op, "mask", mask, 3, (BOOL,))
    b, s, h, d = q_nope.shape
    _check_same(op, "nope_dim and q_nope's last dim", d, nope_dim)
    for axis, what in ((0, "batch"), (1, "new positions"), (2, "heads")):
        _check_same(op, f"{what} of q_nope and q_pe", q_nope.shape[axis], q_pe.shape[axis])
    _check_same(op, "batch of q_nope and latent", b, latent.shape[0])
    _check_same(op, "batch of latent and rope", latent.shape[0], rope.shape[0])
    _check_same(op, "key positions of latent and rope", latent.shape[1], rope.shape[1])
    _check_same(op, "rope dims of q_pe and rope", q_pe.shape[3], rope.shape[2])
    _check_same(op, "latent dims of latent and kv_b_weight", latent.shape[2], kv_b_weight.shape[1])
    if _is_int(h) and _is_int(kv_b_weight.shape[0]):
        _check(kv_b_weight.shape[0] == h * (nope_dim + v_dim), op,
               f"kv_b_weight has {kv_b_weight.shape[0]} rows, expected heads * (nope_dim + v_dim) = "
               f"{h} * ({nope_dim} + {v_dim})")
    _check_same(op, "batch of mask", mask.shape[0], b)
    _check_same(op, "new positions of mask", mask.shape[1], s)
    _check_same(op, "key positions of mask and latent", mask.shape[2], latent.shape[1])
    _check(softmax_scale > 0, op, f"softmax_scale must be positive, got {softmax_scale}")
    return [TensorSpec((b, s, h, v_dim), FLOAT)]


PLUGINS: dict[str, PluginSpec] = {
    spec.name: spec for spec in (
        PluginSpec("MoeRoute", ("x", "router_weight", "correction_bias"), ("route_weights", "expert_ids"),
                   {"top_k": int, "n_group": int, "topk_group": int, "normalise": int, "scaling": float},
                   moe_route_outputs, aot=True,
                   implementation="one Triton kernel per token (scores, sigmoid, bias, group limit, top-k, "
                                  "normalise, scale); AOT PTX"),
        PluginSpec("MoeExpertsUp", ("x", "expert_ids", "gate_bits", "gate_scale", "up_bits", "up_scale"),
                   ("hidden",), {"block": int}, moe_experts_up_outputs, aot=True,
                   implementation="one Triton kernel per (token-expert pair, block of expert rows): FP8 gate "
                                  "and up rows of the chosen expert times x, SwiGLU; AOT PTX"),
        PluginSpec("MoeExpertsDown", ("hidden", "expert_ids", "route_weights", "down_bits", "down_scale"), ("y",),
                   {"block": int}, moe_experts_down_outputs, aot=True,
                   implementation="one Triton kernel per (token, block of hidden rows): FP8 down rows of each "
                                  "chosen expert times its SwiGLU output, weighted and summed; AOT PTX"),
        PluginSpec("MlaAttention", ("q_nope", "q_pe", "latent", "rope", "kv_b_weight", "mask"), ("out",),
                   {"nope_dim": int, "v_dim": int, "softmax_scale": float},
                   mla_attention_outputs, aot=True,
                   implementation="one Triton kernel per (row, position, head block): absorbed attention over "
                                  "the latent with an online softmax; AOT PTX"),
    )
}


# The plugins each custom op of the ONNX domain runs as in a TensorRT copy: MoeExperts is two, because
# an AOT plugin is one kernel launch and the down projection needs the whole SwiGLU output of its expert.
DOMAIN_OP_PLUGINS: dict[str, tuple[str, ...]] = {
    "MoeRoute": ("MoeRoute",), "MoeExperts": ("MoeExpertsUp", "MoeExpertsDown"), "MlaAttention": ("MlaAttention",)}


def output_specs(op: str, inputs: Sequence[TensorSpec], attributes: dict[str, Any]) -> list[TensorSpec]:
    """The output descriptions of plugin `op` for these inputs and attributes; ValueError when they do not fit."""
    if op not in PLUGINS:
        raise ValueError(f"no plugin named {op!r}; plugins: {', '.join(PLUGINS)}")
    return PLUGINS[op].outputs_for(inputs, attributes)
