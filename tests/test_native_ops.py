"""The native step's ops one by one against their eager references, at every instruction-set level this CPU runs (as
llama.cpp's test-backend-ops checks each op of each backend): rms norm and rope (export's), routing (plugins/routing.py),
the int8 and 4-bit products of a weight held in tiles (plugins/int8.py, plugins/int4.py, with the step's own activation
quantisation). Each level runs in a process of its own (a process loads one build); each op is its own test, so a
change that breaks one op fails that op's test by name. The whole-layer tests (tests/test_native_decode.py) stay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from child_env import child_env  # noqa: E402

from k2deploy.runtime.backends.native import build  # noqa: E402
from k2deploy.runtime.backends.native.build import NativeUnavailable  # noqa: E402

OPS = ("rms_norm", "rope", "route_one_group", "route_grouped", "linear_int8", "linear_int4")

# argv: nothing; prints {op: worst error} for the level $K2DEPLOY_NATIVE_ISA names
_CHECK = r"""
import ctypes, json
import numpy as np
import torch
from k2deploy.core import native_tiles
from k2deploy.core.checkpoint.presets import preset_config
from k2deploy.export.rope import Rope
from k2deploy.plugins.int4 import dequantize_nibbles
from k2deploy.plugins.int8 import dequantize_rows, quantize_rows
from k2deploy.plugins.routing import route
from k2deploy.runtime.backends.native.build import library

lib = library()
f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)
ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
rng = np.random.default_rng(0)
worst = {}

def relative(got, want):
    return float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max() / np.abs(want).max())

# rms norm: rows of several lengths' worth of lanes, and a tail
x, w = f32(rng.normal(0, 3, (5, 1001))), f32(rng.normal(1, 0.2, 1001))
out = np.empty_like(x)
lib.k2_op_rms_norm(ptr(x), ptr(w), 5, 1001, ctypes.c_float(1e-6), ptr(out))
t = torch.from_numpy(x)
want = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.from_numpy(w)).numpy()
worst["rms_norm"] = relative(out, want)

# rope: Kimi K2's (YaRN) frequencies and scale, positions near and far
config = preset_config("k2")
rope = Rope(config)
positions = np.array([0, 1, 7, 100, 4095, 65000, 131071], np.int32)
x = f32(rng.normal(0, 1, (len(positions), config.qk_rope_head_dim)))
want = rope(torch.from_numpy(x)[None], torch.from_numpy(positions.astype(np.int64))[None])[0].numpy()
got = x.copy()
lib.k2_op_rope(ptr(got), len(positions), x.shape[1], ptr(f32(rope.frequencies.numpy())), ptr(positions),
               ctypes.c_float(rope.scale))
worst["rope"] = relative(got, want)

# routing: Kimi K2's settings (one group) and DeepSeek-V3's (8 groups, 4 kept)
for name, (experts, top_k, groups, kept, scaling) in {"route_one_group": (64, 8, 1, 1, 2.827),
                                                      "route_grouped": (64, 8, 8, 4, 2.5)}.items():
    x, router, bias = f32(rng.normal(0, 1, (9, 96))), f32(rng.normal(0, 0.1, (experts, 96))), f32(rng.normal(0, 0.05, experts))
    ids, weights = np.empty((9, top_k), np.int32), np.empty((9, top_k), np.float32)
    assert lib.k2_op_route(ptr(x), 9, 96, ptr(router), ptr(bias), experts, top_k, groups, kept, 1,
                           ctypes.c_float(scaling), ptr(ids), ptr(weights)) == 0
    want_w, want_ids = route(torch.from_numpy(x), torch.from_numpy(router), torch.from_numpy(bias), top_k, groups, kept,
                             True, scaling)
    same = np.array_equal(ids, want_ids.numpy())
    worst[name] = relative(weights, want_w.numpy()) if same else float("inf")

def step_activations(x, block):
    # x quantised as the step quantises its inputs: per block, scale absmax / 127, codes round(x / scale)
    blocks = x.reshape(len(x), -1, block)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inverse = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    return (np.clip(np.rint(blocks * inverse), -127, 127) * scale).reshape(x.shape).astype(np.float32)

def linear(w, ws, n, k, block, bits, x):
    y = np.empty((len(x), n), np.float32)
    assert lib.k2_op_linear(ptr(w), ptr(ws), n, k, block, bits, ptr(x), len(x), ptr(y)) == 0
    return y

# int8: a partial last tile (130 rows), five inputs (several at once and one alone)
weight, x = f32(rng.normal(0, 0.05, (130, 256))), f32(rng.normal(0, 1, (5, 256)))
codes, scales = quantize_rows(weight, 128)
tiles = native_tiles.tile_codes(codes.reshape(130, 256))
got = linear(tiles, native_tiles.tile_scales(scales), 130, 256, 128, 8, x)
want = torch.from_numpy(step_activations(x, 128)) @ dequantize_rows(torch.from_numpy(codes), torch.from_numpy(scales)).T
worst["linear_int8"] = relative(got, want.numpy())

# 4-bit: the checkpoint's nibbles (two codes a byte, low first) in groups of 32
packed = rng.integers(0, 256, (130, 128), dtype=np.uint8)
group_scales = f32(rng.uniform(0.001, 0.02, (130, 256 // 32)))
got = linear(native_tiles.tile_codes(packed), native_tiles.tile_scales(group_scales), 130, 256, 32, 4, x)
want = torch.from_numpy(step_activations(x, 32)) @ dequantize_nibbles(torch.from_numpy(packed),
                                                                     torch.from_numpy(group_scales)).T
worst["linear_int4"] = relative(got, want.numpy())
print(json.dumps(worst))
"""

BOUNDS = {  # the worst error each op may show against its reference, relative to the reference's largest value
    "rms_norm": 1e-6,  # float sums in another order
    "rope": 1e-5,  # libm's cos and sin against torch's, at positions up to 131071
    "route_one_group": 1e-6, "route_grouped": 1e-6,  # the same experts, weights to float rounding
    "linear_int8": 1e-5, "linear_int4": 1e-5,  # exact integer sums, then float scales in another order
}
_results: dict[str, dict] = {}


def _level_results(level: str) -> dict:
    if level not in _results:
        if level not in build.host_levels():
            pytest.skip(f"this CPU cannot run the {level} build")
        try:
            build.build(level)
        except NativeUnavailable as exc:
            pytest.skip(f"the native step cannot be built here: {exc}")
        env = child_env(Path(__file__).parent)
        env[build.ISA_VARIABLE] = level
        run = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        _results[level] = json.loads(run.stdout.strip().splitlines()[-1])
    return _results[level]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("level", build.levels())
def test_each_native_op_matches_its_eager_reference(level, op):
    error = _level_results(level)[op]
    assert error <= BOUNDS[op], f"{op} at level {level}: worst relative error {error} (bound {BOUNDS[op]})"
