"""The plugins' ahead-of-time kernels compile to PTX in TensorRT's calling convention: no GPU needed.

TensorRT launches an AOT plugin's kernel with (input pointers..., int32 scalars..., output
pointers...) and passes null for any parameter after those; a kernel whose PTX entry expects
anything else would read its arguments from the wrong slots. The compilation runs in a child
process without TRITON_INTERPRET, so the kernels are compiled, not interpreted.
"""

import json
import subprocess
import sys

import pytest
from child_env import child_env

pytest.importorskip("triton")

# (plugin launch, arguments): Kimi K2's dimensions (hidden 7168, 384 experts top-8, expert width 2048,
# 64 heads, latent 512, rope 64) and the tiny preset's (hidden 192, width 96, FP8 blocks of 128).
COMPILE = r"""
import json, sys
from triton.backends.compiler import GPUTarget
from k2deploy.plugins.tensorrt import aot

def plugin_launches(n, e, m, k, f, b, s, t, h, c, r, d, v, scaling, softmax_scale):
    routing = dict(top_k=k, n_group=1, topk_group=1, normalise=1, scaling=scaling)
    return [aot.launch("MoeRoute", dict(n=n, e=e, m=m), routing),
            aot.launch("MoeExpertsUp", dict(n=n, k=k, f=f, m=m), dict(block=128)),
            aot.launch("MoeExpertsDown", dict(n=n, k=k, f=f, m=m), dict(block=128)),
            aot.launch("MlaAttention", dict(b=b, s=s, t=t, h=h, c=c, r=r),
                       dict(nope_dim=d, v_dim=v, softmax_scale=softmax_scale))]


launches = {
    "k2": plugin_launches(8, 384, 7168, 8, 2048, 8, 1, 1000, 64, 512, 64, 128, 128, 2.827, 0.1352),
    "tiny": plugin_launches(5, 16, 192, 4, 96, 1, 5, 5, 4, 32, 16, 16, 16, 2.5, 0.25),
}
out = []
for arch in map(int, sys.argv[1].split(",")):
    for dims, group in launches.items():
        for launch in group:
            kernel = aot.compile_launch(launch, target=GPUTarget("cuda", arch, 32))
            out.append({"arch": arch, "dims": dims, "plugin": launch.plugin, "name": kernel.name,
                        "signature": list(launch.signature.values()), "scalars": len(launch.scalars),
                        "parameters": kernel.parameters, "warps": kernel.warps, "shared": kernel.shared,
                        "ptx_header": kernel.ptx.count(".entry")})
# the decode kernel over the FP8 cache itself (no plugin: the runtime's kernel), compiled the same way
import triton
from triton.compiler import ASTSource
from k2deploy.plugins import triton_kernels as tk
fp8 = {}
for arch in map(int, sys.argv[1].split(",")):
    constants = {**tk.mla_constants(128, 128, 512, 64, 0.1352), "GROUP": 128}
    signature = {"q_nope_ptr": "*fp32", "q_pe_ptr": "*fp32", "latent_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                 "rope_ptr": "*fp16", "w_ptr": "*fp32", "mask_ptr": "*i1", **{n: "i32" for n in (
                 "seq", "keys", "heads", "stride_lb", "stride_lt", "stride_sb", "stride_st", "stride_rb", "stride_rt")},
                 "out_ptr": "*fp32"}
    source = ASTSource(fn=tk.mla_attention_fp8_kernel, signature={**signature, **{k: "constexpr" for k in constants}},
                       constexprs=constants)
    fp8[arch] = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                               options={"num_stages": tk.MLA_STAGES}).metadata.shared
print(json.dumps({"plugins": out, "fp8_decode_shared": fp8}))
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=child_env(),
                          timeout=600)


@pytest.fixture(scope="module")
def compiled():
    done = _run(COMPILE, "90,89")  # H100/H200 and L40S/RTX 4090
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["plugins"]


def test_the_fp8_cache_decode_kernel_compiles_too():
    done = _run(COMPILE, "90")
    assert done.returncode == 0, done.stderr[-3000:]
    assert 0 < json.loads(done.stdout)["fp8_decode_shared"]["90"] <= 99 * 1024


def test_every_plugin_compiles_for_hopper_and_ada(compiled):
    from k2deploy.plugins.tensorrt import PLUGINS

    assert {(k["arch"], k["dims"], k["plugin"]) for k in compiled} == {
        (arch, dims, plugin) for arch in (90, 89) for dims in ("k2", "tiny") for plugin in PLUGINS}
    for kernel in compiled:
        assert kernel["ptx_header"] == 1 and kernel["warps"] >= 1
        assert kernel["shared"] <= 99 * 1024, kernel  # fits an Ada SM's 99 KB of shared memory per block


def test_the_ptx_entry_takes_inputs_scalars_outputs_then_only_null_padded_scratch(compiled):
    from k2deploy.plugins.tensorrt import PLUGINS

    for kernel in compiled:
        spec = PLUGINS[kernel["plugin"]]
        expected = ["u64"] * len(spec.inputs) + ["u32"] * kernel["scalars"] + ["u64"] * len(spec.outputs)
        assert ["u64" if t.startswith("*") else "u32" for t in kernel["signature"]] == expected, kernel["plugin"]
        declared, hidden = kernel["parameters"][:len(expected)], kernel["parameters"][len(expected):]
        assert declared == expected, kernel
        assert hidden == ["u64"] * len(hidden) and len(hidden) <= 2, kernel  # Triton's scratch pointers, unused


CONVENTION = r"""
import dataclasses
from k2deploy.plugins.tensorrt import aot

launch = aot.launch("MoeExpertsUp", dict(n=4, k=8, f=256, m=512), dict(block=128))
names = list(launch.signature)
cases = {
    "order": dataclasses.replace(launch, signature={n: launch.signature[n] for n in names[1:2] + names[:1] + names[2:]}),
    "scalar count": dataclasses.replace(launch, scalars=launch.scalars[:2]),
    "float scalar": dataclasses.replace(launch, signature={**launch.signature, "top_k": "fp32"}),
}
for case, bad in cases.items():
    try:
        aot.check_convention(bad)
    except ValueError as exc:
        print(case, "->", exc)
aot.check_convention(launch)
print("ok")
"""


def test_a_launch_off_the_calling_convention_is_refused():
    done = _run(CONVENTION)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "ok" and len(lines) == 4, lines
    assert "not the kernel's runtime parameters" in lines[0]
    assert "TensorRT passes 6 input pointers, 2 scalars and 1 output pointers" in lines[1]
    assert "int32 only" in lines[2]
