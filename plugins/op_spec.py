"""One declaration per custom op, `OpSpec`; every face that repeats its signature is derived from it.

An OpSpec holds the op's name, its input and output tensors in node order (name -> shape symbols and
allowed dtypes), its attributes (name -> int, float or bool; ONNX and TensorRT carry a bool as an int)
and one check of what the shape symbols cannot say. From it come:

- `outputs_for`: the shape/dtype function over `TensorSpec`s. It binds each shape symbol across the
  inputs (and to the attribute of that name), refuses disagreeing ints, runs the check, and reads the
  outputs' shapes off the bound symbols. A dimension may be an int, a name or a TensorRT shape
  expression: only ints are compared, so one function serves tests, the torch fake and TensorRT;
- `torch_op`: the torch.library op, with the fake kernel torch.export traces (from `outputs_for`);
- `onnx_lowering` / `function`: the one `k2deploy` node the exporter emits, and its function body's signature;
- `plugin` / `tensorrt_plugins`: what plugins/tensorrt/ registers and launches for it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import onnx

from .onnx_domain import DOMAIN, Body, custom_node, make_function

# ONNX dtype names (TensorProto.DataType names), as the manifest's io specs write them
FLOAT, FLOAT16, BFLOAT16, INT64, INT8, BOOL, FP8, UINT8 = (
    "FLOAT", "FLOAT16", "BFLOAT16", "INT64", "INT8", "BOOL", "FLOAT8E4M3FN", "UINT8")
EXPERT_BITS_DTYPES = (FP8, UINT8)  # the TensorRT copy types expert bits as FP8; the artifact as UINT8
_TORCH_DTYPES = {FLOAT: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16", INT64: "int64", INT8: "int8",
                 BOOL: "bool", FP8: "float8_e4m3fn", UINT8: "uint8"}
_TORCH_ATTRIBUTES = {int: "SymInt", float: "float", bool: "bool"}  # as torch.library infers them
ANY_DIMS = "..."  # a shape symbol for any number of leading dimensions


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as a shape function sees it: a shape tuple and an ONNX dtype name."""
    shape: tuple
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Tensor:
    """One input or output of an op: a shape symbol per dimension and the dtypes it may have (the first is
    the one a TensorRT plugin takes and an output has)."""
    shape: tuple[str, ...]
    dtypes: tuple[str, ...]


def tensor(shape: str, *dtypes: str) -> Tensor:
    """tensor("n m", FLOAT): shape symbols separated by spaces; a number is that size, "..." any leading dims."""
    return Tensor(tuple(shape.split()), dtypes)


@dataclass(frozen=True)
class KernelLaunch:
    """An ahead-of-time kernel launch as plain data: the @triton.jit kernel, its constexprs, the grid and the
    int32 scalars TensorRT passes between the input and the output pointers (ints or shape expressions)."""
    kernel: Any
    constexprs: dict[str, Any]
    grid: tuple
    scalars: tuple
    options: dict = field(default_factory=dict)  # Triton compile options (num_stages, ...)


@dataclass(frozen=True)
class Plugin:
    """How a TensorRT engine runs an op as one plugin: `triton` names the plugins/triton_kernels.py function
    that runs it on torch tensors (inputs, then attributes; the just-in-time implementation), `launch` maps the
    bound shape symbols and attributes to its ahead-of-time kernel launch (None: no AOT kernel)."""
    triton: str
    implementation: str  # what runs it on the GPU, in words
    launch: Callable[..., KernelLaunch] | None = None


def is_int(dim) -> bool:
    return isinstance(dim, int) and not isinstance(dim, bool)


def need(condition: bool, message: str) -> None:
    """An op's check: ValueError(message) unless condition."""
    if not condition:
        raise ValueError(message)


def fixed(dims: dict, *symbols: str) -> list[int]:
    """The values of these bound symbols, which an AOT kernel needs fixed at build time."""
    for symbol in symbols:
        need(is_int(dims[symbol]), f"the AOT kernel needs {symbol} fixed at build time, got {dims[symbol]}")
    return [dims[symbol] for symbol in symbols]


def _no_check(dims: dict) -> None:
    """For ops whose shape symbols say everything."""


@dataclass(frozen=True)
class OpSpec:
    name: str  # the op's k2deploy ONNX node type and TensorRT plugin name, where it has them
    inputs: dict[str, Tensor]  # in node order
    outputs: dict[str, Tensor]
    attributes: dict[str, type]  # in node order: int, float or bool
    check: Callable[[dict], None] = _no_check  # (bound symbols and attributes) -> None, or ValueError
    plugin: Plugin | None = None  # the TensorRT plugin that runs the op
    split_into: tuple[OpSpec, ...] = ()  # or: the plugins a TensorRT copy runs it as, in order

    @property
    def tensorrt_plugins(self) -> tuple[OpSpec, ...]:
        return (self,) if self.plugin else self.split_into

    # -- the shape/dtype function -------------------------------------------------------------

    def attribute_values(self, attributes: dict[str, Any]) -> dict[str, Any]:
        """The attributes as their declared types (a node carries a bool as an int); ValueError when one is missing."""
        missing = [a for a in self.attributes if a not in attributes]
        need(not missing, f"{self.name}: missing attribute(s) {', '.join(missing)}")
        return {a: kind(attributes[a]) for a, kind in self.attributes.items()}

    def bind(self, inputs: Sequence[TensorSpec], attributes: dict[str, Any]) -> dict[str, Any]:
        """Every shape symbol's dimension (and every attribute) for these inputs; ValueError when they do not fit."""
        need(len(inputs) == len(self.inputs), f"{self.name}: expected {len(self.inputs)} inputs "
             f"({', '.join(self.inputs)}), got {len(inputs)}")
        dims = self.attribute_values(attributes)
        bound_by = {a: "the attribute" for a in dims}
        for (name, declared), spec in zip(self.inputs.items(), inputs):
            self._bind_input(dims, bound_by, name, declared, spec)
        try:
            self.check(dims)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        return dims

    def _bind_input(self, dims: dict, bound_by: dict, name: str, declared: Tensor, spec: TensorSpec) -> None:
        symbols = declared.shape
        any_dims = ANY_DIMS in symbols
        rank_ok = spec.rank >= len(symbols) - 1 if any_dims else spec.rank == len(symbols)
        need(rank_ok, f"{self.name}: input {name} must have rank {len(symbols)}, got shape {spec.shape}")
        need(spec.dtype in declared.dtypes,
             f"{self.name}: input {name} must be {' or '.join(declared.dtypes)}, got {spec.dtype}")
        position = 0
        for symbol in symbols:
            width = spec.rank - len(symbols) + 1 if symbol == ANY_DIMS else 1
            dim = tuple(spec.shape[position:position + width]) if symbol == ANY_DIMS else spec.shape[position]
            position += width
            if symbol.isdigit():
                dims.setdefault(symbol, int(symbol))
                bound_by.setdefault(symbol, "the declared size")
            if symbol not in dims:
                dims[symbol], bound_by[symbol] = dim, name
                continue
            bound = dims[symbol]
            agree = (len(bound) == len(dim) and all(map(_same, bound, dim))) if symbol == ANY_DIMS else _same(bound, dim)
            need(agree, f"{self.name}: {symbol} of {bound_by[symbol]} and {name} disagree: {bound} != {dim}")

    def outputs_for(self, inputs: Sequence[TensorSpec], attributes: dict[str, Any]) -> list[TensorSpec]:
        """The outputs' shapes and dtypes for these inputs and attributes; ValueError when they do not fit."""
        dims = self.bind(inputs, attributes)
        return [TensorSpec(_expand(declared.shape, dims), declared.dtypes[0]) for declared in self.outputs.values()]

    # -- torch ----------------------------------------------------------------------------------

    def torch_op(self, torch_name: str, eager: Callable):
        """`torch.ops.k2deploy.<torch_name>`, running `eager` (inputs, then attributes), its fake from `outputs_for`."""
        import torch

        parameters = [f"Tensor {n}" for n in self.inputs] + [
            f"{_TORCH_ATTRIBUTES[kind]} {a}" for a, kind in self.attributes.items()]
        returns = "Tensor" if len(self.outputs) == 1 else f"({', '.join(['Tensor'] * len(self.outputs))})"
        op = torch.library.custom_op(f"{DOMAIN}::{torch_name}", eager, mutates_args=(),
                                     schema=f"({', '.join(parameters)}) -> {returns}")
        op.register_fake(self._fake)
        return op

    def _fake(self, *args):
        import torch

        tensors = args[:len(self.inputs)]
        names = {getattr(torch, t): n for n, t in _TORCH_DTYPES.items()}
        specs = [TensorSpec(tuple(t.shape), names.get(t.dtype, str(t.dtype))) for t in tensors]
        outputs = tuple(tensors[0].new_empty(o.shape, dtype=getattr(torch, _TORCH_DTYPES[o.dtype]))
                        for o in self.outputs_for(specs, dict(zip(self.attributes, args[len(self.inputs):]))))
        return outputs[0] if len(outputs) == 1 else outputs

    # -- ONNX -------------------------------------------------------------------------------------

    def onnx_lowering(self) -> Callable:
        """The torch.onnx translation function that emits one `k2deploy::<name>` node. torch.onnx reads its
        signature: inputs unannotated, attributes annotated with their types."""
        node = custom_node(self.name, list(self.inputs), list(self.outputs), self.attributes)
        signature = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in self.inputs]
            + [inspect.Parameter(a, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind)
               for a, kind in self.attributes.items()])

        def lowering(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            return node(*(bound[n] for n in self.inputs),
                        **{a: int(bound[a]) if kind is bool else bound[a] for a, kind in self.attributes.items()})

        lowering.__signature__ = signature
        lowering.__annotations__ = dict(self.attributes)
        lowering.__name__ = lowering.__qualname__ = f"{self.name}_onnx"
        return lowering

    def function(self, body: Body, extra_opsets: list | None = None) -> onnx.FunctionProto:
        """The model-local function of the op's node, with this body."""
        return make_function(self.name, list(self.inputs), list(self.outputs), list(self.attributes), body,
                             extra_opsets)


def _same(a, b) -> bool:
    """Whether two dimensions may be the same: ints are compared, anything symbolic may be."""
    return not (is_int(a) and is_int(b)) or a == b


def _expand(symbols: tuple[str, ...], dims: dict) -> tuple:
    shape = []
    for symbol in symbols:
        shape.extend(dims[symbol] if symbol == ANY_DIMS else [dims[symbol]])
    return tuple(shape)
