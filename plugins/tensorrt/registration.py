"""`tensorrt.plugin` registrations of the three plugins: thin wrappers around the descriptors.

Import only where TensorRT is installed (`register()` imports `tensorrt.plugin`). Per plugin:
- `@trtp.register`: the descriptor's shape/dtype function over TensorRT's symbolic shapes;
- `@trtp.autotune`: the one type combination each plugin supports;
- `@trtp.impl` (just in time, Python at run time): the Triton kernels for MoeRoute and
  MlaAttention, the eager torch op for MoeExperts;
- `@trtp.aot_impl` (ahead of time) for MoeRoute and MlaAttention: the Triton kernel compiled to
  PTX and baked into the engine, so the engine runs without Python plugin code loaded. MoeExperts
  has none (see its descriptor): engines of MoE layers need `register()` before deserialising.
"""

from __future__ import annotations

from typing import Tuple

from .descriptors import BOOL, FLOAT, FP8, INT64, PLUGINS, UINT8, TensorSpec, output_specs

_registered = False


def _trt_dtypes():
    import tensorrt as trt

    return {FLOAT: trt.float32, INT64: trt.int64, BOOL: trt.bool, FP8: trt.fp8, UINT8: trt.uint8,
            "FLOAT16": trt.float16, "BFLOAT16": trt.bfloat16, "INT32": trt.int32}


def _spec(desc) -> TensorSpec:
    """A TensorDesc as a TensorSpec: constant dims as ints, the others as their shape expressions."""
    names = {v: k for k, v in _trt_dtypes().items()}
    dims = []
    for i in range(desc.ndim):
        expr = desc.shape_expr[i]
        dims.append(expr.constant_value if expr.is_constant else expr)
    return TensorSpec(tuple(dims), names.get(desc.dtype, str(desc.dtype)))


def _descs(op: str, inputs, attributes: dict):
    import tensorrt.plugin as trtp

    dtypes = _trt_dtypes()
    outs = output_specs(op, [_spec(d) for d in inputs], attributes)
    return tuple(trtp.from_shape_expr(tuple(o.shape), dtype=dtypes[o.dtype]) for o in outs)


def _torch(tensor):
    import torch

    return torch.as_tensor(tensor, device="cuda")


def _int(expr) -> int:
    if not expr.is_constant:
        raise ValueError("the AOT kernel needs this dimension fixed at build time")
    return int(expr.constant_value)


def register(aot: bool = True) -> None:
    """Registers the plugins with TensorRT's plugin registry (once per process)."""
    global _registered
    if _registered:
        return
    import tensorrt.plugin as trtp

    route, experts, attention = (f"{PLUGINS[n].plugin_id}" for n in ("MoeRoute", "MoeExperts", "MlaAttention"))

    # -- MoeRoute ---------------------------------------------------------------------------
    @trtp.register(route)
    def _route_desc(x: trtp.TensorDesc, router_weight: trtp.TensorDesc, correction_bias: trtp.TensorDesc,
                    top_k: int, n_group: int, topk_group: int, normalise: int,
                    scaling: float) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        return _descs("MoeRoute", (x, router_weight, correction_bias),
                      dict(top_k=top_k, n_group=n_group, topk_group=topk_group, normalise=normalise, scaling=scaling))

    @trtp.autotune(route)
    def _route_autotune(x, router_weight, correction_bias, outputs):
        return [trtp.AutoTuneCombination("FP32, FP32, FP32, FP32, INT64")]

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
                       outputs: Tuple[trtp.TensorDesc], tactic: int):
            from ..triton_kernels import compile_ptx, moe_route_kernel, route_constants

            experts_n, hidden = _int(router_weight.shape_expr[0]), _int(router_weight.shape_expr[1])
            name, ptx, warps, shared = compile_ptx(
                moe_route_kernel,
                {"x_ptr": "*fp32", "w_ptr": "*fp32", "bias_ptr": "*fp32", "n_tokens": "i32", "hidden": "i32",
                 "experts": "i32", "weights_ptr": "*fp32", "ids_ptr": "*i64"},
                route_constants(experts_n, hidden, top_k, n_group, topk_group, bool(normalise), scaling))
            launch = trtp.KernelLaunchParams()
            launch.grid_x = x.shape_expr[0]
            launch.block_x = warps * 32
            launch.shared_mem = shared
            extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in (x.shape_expr[0], hidden, experts_n)])
            return name.encode(), ptx.encode(), launch, extra

    # -- MoeExperts -------------------------------------------------------------------------
    @trtp.register(experts)
    def _experts_desc(x: trtp.TensorDesc, expert_ids: trtp.TensorDesc, route_weights: trtp.TensorDesc,
                      gate_bits: trtp.TensorDesc, gate_scale: trtp.TensorDesc, up_bits: trtp.TensorDesc,
                      up_scale: trtp.TensorDesc, down_bits: trtp.TensorDesc, down_scale: trtp.TensorDesc,
                      block: int) -> trtp.TensorDesc:
        return _descs("MoeExperts", (x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale,
                                     down_bits, down_scale), dict(block=block))[0]

    @trtp.autotune(experts)
    def _experts_autotune(x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale, down_bits,
                          down_scale, outputs):
        return [trtp.AutoTuneCombination("FP32, INT64, FP32, FP8, FP32, FP8, FP32, FP8, FP32, FP32")]

    @trtp.impl(experts)
    def _experts_impl(x, expert_ids, route_weights, gate_bits, gate_scale, up_bits, up_scale, down_bits, down_scale,
                      block: int, outputs, stream: int) -> None:
        import torch

        from ..experts import experts_eager

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            y = experts_eager(*(_torch(t) for t in (x, expert_ids, route_weights, gate_bits, gate_scale, up_bits,
                                                    up_scale, down_bits, down_scale)), block)
            _torch(outputs[0]).copy_(y)

    # -- MlaAttention -----------------------------------------------------------------------
    @trtp.register(attention)
    def _attention_desc(q_nope: trtp.TensorDesc, q_pe: trtp.TensorDesc, latent: trtp.TensorDesc,
                        rope: trtp.TensorDesc, kv_b_weight: trtp.TensorDesc, mask: trtp.TensorDesc,
                        nope_dim: int, v_dim: int, softmax_scale: float) -> trtp.TensorDesc:
        return _descs("MlaAttention", (q_nope, q_pe, latent, rope, kv_b_weight, mask),
                      dict(nope_dim=nope_dim, v_dim=v_dim, softmax_scale=softmax_scale))[0]

    @trtp.autotune(attention)
    def _attention_autotune(q_nope, q_pe, latent, rope, kv_b_weight, mask, outputs):
        return [trtp.AutoTuneCombination("FP32, FP32, FP32, FP32, FP32, BOOL, FP32")]

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
                           tactic: int):
            from ..triton_kernels import compile_ptx, mla_attention_kernel, mla_constants

            c, r, heads = _int(latent.shape_expr[2]), _int(rope.shape_expr[2]), _int(q_nope.shape_expr[2])
            constants = mla_constants(nope_dim, v_dim, c, r, softmax_scale)
            name, ptx, warps, shared = compile_ptx(
                mla_attention_kernel,
                {"q_nope_ptr": "*fp32", "q_pe_ptr": "*fp32", "latent_ptr": "*fp32", "rope_ptr": "*fp32",
                 "w_ptr": "*fp32", "mask_ptr": "*i1", "seq": "i32", "keys": "i32", "heads": "i32",
                 "stride_lb": "i32", "stride_lt": "i32", "stride_rb": "i32", "stride_rt": "i32", "out_ptr": "*fp32"},
                constants)
            seq, keys = q_nope.shape_expr[1], latent.shape_expr[1]
            launch = trtp.KernelLaunchParams()
            launch.grid_x = q_nope.shape_expr[0] * seq
            launch.grid_y = -(-heads // constants["BLOCK_H"])
            launch.block_x = warps * 32
            launch.shared_mem = shared
            scalars = (seq, keys, heads, keys * c, c, keys * r, r)  # strides of latent [b, t, c] and rope [b, t, r]
            extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(e) for e in scalars])
            return name.encode(), ptx.encode(), launch, extra

    _registered = True


def plugin_modes(aot: bool) -> dict[str, str]:
    """Which implementation each plugin gets in an engine: "aot" (PTX in the engine) or "jit" (Python)."""
    return {name: "aot" if aot and spec.aot else "jit" for name, spec in PLUGINS.items()}


__all__ = ["register", "plugin_modes"]
