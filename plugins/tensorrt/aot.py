"""Each plugin's ahead-of-time kernel launch as plain data, and its compilation to PTX.

TensorRT launches an AOT plugin's kernel with (input pointers..., extra int32 scalars...,
output pointers...), padding any further kernel parameter with null. So each launch here names
the Triton kernel, its runtime parameters in declaration order with their Triton types, the
constexprs, the grid and the scalars' values. The dimensions may be ints (tests) or TensorRT
shape expressions (`registration.py`); `compile_launch` checks the calling convention against
the plugin's descriptor and Triton's launch metadata before handing TensorRT the PTX.

Imports triton: import it only where triton is installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import triton

from .. import triton_kernels as tk
from .descriptors import PLUGINS


@dataclass(frozen=True)
class AotLaunch:
    plugin: str
    kernel: Any  # the @triton.jit function
    signature: dict[str, str]  # runtime parameter -> Triton type ("*fp32", "i32"), in declaration order
    constexprs: dict[str, Any]
    grid: tuple  # (x,) or (x, y): ints or shape expressions
    scalars: tuple  # the int32 scalars' values, in signature order
    options: dict = field(default_factory=dict)  # Triton compile options (num_stages, ...)


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    ptx: str
    warps: int
    shared: int  # bytes of shared memory per program
    parameters: list[str]  # the PTX entry's parameter types (".u64" pointers, ".u32" scalars), hidden ones too


def route_launch(n_tokens, experts: int, hidden: int, top_k: int, n_group: int, topk_group: int, normalise: int,
                 scaling: float) -> AotLaunch:
    """MoeRoute: one program per token."""
    return AotLaunch(
        "MoeRoute", tk.moe_route_kernel,
        {"x_ptr": "*fp32", "w_ptr": "*fp32", "bias_ptr": "*fp32", "n_tokens": "i32", "hidden": "i32",
         "experts": "i32", "weights_ptr": "*fp32", "ids_ptr": "*i64"},
        tk.route_constants(experts, hidden, top_k, n_group, topk_group, bool(normalise), scaling),
        grid=(n_tokens,), scalars=(n_tokens, hidden, experts))


def experts_up_launch(n_tokens, top_k: int, width: int, hidden: int, block: int) -> AotLaunch:
    """MoeExpertsUp: one program per (token-expert pair, block of expert rows)."""
    constants = tk.experts_constants(block)
    return AotLaunch(
        "MoeExpertsUp", tk.moe_experts_up_kernel,
        {"x_ptr": "*fp32", "ids_ptr": "*i64", "gate_ptr": "*u8", "gate_scale_ptr": "*fp32", "up_ptr": "*u8",
         "up_scale_ptr": "*fp32", "top_k": "i32", "hidden": "i32", "width": "i32", "out_ptr": "*fp32"},
        constants, grid=(n_tokens * top_k, -(-width // constants["BLOCK_R"])), scalars=(top_k, hidden, width))


def experts_down_launch(n_tokens, top_k: int, hidden: int, width: int, block: int) -> AotLaunch:
    """MoeExpertsDown: one program per (token, block of output rows)."""
    constants = tk.experts_constants(block)
    return AotLaunch(
        "MoeExpertsDown", tk.moe_experts_down_kernel,
        {"h_ptr": "*fp32", "ids_ptr": "*i64", "weights_ptr": "*fp32", "down_ptr": "*u8", "down_scale_ptr": "*fp32",
         "top_k": "i32", "hidden": "i32", "width": "i32", "out_ptr": "*fp32"},
        constants, grid=(n_tokens, -(-hidden // constants["BLOCK_R"])), scalars=(top_k, hidden, width))


def attention_launch(batch, seq, keys, heads: int, latent_dim: int, rope_dim: int, nope_dim: int, v_dim: int,
                     softmax_scale: float) -> AotLaunch:
    """MlaAttention: one program per (row and new position, block of heads); latent [b, t, c] and rope
    [b, t, r] contiguous, so their strides are (t * c, c) and (t * r, r)."""
    constants = tk.mla_constants(nope_dim, v_dim, latent_dim, rope_dim, softmax_scale)
    return AotLaunch(
        "MlaAttention", tk.mla_attention_kernel,
        {"q_nope_ptr": "*fp32", "q_pe_ptr": "*fp32", "latent_ptr": "*fp32", "rope_ptr": "*fp32", "w_ptr": "*fp32",
         "mask_ptr": "*i1", "seq": "i32", "keys": "i32", "heads": "i32", "stride_lb": "i32", "stride_lt": "i32",
         "stride_rb": "i32", "stride_rt": "i32", "out_ptr": "*fp32"},
        constants, grid=(batch * seq, -(-heads // constants["BLOCK_H"])),
        scalars=(seq, keys, heads, keys * latent_dim, latent_dim, keys * rope_dim, rope_dim),
        options={"num_stages": tk.MLA_STAGES})


def check_convention(launch: AotLaunch) -> None:
    """The kernel's runtime parameters are the signature's, in order: the plugin's inputs as pointers, then
    one scalar per value, then its outputs as pointers. ValueError naming what is off."""
    params = launch.kernel.params
    runtime = [p.name for p in params if not p.is_constexpr]
    declared = {p.name for p in params if p.is_constexpr}
    if runtime != list(launch.signature):
        raise ValueError(f"{launch.plugin}: signature {list(launch.signature)} is not the kernel's runtime "
                         f"parameters {runtime} in order")
    if set(launch.constexprs) != declared:
        raise ValueError(f"{launch.plugin}: constexprs {sorted(launch.constexprs)} are not the kernel's "
                         f"{sorted(declared)}")
    spec = PLUGINS[launch.plugin]
    kinds = ["pointer" if t.startswith("*") else "scalar" for t in launch.signature.values()]
    n_in, n_out = len(spec.inputs), len(spec.outputs)
    expected = ["pointer"] * n_in + ["scalar"] * len(launch.scalars) + ["pointer"] * n_out
    if kinds != expected:
        raise ValueError(f"{launch.plugin}: TensorRT passes {n_in} input pointers, {len(launch.scalars)} scalars "
                         f"and {n_out} output pointers; the signature has {kinds}")
    if any(t not in ("i32",) for t in launch.signature.values() if not t.startswith("*")):
        raise ValueError(f"{launch.plugin}: TensorRT's extra kernel arguments are int32 only")


def compile_launch(launch: AotLaunch, target=None, max_ptx_version: int | None = None) -> CompiledKernel:
    """The launch's kernel as PTX for `target` (a triton GPUTarget; default: this process's GPU). When the PTX
    ISA Triton picks is above max_ptx_version (what the driver loads), it is compiled again at that ISA."""
    check_convention(launch)
    from triton.compiler import ASTSource

    source = ASTSource(fn=launch.kernel, signature={**launch.signature, **{k: "constexpr" for k in launch.constexprs}},
                       constexprs=launch.constexprs)
    target = target or triton.runtime.driver.active.get_current_target()
    options = {"enable_fp_fusion": True, **launch.options}  # fusion: Triton's default for its own launches
    compiled = triton.compile(source, target=target, options=options)
    if max_ptx_version and _ptx_version(compiled.asm["ptx"]) > max_ptx_version:
        compiled = triton.compile(source, target=target, options={**options, "ptx_version": max_ptx_version})
    meta = compiled.metadata
    unsupported = {field: getattr(meta, field) for field, default in (
        ("global_scratch_size", 0), ("profile_scratch_size", 0), ("num_ctas", 1), ("launch_cooperative_grid", False),
        ("launch_pdl", False), ("tmem_size", 0)) if getattr(meta, field, default) != default}
    if unsupported:  # TensorRT passes null for the hidden scratch pointers and launches a plain grid
        raise ValueError(f"{launch.plugin}: kernel {meta.name} needs launch features TensorRT's AOT plugins do "
                         f"not provide: {unsupported}")
    ptx = compiled.asm["ptx"]
    return CompiledKernel(meta.name, ptx, meta.num_warps, meta.shared, _entry_parameters(ptx, meta.name))


def _ptx_version(ptx: str) -> int:
    """`.version 8.7` -> 87, as Triton's ptx_version option counts."""
    major, minor = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", ptx, re.M).groups()
    return int(major) * 10 + int(minor)


def _entry_parameters(ptx: str, name: str) -> list[str]:
    entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    if entry is None:
        raise ValueError(f"no .entry {name} in the compiled PTX")
    return re.findall(r"\.param\s+\.(\w+)", entry.group(1))


def driver_ptx_version() -> int | None:
    """The newest PTX ISA this machine's CUDA driver loads (None when unknown): Triton's bundled ptxas may
    be newer than the driver, which then refuses the PTX when the engine runs."""
    try:
        try:
            from cuda.bindings import driver
        except ImportError:
            from cuda import cuda as driver
        from triton.backends.nvidia.compiler import ptx_get_version

        status, version = driver.cuDriverGetVersion()
        if int(status) != 0:
            return None
        return int(ptx_get_version(f"{version // 1000}.{version % 1000 // 10}"))
    except Exception:  # noqa: BLE001 - no driver, no cuda-python, or Triton's internals moved
        return None


__all__ = ["AotLaunch", "CompiledKernel", "attention_launch", "check_convention", "compile_launch",
           "driver_ptx_version", "experts_down_launch", "experts_up_launch", "route_launch"]
