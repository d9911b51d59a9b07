"""Each plugin's ahead-of-time kernel launch as plain data, and its compilation to PTX.

TensorRT launches an AOT plugin's kernel with (input pointers..., extra int32 scalars...,
output pointers...), padding any further kernel parameter with null. Each op's file gives its
kernel, constexprs, grid and scalars (`Plugin.launch`); `launch` here adds the runtime parameters
in declaration order with their Triton types, typed from the op's declaration. The dimensions may
be ints (tests) or TensorRT shape expressions (`registration.py`); `compile_launch` checks the
calling convention against the plugin's descriptor and Triton's launch metadata before handing
TensorRT the PTX.

Imports triton: import it only where triton is installed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import triton

from ..op_spec import BOOL, FLOAT, FP8, INT64
from .descriptors import PLUGINS

# a plugin tensor's dtype -> the Triton type of its pointer (the expert kernels decode FP8 from its bytes)
_POINTER_TYPES = {FLOAT: "*fp32", INT64: "*i64", BOOL: "*i1", FP8: "*u8"}


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


def launch(plugin: str, dims: dict[str, Any], attributes: dict[str, Any]) -> AotLaunch:
    """Plugin `plugin`'s AOT kernel launch for these bound shape symbols (`OpSpec.bind`; ints or shape
    expressions) and attributes. Its signature is the kernel's runtime parameters in order, typed as TensorRT
    passes them: a pointer per plugin input (of its plugin dtype), an int32 per scalar, a pointer per output."""
    op = PLUGINS[plugin].op
    kernel = op.plugin.launch(dims, **op.attribute_values(attributes))
    names = [p.name for p in kernel.kernel.params if not p.is_constexpr]
    types = ([_POINTER_TYPES[t.dtypes[0]] for t in op.inputs.values()] + ["i32"] * len(kernel.scalars)
             + [_POINTER_TYPES[t.dtypes[0]] for t in op.outputs.values()])
    if len(names) != len(types):
        raise ValueError(f"{plugin}: kernel {kernel.kernel.__name__} has {len(names)} runtime parameters; TensorRT "
                         f"passes {len(op.inputs)} input pointers, {len(kernel.scalars)} scalars and "
                         f"{len(op.outputs)} output pointers")
    return AotLaunch(plugin, kernel.kernel, dict(zip(names, types)), kernel.constexprs, kernel.grid, kernel.scalars,
                     kernel.options)


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


__all__ = ["AotLaunch", "CompiledKernel", "check_convention", "compile_launch", "driver_ptx_version", "launch"]
