"""`tensorrt.plugin` registrations of the plugins, one loop over their descriptors.

Import only where TensorRT is installed (`register()` imports `tensorrt.plugin`). Per plugin:
- `@trtp.register`: the op's shape/dtype function over TensorRT's symbolic shapes;
- `@trtp.autotune`: the one type combination each plugin supports (the first dtype of each tensor);
- `@trtp.impl` (just in time, Python at run time): the op's Triton function, launched through torch;
- `@trtp.aot_impl` (ahead of time): the op's Triton kernel compiled to PTX and baked into the engine,
  so the engine runs without Python plugin code loaded. MoeExperts runs as two plugins
  (MoeExpertsUp, MoeExpertsDown) because an AOT plugin is one kernel launch.

TensorRT reads these functions' signatures (`inspect.signature`): each function built here carries one,
with the plugin's inputs as TensorDescs, then its attributes with their types, then the trailing
arguments TensorRT passes; an aot_impl's declares its return type.
"""

import inspect
from typing import Tuple, Union

from ..op_spec import BOOL, FLOAT, FP8, INT64, UINT8, TensorSpec
from .descriptors import PLUGINS, PluginSpec

_registered = False
_AUTOTUNE_NAMES = {FLOAT: "FP32", INT64: "INT64", BOOL: "BOOL", FP8: "FP8"}  # trt.DataType names


def _trt_dtypes():
    import tensorrt as trt

    return {FLOAT: trt.float32, INT64: trt.int64, BOOL: trt.bool, FP8: trt.fp8, UINT8: trt.uint8,
            "FLOAT16": trt.float16, "BFLOAT16": trt.bfloat16, "INT32": trt.int32}


def _constant(expr) -> bool:
    """Whether a ShapeExpr is a build-time constant (a "fake" one, outside shape calculation, is not)."""
    return not expr.is_fake and expr.is_constant


def _spec(desc) -> TensorSpec:
    """A TensorDesc as a TensorSpec: constant dims as ints, the others as their shape expressions."""
    names = {v: k for k, v in _trt_dtypes().items()}
    dims = tuple(e.constant_value() if _constant(e) else e for e in (desc.shape_expr[i] for i in range(desc.ndim)))
    return TensorSpec(dims, names.get(desc.dtype, str(desc.dtype)))


def _torch(tensor):
    import torch

    return torch.as_tensor(tensor, device="cuda")


def _aot(launch):
    """What an aot_impl returns for an AotLaunch: kernel name, PTX, launch parameters, extra scalars."""
    import tensorrt.plugin as trtp

    from .aot import compile_launch, driver_ptx_version

    kernel = compile_launch(launch, max_ptx_version=driver_ptx_version())
    params = trtp.KernelLaunchParams()
    params.grid_x = launch.grid[0]
    if len(launch.grid) > 1:
        params.grid_y = launch.grid[1]
    params.block_x = kernel.warps * 32
    params.shared_mem = kernel.shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in launch.scalars])
    return kernel.name.encode(), kernel.ptx.encode(), params, extra


class _Signatures:
    """The signatures TensorRT reads off one plugin's functions, and the arguments they were called with."""

    def __init__(self, trtp, spec: PluginSpec):
        self.spec = spec
        self.tensor_type = trtp.TensorDesc
        self.attributes = [self._parameter(a, kind) for a, kind in spec.attributes.items()]

    @staticmethod
    def _parameter(name: str, annotation=inspect.Parameter.empty) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation)

    def signature(self, attributes: bool, trailing: dict, returns=inspect.Signature.empty) -> inspect.Signature:
        """inputs (TensorDescs), the attributes when asked, then the trailing arguments (name -> annotation)."""
        inputs = [self._parameter(n, self.tensor_type) for n in self.spec.inputs]
        rest = [self._parameter(n, t) for n, t in trailing.items()]
        return inspect.Signature(inputs + (self.attributes if attributes else []) + rest, return_annotation=returns)

    def sign(self, fn, signature: inspect.Signature):
        """fn(*args, **kwargs) called as fn(inputs, attributes, trailing), TensorRT reading `signature`."""
        def signed(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            inputs = [bound[n] for n in self.spec.inputs]
            return fn(inputs, {a: bound[a] for a in self.spec.attributes if a in bound}, bound)

        signed.__signature__ = signature
        signed.__name__ = signed.__qualname__ = f"{self.spec.name}_{fn.__name__}"
        return signed


def _register_plugin(trtp, spec: PluginSpec, aot: bool, aot_result) -> None:
    signatures = _Signatures(trtp, spec)
    outputs = Tuple[(trtp.TensorDesc,) * len(spec.outputs)]
    op = spec.op

    def shape(inputs, attributes, _):
        dtypes = _trt_dtypes()
        outs = tuple(trtp.from_shape_expr(tuple(o.shape), dtype=dtypes[o.dtype])
                     for o in spec.outputs_for([_spec(d) for d in inputs], attributes))
        return outs[0] if len(outs) == 1 else outs

    def autotune(inputs, attributes, _):
        dtypes = [t.dtypes[0] for t in (*op.inputs.values(), *op.outputs.values())]
        return [trtp.AutoTuneCombination(",".join(_AUTOTUNE_NAMES[d] for d in dtypes))]

    def impl(inputs, attributes, trailing):
        import torch

        from .. import triton_kernels

        run = getattr(triton_kernels, op.plugin.triton)
        with torch.cuda.stream(torch.cuda.ExternalStream(trailing["stream"])):
            results = run(*(_torch(t) for t in inputs), *op.attribute_values(attributes).values())
            for target, result in zip(trailing["outputs"], results if isinstance(results, tuple) else (results,)):
                _torch(target).copy_(result)

    def aot_impl(inputs, attributes, _):
        from .aot import launch

        return _aot(launch(spec.name, op.bind([_spec(d) for d in inputs], attributes), attributes))

    plugin_id, untyped = spec.plugin_id, inspect.Parameter.empty
    returns = trtp.TensorDesc if len(spec.outputs) == 1 else outputs
    trtp.register(plugin_id)(signatures.sign(shape, signatures.signature(True, {}, returns)))
    trtp.autotune(plugin_id)(signatures.sign(autotune, signatures.signature(False, {"outputs": untyped})))
    trtp.impl(plugin_id)(signatures.sign(impl, signatures.signature(True, {"outputs": untyped, "stream": int})))
    if aot and spec.aot:
        trtp.aot_impl(plugin_id)(signatures.sign(aot_impl, signatures.signature(
            True, {"outputs": outputs, "tactic": int}, aot_result)))


def register(aot: bool = True) -> None:
    """Registers the plugins with TensorRT's plugin registry (once per process)."""
    global _registered
    if _registered:
        return
    import tensorrt.plugin as trtp

    # what an aot_impl returns: kernel name, PTX, launch parameters, the extra int32 kernel arguments
    aot_result = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]
    for spec in PLUGINS.values():
        _register_plugin(trtp, spec, aot, aot_result)
    _registered = True


def plugin_modes(aot: bool) -> dict[str, str]:
    """Which implementation each plugin gets in an engine: "aot" (PTX in the engine) or "jit" (Python)."""
    return {name: "aot" if aot and spec.aot else "jit" for name, spec in PLUGINS.items()}


__all__ = ["register", "plugin_modes"]
