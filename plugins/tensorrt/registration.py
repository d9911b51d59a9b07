"""`tensorrt.plugin` registrations of the three plugins: thin wrappers around the descriptors.

Import only where TensorRT is installed (`register()` imports `tensorrt.plugin`). Per plugin:
- `@trtp.register`: the descriptor's shape/dtype function over TensorRT's symbolic shapes;
- `@trtp.autotune`: the one type combination each plugin supports;
- `@trtp.impl` (just in time, Python at run time): the Triton kernels, launched through torch;
- `@trtp.aot_impl` (ahead of time): the same Triton kernel compiled to PTX and baked into the
  engine, so the engine runs without Python plugin code loaded. Every plugin has one; MoeExperts
  runs as two plugins (MoeExpertsUp, MoeExpertsDown) because an AOT plugin is one kernel launch.

TensorRT reads these functions' signatures: the annotations must be the classes themselves
(no `from __future__ import annotations` here), an aot_impl needs its return annotation, and
each function's parameters follow the registered inputs and attributes in order.
"""

from typing import Tuple, Union

from .descriptors import BOOL, FLOAT, FP8, INT64, PLUGINS, UINT8, TensorSpec, output_specs

_registered = False


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


def _descs(op: str, inputs, attributes: dict):
    import tensorrt.plugin as trtp

    dtypes = _trt_dtypes()
    outs = output_specs(op, [_spec(d) for d in inputs], attributes)
    return tuple(trtp.from_shape_expr(tuple(o.shape), dtype=dtypes[o.dtype]) for o in outs)


def _torch(tensor):
    import torch

    return torch.as_tensor(tensor, device="cuda")


def _int(expr) -> int:
    if not _constant(expr):
        raise ValueError("the AOT kernel needs this dimension fixed at build time")
    return int(expr.constant_value())


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


def register(aot: bool = True) -> None:
    """Registers the plugins with TensorRT's plugin registry (once per process)."""
    global _registered
    if _registered:
        return
    import tensorrt.plugin as trtp

    # what an aot_impl returns: kernel name, PTX, launch parameters, the extra int32 kernel arguments
    AotResult = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]
    route, experts_up, experts_down, attention = (
        PLUGINS[n].plugin_id for n in ("MoeRoute", "MoeExpertsUp", "MoeExpertsDown", "MlaAttention"))

    # -- MoeRoute ---------------------------------------------------------------------------
    @trtp.register(route)
    def _route_desc(x: trtp.TensorDesc, router_weight: trtp.TensorDesc, correction_bias: trtp.TensorDesc,
                    top_k: int, n_group: int, topk_group: int, normalise: int,
                    scaling: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        return _descs("MoeRoute", (x, router_weight, correction_bias),
                      dict(top_k=top_k, n_group=n_group, topk_group=topk_group, normalise=normalise, scaling=scaling))

    @trtp.autotune(route)
    def _route_autotune(x, router_weight, correction_bias, outputs):
        return [trtp.AutoTuneCombination("FP32,FP32,FP32,FP32,INT64")]

    @trtp.impl(route)
    def _route_impl(x, router_weight, correction_bias, top_k: int, n_group: int, topk_group: int, normalise: int,
                    scaling: float, outputs, stream: int) -> None:
        import torch

        from ..triton_kernels import moe_route

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            weights, ids = moe_route(_torch(x), _torch(router_weight), _torch(correction_bias), top_k, n_group,
                                     topk_group, bool(normalise), scaling)
            _torch(outputs[0]).copy_(weights)
            _torch(outputs[1]).copy_(ids)

    if aot:
        @trtp.aot_impl(route)
        def _route_aot(x: trtp.TensorDesc, router_weight: trtp.TensorDesc, correction_bias: trtp.TensorDesc,
                       top_k: int, n_group: int, topk_group: int, normalise: int, scaling: float,
                       outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
            from .aot import route_launch

            return _aot(route_launch(x.shape_expr[0], _int(router_weight.shape_expr[0]),
                                     _int(router_weight.shape_expr[1]), top_k, n_group, topk_group, normalise,
                                     scaling))

    # -- MoeExpertsUp / MoeExpertsDown (MoeExperts in a TensorRT copy) -------------------------
    @trtp.register(experts_up)
    def _up_desc(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, gate_bits: trtp.TensorDesc,
                 gate_scale: trtp.TensorDesc, up_bits: trtp.TensorDesc, up_scale: trtp.TensorDesc,
                 block: int) -> trtp.TensorDesc:
        return _descs("MoeExpertsUp", (x, expert_ids, gate_bits, gate_scale, up_bits, up_scale), dict(block=block))[0]

    @trtp.autotune(experts_up)
    def _up_autotune(x, expert_ids, gate_bits, gate_scale, up_bits, up_scale, outputs):
        return [trtp.AutoTuneCombination("FP32,INT64,FP8,FP32,FP8,FP32,FP32")]

    @trtp.impl(experts_up)
    def _up_impl(x, expert_ids, gate_bits, gate_scale, up_bits, up_scale, block: int, outputs, stream: int) -> None:
        import torch

        from ..triton_kernels import moe_experts_up

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            hidden = moe_experts_up(*(_torch(t) for t in (x, expert_ids, gate_bits, gate_scale, up_bits, up_scale)),
                                    block)
            _torch(outputs[0]).copy_(hidden)

    @trtp.register(experts_down)
    def _down_desc(hidden: trtp.TensorDesc, expert_ids: trtp.TensorDesc, route_weights: trtp.TensorDesc,
                   down_bits: trtp.TensorDesc, down_scale: trtp.TensorDesc, block: int) -> trtp.TensorDesc:
        return _descs("MoeExpertsDown", (hidden, expert_ids, route_weights, down_bits, down_scale),
                      dict(block=block))[0]

    @trtp.autotune(experts_down)
    def _down_autotune(hidden, expert_ids, route_weights, down_bits, down_scale, outputs):
        return [trtp.AutoTuneCombination("FP32,INT64,FP32,FP8,FP32,FP32")]

    @trtp.impl(experts_down)
    def _down_impl(hidden, expert_ids, route_weights, down_bits, down_scale, block: int, outputs,
                   stream: int) -> None:
        import torch

        from ..triton_kernels import moe_experts_down

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            y = moe_experts_down(*(_torch(t) for t in (hidden, expert_ids, route_weights, down_bits, down_scale)),
                                 block)
            _torch(outputs[0]).copy_(y)

    if aot:
        @trtp.aot_impl(experts_up)
        def _up_aot(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, gate_bits: trtp.TensorDesc,
                    gate_scale: trtp.TensorDesc, up_bits: trtp.TensorDesc, up_scale: trtp.TensorDesc, block: int,
                    outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
            from .aot import experts_up_launch

            return _aot(experts_up_launch(x.shape_expr[0], *(_int(e) for e in (
                expert_ids.shape_expr[1], gate_bits.shape_expr[1], gate_bits.shape_expr[2])), block))

        @trtp.aot_impl(experts_down)
        def _down_aot(hidden: trtp.TensorDesc, expert_ids: trtp.TensorDesc, route_weights: trtp.TensorDesc,
                      down_bits: trtp.TensorDesc, down_scale: trtp.TensorDesc, block: int,
                      outputs: Tuple[trtp.TensorDesc], tactic: int) -> AotResult:
            from .aot import experts_down_launch

            return _aot(experts_down_launch(hidden.shape_expr[0], *(_int(e) for e in (
                expert_ids.shape_expr[1], down_bits.shape_expr[1], down_bits.shape_expr[2])), block))

    # -- MlaAttention -----------------------------------------------------------------------
    @trtp.register(attention)
    def _attention_desc(q_nope: trtp.TensorDesc, q_pe: trtp.TensorDesc, latent: trtp.TensorDesc,
                        rope: trtp.TensorDesc, kv_b_weight: trtp.TensorDesc, mask: trtp.TensorDesc,
                        nope_dim: int, v_dim: int, softmax_scale: float) -> trtp.TensorDesc:
        return _descs("MlaAttention", (q_nope, q_pe, latent, rope, kv_b_weight, mask),
                      dict(nope_dim=nope_dim, v_dim=v_dim, softmax_scale=softmax_scale))[0]

    @trtp.autotune(attention)
    def _attention_autotune(q_nope, q_pe, latent, rope, kv_b_weight, mask, outputs):
        return [trtp.AutoTuneCombination("FP32,FP32,FP32,FP32,FP32,BOOL,FP32")]

    @trtp.impl(attention)
    def _attention_impl(q_nope, q_pe, latent, rope, kv_b_weight, mask, nope_dim: int, v_dim: int,
                        softmax_scale: float, outputs, stream: int) -> None:
        import torch

        from ..triton_kernels import mla_attention

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            out = mla_attention(*(_torch(t) for t in (q_nope, q_pe, latent, rope, kv_b_weight, mask)), nope_dim,
                                v_dim, softmax_scale)
            _torch(outputs[0]).copy_(out)

    if aot:
        @trtp.aot_impl(attention)
        def _attention_aot(q_nope: trtp.TensorDesc, q_pe: trtp.TensorDesc, latent: trtp.TensorDesc,
                           rope: trtp.TensorDesc, kv_b_weight: trtp.TensorDesc, mask: trtp.TensorDesc,
                           nope_dim: int, v_dim: int, softmax_scale: float, outputs: Tuple[trtp.TensorDesc],
                           tactic: int) -> AotResult:
            from .aot import attention_launch

            return _aot(attention_launch(q_nope.shape_expr[0], q_nope.shape_expr[1], latent.shape_expr[1],
                                         *(_int(e) for e in (q_nope.shape_expr[2], latent.shape_expr[2],
                                                             rope.shape_expr[2])), nope_dim, v_dim, softmax_scale))

    _registered = True


def plugin_modes(aot: bool) -> dict[str, str]:
    """Which implementation each plugin gets in an engine: "aot" (PTX in the engine) or "jit" (Python)."""
    return {name: "aot" if aot and spec.aot else "jit" for name, spec in PLUGINS.items()}


__all__ = ["register", "plugin_modes"]
