"""The plugin registrations run against a stand-in for `tensorrt.plugin` (tests/stand_in/), modelled on
TensorRT's documented API and the checks it makes when a plugin is registered: no TensorRT needed.

For each plugin at Kimi K2's dimensions, with symbolic token, row and key counts: the registration is
accepted, its shape function gives the descriptor's outputs, its autotune combination types every
input and output, and its aot_impl returns the kernel's name, its PTX (compiled for sm_90), a launch
grid over the symbolic dimensions and one int32 argument per kernel scalar. Runs in a child process
that finds the stand-in first on its path and compiles the kernels (no TRITON_INTERPRET).
"""

import json
import subprocess
import sys

import pytest
from child_env import STAND_IN, child_env

pytest.importorskip("triton")

M, E, K, F, H, D, V, C, R = 7168, 384, 8, 2048, 64, 128, 128, 512, 64

SCRIPT = r"""
import functools, json, sys
import tensorrt as trt
import tensorrt.plugin as trtp
from triton.backends.compiler import GPUTarget
from k2deploy.plugins.tensorrt import aot, registration
from k2deploy.plugins.tensorrt.descriptors import PLUGINS

assert trt.__version__.endswith("stand-in"), trt.__file__
aot.compile_launch = functools.partial(aot.compile_launch, target=GPUTarget("cuda", 90, 32))
registration.register(aot=True)
registration.register(aot=True)  # a second call does nothing
dtypes = {"FLOAT": trt.float32, "INT64": trt.int64, "BOOL": trt.bool, "FLOAT8E4M3FN": trt.fp8}
results = {}
for name, case in json.loads(sys.argv[1]).items():
    entry = trtp.REGISTRY[PLUGINS[name].plugin_id]
    inputs = [trtp.TensorDesc(shape, dtypes[dtype]) for shape, dtype in case["inputs"]]
    outputs = entry["register"](*inputs, **case["attributes"])
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    combination, = entry["autotune"](*inputs, outputs)
    kernel, ptx, launch, extra = entry["aot_impl"](*inputs, **case["attributes"], outputs=outputs, tactic=0)
    results[name] = {
        "outputs": [[[e.value for e in o.shape_expr], o.dtype.name] for o in outputs],
        "io_types": combination.io_types, "has_impl": "impl" in entry,
        "kernel": kernel.decode(), "entry_in_ptx": (b".entry " + kernel) in ptx,
        "grid": [launch.grid_x.value if hasattr(launch.grid_x, "value") else launch.grid_x, launch.grid_y],
        "block_x": launch.block_x, "shared": launch.shared_mem,
        "extra": [e.value.value if hasattr(e.value, "value") else e.value for e in extra],
    }
print(json.dumps(results))
"""

CASES = {
    "MoeRoute": {"inputs": [[["n", M], "FLOAT"], [[E, M], "FLOAT"], [[E], "FLOAT"]],
                 "attributes": {"top_k": K, "n_group": 1, "topk_group": 1, "normalise": 1, "scaling": 2.827}},
    "MoeExpertsUp": {"inputs": [[["n", M], "FLOAT"], [["n", K], "INT64"], [[E, F, M], "FLOAT8E4M3FN"],
                                [[E, F // 128, M // 128], "FLOAT"], [[E, F, M], "FLOAT8E4M3FN"],
                                [[E, F // 128, M // 128], "FLOAT"]], "attributes": {"block": 128}},
    "MoeExpertsDown": {"inputs": [[["n", K, F], "FLOAT"], [["n", K], "INT64"], [["n", K], "FLOAT"],
                                  [[E, M, F], "FLOAT8E4M3FN"], [[E, M // 128, F // 128], "FLOAT"]],
                       "attributes": {"block": 128}},
    "MlaAttention": {"inputs": [[["b", "s", H, D], "FLOAT"], [["b", "s", H, R], "FLOAT"], [["b", "t", C], "FLOAT"],
                                [["b", "t", R], "FLOAT"], [[H * (D + V), C], "FLOAT"], [["b", "s", "t"], "BOOL"]],
                     "attributes": {"nope_dim": D, "v_dim": V, "softmax_scale": 0.1352}},
}


@pytest.fixture(scope="module")
def registered():
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], capture_output=True, text=True,
                          env=child_env(STAND_IN), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_every_plugin_registers_with_a_shape_function_an_autotune_an_impl_and_an_aot_impl(registered):
    from k2deploy.plugins.tensorrt import PLUGINS

    assert set(registered) == set(PLUGINS)
    assert all(r["has_impl"] for r in registered.values())


def test_the_shape_functions_give_the_descriptors_outputs_over_symbolic_dims(registered):
    assert registered["MoeRoute"]["outputs"] == [[["n", K], "FLOAT"], [["n", K], "INT64"]]
    assert registered["MoeExpertsUp"]["outputs"] == [[["n", K, F], "FLOAT"]]
    assert registered["MoeExpertsDown"]["outputs"] == [[["n", M], "FLOAT"]]
    assert registered["MlaAttention"]["outputs"] == [[["b", "s", H, V], "FLOAT"]]


def test_each_autotune_combination_types_every_input_and_output(registered):
    names = {"FLOAT": "FP32", "INT64": "INT64", "BOOL": "BOOL", "FLOAT8E4M3FN": "FP8"}
    for plugin, result in registered.items():
        expected = [names[dtype] for _, dtype in CASES[plugin]["inputs"]] + [names[d] for _, d in result["outputs"]]
        assert result["io_types"] == expected, plugin


def test_each_aot_impl_returns_its_kernel_a_symbolic_grid_and_its_scalars(registered):
    expected = {  # grid (x, y) and the int32 scalars TensorRT passes, for K2's dims
        "MoeRoute": (["n", 1], ["n", M, E]),
        "MoeExpertsUp": (["n*8", F // 32], [K, M, F]),
        "MoeExpertsDown": (["n", M // 32], [K, M, F]),
        "MlaAttention": (["b*s", H // 16], ["s", "t", H, "t*512", C, "t*64", R]),
    }
    for plugin, result in registered.items():
        assert result["entry_in_ptx"] and result["kernel"].endswith("_kernel"), plugin
        assert (result["grid"], result["extra"]) == expected[plugin], plugin
        assert result["block_x"] in (32, 64, 128, 256) and 0 < result["shared"] <= 99 * 1024, plugin
