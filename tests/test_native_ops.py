"""The native step's ops one by one against their eager references, at every instruction-set level this CPU runs (as
llama.cpp's test-backend-ops checks each op of each backend): rms norm and rope (export's), routing (plugins/routing.py),
the int8 and 4-bit products of a weight held in tiles (plugins/int8.py, plugins/int4.py, with the step's own activation
quantisation), the MLP (dense, and routed int8 and 4-bit experts with a shared one: plugins/routing.py and the plugins'
dequantised weights, the step's quantised activations), and the absorbed attention over the int8 latent cache's pages
(plugins/mla.py), each query alone and as one run of tiles. Each level runs in a process of its own (a process loads one build); each op is its own test, so a
change that breaks one op fails that op's test by name. The whole-layer tests (tests/test_native_decode.py) stay."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from child_env import child_env  # noqa: E402

from k2deploy.runtime.backends.native import build  # noqa: E402
from k2deploy.runtime.backends.native.build import NativeUnavailable  # noqa: E402

OPS = ("rms_norm", "rope", "route_one_group", "route_grouped", "linear_int8", "linear_int4", "mlp_dense", "mlp_experts_int8",
       "mlp_experts_int4", "attention_alone", "attention_together", "attention_against_float", "store_entries")

# argv: nothing; prints {op: worst error} for the level $K2DEPLOY_NATIVE_ISA names
_CHECK = r"""
import ctypes, json
import numpy as np
import onnx
import onnxruntime
import torch
from k2deploy.core import native_tiles
from k2deploy.core.cache_format import CacheFormat
from k2deploy.core.checkpoint.presets import preset_config
from k2deploy.export.graph_modules import stored_entries
from k2deploy.export.rope import Rope
from k2deploy.plugins.int4 import dequantize_nibbles
from k2deploy.plugins.int8 import dequantize_rows, quantize_rows
from k2deploy.plugins.mla import (ATTENTION_INT8_CACHE, absorbed_int8, mla_attention_int8_cache_eager,
                                  mla_attention_int8_cache_function)
from k2deploy.plugins.routing import route
from k2deploy.runtime.backends.native.build import library
from k2deploy.runtime.backends.native.decoder import Dims, Layer, Lin, Pages

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

# the MLP: weights held as the artifact holds them, the reference from their dequantised codes in float64, with the
# step's quantised inputs and activations (blocks of the weight's block)
kept = []  # arrays a Layer points into, alive until the end

def held(array):
    kept.append(np.ascontiguousarray(array))
    return kept[-1].ctypes.data

def int8_weight(rows, cols, block):
    codes, scales = quantize_rows(f32(rng.normal(0, 0.05, (rows, cols))), block)
    plain = dequantize_rows(torch.from_numpy(codes), torch.from_numpy(scales)).double()
    return native_tiles.tile_codes(codes.reshape(rows, cols)), native_tiles.tile_scales(scales), plain

def int4_weight(rows, cols, group):
    packed = rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8)
    scales = f32(rng.uniform(0.001, 0.01, (rows, cols // group)))
    plain = dequantize_nibbles(torch.from_numpy(packed), torch.from_numpy(scales)).double()
    return native_tiles.tile_codes(packed), native_tiles.tile_scales(scales), plain

def lin(weight, rows, cols, block, bits):
    return Lin(held(weight[0]), held(weight[1]), rows, cols, block, bits)

def swiglu(x, up, down, block):  # x [n, m] float64, up [2w, m] gate and up interleaved (or a (gate, up) pair)
    both = up if isinstance(up, tuple) else (up[0::2], up[1::2])
    gate, upped = x @ both[0].T, x @ both[1].T
    hidden = torch.nn.functional.silu(gate) * upped
    return torch.from_numpy(step_activations(f32(hidden.numpy()), block)).double() @ down.T

def mlp(dims, layer, x):
    y = np.empty_like(x)
    assert lib.k2_op_mlp(ctypes.byref(dims), ctypes.byref(layer), len(x), ptr(x), ptr(y)) == 0
    return y

m, width, batch = 256, 128, 6
x = f32(rng.normal(0, 1, (batch, m)))
xq = torch.from_numpy(step_activations(x, 128)).double()
gate, up, down = int8_weight(width, m, 128), int8_weight(width, m, 128), int8_weight(m, width, 128)
dense = Layer(moe=0, width=width, gate=lin(gate, width, m, 128, 8), up=lin(up, width, m, 128, 8),
              down=lin(down, m, width, 128, 8))
dims = Dims(hidden=m, top_k=1, n_group=1, topk_group=1)
worst["mlp_dense"] = relative(mlp(dims, dense, x), swiglu(xq, (gate[2], up[2]), down[2], 128).numpy())

experts, top_k, shared_width = 16, 4, 256
router, bias = f32(rng.normal(0, 0.1, (experts, m))), f32(rng.normal(0, 0.05, experts))
dims = Dims(hidden=m, top_k=top_k, n_group=1, topk_group=1, normalise=1, scaling=2.5)
weights, ids = route(torch.from_numpy(x), torch.from_numpy(router), torch.from_numpy(bias), top_k, 1, 1, True, 2.5)
s_gate, s_up, s_down = (int8_weight(shared_width, m, 128), int8_weight(shared_width, m, 128),
                        int8_weight(m, shared_width, 128))
shared = swiglu(xq, (s_gate[2], s_up[2]), s_down[2], 128)
for bits, block, weight in ((8, 128, int8_weight), (4, 32, int4_weight)):
    fc1 = [weight(2 * width, m, block) for _ in range(experts)]
    fc2 = [weight(m, width, block) for _ in range(experts)]
    layer = Layer(moe=1, experts=experts, width=width, gate=lin(s_gate, shared_width, m, 128, 8),
                  up=lin(s_up, shared_width, m, 128, 8), down=lin(s_down, m, shared_width, 128, 8),
                  router=held(router), bias=held(bias), fc1=held(np.stack([w[0] for w in fc1])),
                  fc1_s=held(np.stack([w[1] for w in fc1])), fc2=held(np.stack([w[0] for w in fc2])),
                  fc2_s=held(np.stack([w[1] for w in fc2])), block=block, bits=bits)
    xe = torch.from_numpy(step_activations(x, block)).double()
    want = shared.clone()
    for s in range(batch):
        for slot in range(top_k):
            e = int(ids[s, slot])
            want[s] += float(weights[s, slot]) * swiglu(xe[s:s + 1], fc1[e][2], fc2[e][2], block)[0]
    worst[f"mlp_experts_int{bits}"] = relative(mlp(dims, layer, x), want.numpy())

# absorbed attention: a sequence of 200 positions in pages out of order, 24 queries at its last positions
heads, nope, rope_dim, v, c, keys, n = 8, 128, 64, 128, 512, 200, 24
w_uk, uk_s, w_uv, uv_s = absorbed_int8(torch.from_numpy(f32(rng.normal(0, 0.05, (heads * (nope + v), c)))), heads, nope, v)
table = np.array([3, 0, 2, 1], np.int64)
latent = rng.integers(1, 256, (4, 64, c), dtype=np.uint8)
scale, rope_keys = f32(rng.uniform(0.005, 0.02, (4, 64))), rng.normal(0, 1, (4, 64, rope_dim)).astype(np.float16)
pages = Pages(held(latent), held(scale), held(rope_keys))
dims = Dims(heads=heads, nope=nope, rope=rope_dim, v=v, latent=c, max_len=256, softmax_scale=(nope + rope_dim) ** -0.5)
layer = Layer(w_uk=held(native_tiles.four_rows(w_uk.numpy())), uk_s=held(uk_s.numpy()[:, 0]),
              w_uv=held(native_tiles.four_rows(w_uv.numpy())), uv_s=held(uv_s.numpy()[:, 0]))
q, positions = f32(rng.normal(0, 1, (n, heads, nope + rope_dim))), np.arange(keys - n, keys, dtype=np.int32)
order = table[np.arange(keys) // 64] * 64 + np.arange(keys) % 64  # each position's row in the pages
past = lambda a: torch.from_numpy(a.reshape(256, *a.shape[2:])[order][:, None])  # [t, 1, ...]
mask = torch.from_numpy(np.arange(keys)[None, :] <= positions[:, None])[None]
want = mla_attention_int8_cache_eager(
    torch.from_numpy(q[None, :, :, :nope]), torch.from_numpy(q[None, :, :, nope:]), past(latent),
    past(scale)[..., None], past(rope_keys), torch.zeros((1, 0, c), dtype=torch.uint8), torch.zeros((1, 0, 1)),
    torch.zeros((1, 0, rope_dim), dtype=torch.float16), w_uk, uk_s, w_uv, uv_s, mask, nope, v, dims.softmax_scale)[0]
got = {}
for together in (0, 1):
    out = np.empty((n, heads, v), np.float32)
    assert lib.k2_op_attention(ctypes.byref(dims), ctypes.byref(layer), ctypes.byref(pages), ptr(table), n,
                               ptr(positions), ptr(q), ptr(out), together) == 0
    got[together] = out
# the cpu graphs' attention (plugins/mla.py's ONNX function, whose integer products and 8-bit query and
# probabilities the step takes as they are), as ONNX Runtime runs it: the chunk's own entries the last n positions
inputs = dict(q_nope=q[None, :, :, :nope], q_pe=q[None, :, :, nope:], past_codes=past(latent)[:keys - n].numpy(),
              past_scale=past(scale)[:keys - n, :, None].numpy(), past_rope=past(rope_keys)[:keys - n].numpy(),
              new_codes=past(latent)[keys - n:, 0][None].numpy(), new_scale=past(scale)[keys - n:, 0][None, :, None].numpy(),
              new_rope=past(rope_keys)[keys - n:, 0][None].numpy(), w_uk_codes=w_uk.numpy(), w_uk_scale=uk_s.numpy(),
              w_uv_codes=w_uv.numpy(), w_uv_scale=uv_s.numpy(), mask=mask.numpy())
kinds = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.float16): onnx.TensorProto.FLOAT16,
         np.dtype(np.uint8): onnx.TensorProto.UINT8, np.dtype(bool): onnx.TensorProto.BOOL}
inputs = {name: np.ascontiguousarray(a) for name, a in inputs.items()}
node = onnx.helper.make_node(ATTENTION_INT8_CACHE.name, list(inputs), ["out"], domain="k2deploy", nope_dim=nope, v_dim=v,
                             softmax_scale=dims.softmax_scale)
graph = onnx.helper.make_graph([node], "attention", [onnx.helper.make_tensor_value_info(k, kinds[a.dtype], a.shape)
                                                     for k, a in inputs.items()],
                               [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)])
model = onnx.helper.make_model(graph, functions=[mla_attention_int8_cache_function(heads, nope, v, dims.softmax_scale)],
                               opset_imports=[onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("k2deploy", 1),
                                              onnx.helper.make_opsetid("com.microsoft", 1)])
model.ir_version = 10
graph_out = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)[0][0]
worst["attention_alone"] = relative(got[0], graph_out)
# together: each query's result the one it gets alone, to the bit
worst["attention_together"] = relative(got[1], graph_out) if np.array_equal(got[0], got[1]) else float("inf")
# and the 8-bit query and probabilities against the float maths (plugins/mla.py's eager attention over the same cache)
worst["attention_against_float"] = relative(got[0], want.numpy())

# new cache entries: the latent normalised (kv_norm) and quantised per token, the rope key roped, as the graphs store
# them (export/graph_modules.py stored_entries over the int8 format, export/rope.py)
c, r, n = config.kv_lora_rank, config.qk_rope_head_dim, 9
kv, kv_norm = f32(rng.normal(0, 2, (n, c + r))), f32(rng.normal(1, 0.2, c))
positions = np.array([0, 1, 63, 64, 65, 130, 191, 160, 100], np.int32)
table = np.array([2, 0, 1], np.int64)
latent, scale, rope_keys = np.zeros((3, 64, c), np.uint8), np.zeros((3, 64), np.float32), np.zeros((3, 64, r), np.float16)
dims = Dims(latent=c, rope=r, max_len=192, eps=1e-6, rope_scale=rope.scale)
layer = Layer(kv_norm=held(kv_norm), frequencies=held(f32(rope.frequencies.numpy())), kv_a=Lin(n=c + r))
got_kv = kv.copy()
assert lib.k2_op_store_entries(ctypes.byref(dims), ctypes.byref(layer), ptr(got_kv), n, ptr(positions), ptr(table),
                               ctypes.byref(Pages(held(latent), held(scale), held(rope_keys)))) == 0
t = torch.from_numpy(kv[:, :c])
normed = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.from_numpy(kv_norm)
roped = rope(torch.from_numpy(kv[:, c:])[None], torch.from_numpy(positions.astype(np.int64))[None])
codes, rope_want, scale_want = stored_entries(CacheFormat("int8", c, r, c), normed[None], roped)
rows = table[positions // 64] * 64 + positions % 64
worst["store_entries"] = max(relative(scale.reshape(-1)[rows], scale_want.reshape(-1).numpy()),
                             float(np.mean(latent.reshape(-1, c)[rows] != codes[0].numpy())),  # codes that differ
                             relative(rope_keys.reshape(-1, r)[rows], rope_want[0].numpy()))
print(json.dumps(worst))
"""

BOUNDS = {  # the worst error each op may show against its reference, relative to the reference's largest value
    "rms_norm": 1e-6,  # float sums in another order
    "rope": 1e-5,  # libm's cos and sin against torch's, at positions up to 131071
    "route_one_group": 1e-6, "route_grouped": 1e-6,  # the same experts, weights to float rounding
    "linear_int8": 1e-5, "linear_int4": 1e-5,  # exact integer sums, then float scales in another order
    # exact integer sums; silu's exponential (a polynomial in the step) can move an activation's code by one
    "mlp_dense": 1e-4, "mlp_experts_int8": 1e-4, "mlp_experts_int4": 1e-4,
    # the same integer products and 8-bit rows as the graph's function; the exponential and float sums in another order
    "attention_alone": 1e-5, "attention_together": 1e-5,
    # what the int8 query and probability bytes lose (the graphs' too): 2.0% of the largest output here
    "attention_against_float": 3e-2,
    # the scales and rope keys to float rounding, and at most a code in a thousand one off (the norm's sums in another
    # order can move a value across a rounding edge)
    "store_entries": 1e-3,
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


def test_the_ctypes_mirrors_are_checked_field_by_field_against_the_library(monkeypatch):
    """Two fields of one type swapped in a mirror (or in the C struct) keep every size: the load names both."""
    from k2deploy.runtime.backends.native import decoder

    try:
        built = build.fields(build.library())
    except NativeUnavailable as exc:
        pytest.skip(f"the native step cannot be built here: {exc}")
    assert decoder.layout_differences(built) == []
    fields = list(decoder.Layer._fields_)
    at = {name: i for i, (name, _) in enumerate(fields)}
    fields[at["w_uk"]], fields[at["w_uv"]] = fields[at["w_uv"]], fields[at["w_uk"]]
    monkeypatch.setitem(decoder.MIRRORS, "K2Layer", type("Layer", (ctypes.Structure,), {"_fields_": fields}))
    differ = decoder.layout_differences(built)
    assert [line.split()[0] for line in differ] == ["K2Layer.w_uk", "K2Layer.w_uv"], differ
