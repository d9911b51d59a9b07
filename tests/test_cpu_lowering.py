"""The cpu target: int8 weights for ONNX Runtime's int8 kernels, an int8 latent cache read in place, and
the error that costs against the FP8 reference (the figures docs/artifact.md states)."""

import hashlib
import json

import numpy as np
import onnx
import onnx.inliner
import pytest

from cli_runner import run_cli
from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import MANIFEST_FILE, load_manifest
from k2deploy.core import native_tiles

torch = pytest.importorskip("torch")

from k2deploy.core.checkpoint.presets import SHARD_BYTES, preset_config  # noqa: E402
from k2deploy.core.checkpoint.reader import Checkpoint  # noqa: E402
from k2deploy.core.checkpoint.synthetic import write_checkpoint  # noqa: E402
from k2deploy.bench import parity  # noqa: E402
from k2deploy.export.exporter import ExportOptions, export_artifact  # noqa: E402
from k2deploy.export.tiled_buffers import untiled, untiled_scales  # noqa: E402
from k2deploy.runtime.backends.onnx.thread_pool import session_options  # noqa: E402
from k2deploy.export.weights import load_transformer  # noqa: E402
from k2deploy.plugins import int8, mla  # noqa: E402
from k2deploy.runtime.engine.generator import Generator  # noqa: E402
from k2deploy.runtime.backends.native.choice import load_model  # noqa: E402

pytestmark = pytest.mark.slow  # exports of the small preset

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 3, 640, 12, 12, 401]
TEACHER_FORCED_STEPS = 256


def _ops(path) -> list[tuple[str, str]]:
    return [(n.domain, n.op_type) for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_cpu_artifact_runs_int8_kernels_and_keeps_no_float_weights(tiny_cpu_artifact):
    manifest = load_manifest(tiny_cpu_artifact)
    assert manifest.data["target"] == "cpu" and manifest.kv_cache["format"] == "int8"
    # tiny: latent 64 as int8 codes, one float32 scale per token, rope 16 as float16
    assert manifest.kv_cache["bytes_per_token_per_layer"] == 64 + 4 + 2 * 16
    dense, moe = (_ops(tiny_cpu_artifact / "graphs" / f"layer_00{i}.onnx") for i in (0, 1))
    # q_a, q_b, kv_a, o and the dense MLP's three (kv_b goes into the attention as int8 W_UK and W_UV)
    assert dense.count(("com.microsoft", "MatMulNBits")) == 7
    assert ("com.microsoft", "QMoE") in moe and ("k2deploy", "MoeExperts") not in moe
    assert ("k2deploy", "MlaAttentionInt8Cache") in moe and ("k2deploy", "MlaAttention") not in moe
    layer = onnx.load(str(tiny_cpu_artifact / "graphs" / "layer_001.onnx"), load_external_data=False)
    fp8 = [t.name for t in layer.graph.initializer if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]
    assert fp8 == []  # kv_b too: W_UK and W_UV as int8 for the attention over the int8 cache
    held = {t.name: t.data_type for t in layer.graph.initializer}
    assert held["self_attn.kv_b_proj.w_uk_int8" + native_tiles.FOUR_ROWS] == onnx.TensorProto.UINT8
    head = onnx.load(str(tiny_cpu_artifact / "graphs" / "head.onnx"), load_external_data=False)
    assert ("com.microsoft", "MatMulNBits") in [(n.domain, n.op_type) for n in head.graph.node]


def test_the_cpu_artifact_holds_the_int8_weights_in_the_native_steps_tiles(tiny_checkpoint, tiny_cpu_artifact):
    """The head's codes and scales, taken back out of their tiles (core/native_tiles.py), are the int8 blocks of the
    checkpoint's head; the graph itself gives them back to MatMulNBits in rows (the graphs' logits are checked
    against the reference elsewhere)."""
    held = {t.name: t for t in onnx.load(str(tiny_cpu_artifact / "graphs" / "head.onnx")).graph.initializer}
    assert "lm_head.weight_int8" not in held
    weight = Checkpoint.open(tiny_checkpoint).float32("lm_head.weight")
    codes, scales = int8.quantize_rows(weight, int8.int8_block(weight.shape[1]))
    tiled = onnx.numpy_helper.to_array(held["lm_head.weight_int8" + native_tiles.SUFFIX])
    tiled_scales = onnx.numpy_helper.to_array(held["lm_head.weight_int8_scale" + native_tiles.SUFFIX])
    rows = len(weight)
    assert tiled.shape == native_tiles.codes_shape((), rows, weight.shape[1])
    assert np.array_equal(untiled(torch.from_numpy(tiled), rows).numpy(), codes.reshape(rows, -1))
    assert np.array_equal(untiled_scales(torch.from_numpy(tiled_scales), rows).numpy(), scales)
    assert np.array_equal(native_tiles.tile_codes(codes.reshape(rows, -1)), tiled)


# sha256 of each graph's data file of the tiny checkpoints' cpu exports (seed 0): what the cpu lowering's passes
# write, byte for byte. Taken before the tiling became a pass of its own (native_tiles, after int8_weights), they hold
# since; a lowering change that moves a byte changes them on purpose.
_EMBED_HEAD = {"embed": "eddd83c4ab217773f826795be3da7606816cf25c1b8c4417411b19d4ebac1815",
               "head": "b544a75826de5925f8571eccff2927b3332f9dad3ad830d2967334ba7d779525"}
CPU_DATA_SHA256 = {
    "fp8": {**_EMBED_HEAD, "layer_000": "2cd36a41cd5c7d31b750df4a986b6a664379c22ee12c6538e43166a22d519db6",
            "layer_001": "9816a1953dab5d5b0fb1f4d9b5865c3adcb60ac0791109459cc310e5ebd9b6c4",
            "layer_002": "5c17e64b9ae67c6bc36c15e7e28b1e1fb11f8302bfa53f168d27bef90af2e7a7"},
    "fp8 --weights int4": {**_EMBED_HEAD,
                           "layer_000": "2cd36a41cd5c7d31b750df4a986b6a664379c22ee12c6538e43166a22d519db6",
                           "layer_001": "79743679a98fd492774b1643094b7bb3d7dcb2a13d248ecb2b3bb29dea80898a",
                           "layer_002": "d8a80a30f890480f43ba1ef61879c221db67a6f7d87ecb1d81c596c43df276ad"},
    "int4": {**_EMBED_HEAD, "layer_000": "3613f01c2e12808fa912db65bc0e2cb6360e4462ce430f6f536f87abcac594ed",
             "layer_001": "0878cc67fb19e3c4e4c0d5480f1a66500e87294a9d21f363cc2bf9234c57bd33",
             "layer_002": "e62ed70cf90ddf5da460c03ffa260f150335b084b553072e98f1432457ffb66d"},
}


def test_the_cpu_lowering_writes_the_same_bytes_as_it_always_has(tiny_checkpoint, tiny_cpu_artifact,
                                                                  tiny_int4_cpu_artifact, tmp_path):
    """int8_weights then native_tiles (and int4_experts first, for --weights int4), each applied to what the ones
    before it made: every graph's data file of the tiny checkpoints' cpu exports is the one pinned above."""
    int4_experts = tmp_path / "int4-experts"
    export_artifact(ExportOptions(str(tiny_checkpoint), target="cpu", weights="int4"), int4_experts)
    for case, artifact in (("fp8", tiny_cpu_artifact), ("fp8 --weights int4", int4_experts),
                           ("int4", tiny_int4_cpu_artifact)):
        written = {path.stem: hashlib.sha256(path.read_bytes()).hexdigest()
                   for path in (artifact / "graphs").glob("*.data")}
        assert written == CPU_DATA_SHA256[case], case


def test_requantised_weights_are_within_half_a_step_of_the_fp8_values(tiny_checkpoint):
    checkpoint = Checkpoint.open(tiny_checkpoint)
    for name in ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.mlp.experts.3.down_proj.weight"):
        weight = checkpoint.float32(name)
        block = int8.int8_block(weight.shape[1])
        codes, scales = int8.quantize_rows(weight, block)
        back = int8.dequantize_rows(torch.from_numpy(codes), torch.from_numpy(scales)).numpy()
        step = np.repeat(scales, block, axis=1)
        assert np.all(np.abs(back - weight) <= step / 2 + 1e-7)
        # measured 0.5-0.6% on the synthetic e4m3 weights: the figure docs/artifact.md states
        assert np.sqrt(((back - weight) ** 2).mean() / (weight ** 2).mean()) < 0.01


def test_fp8_goes_straight_to_the_int8_codes_the_dequantised_weight_gives():
    """The exporter maps FP8 bytes to int8 codes through one table (no float32 copy): every e4m3 value (both signs,
    subnormals, zeros, all-zero blocks) under ragged block scales gives the codes and scales that quantising the
    dequantised weight gives, to one code where float32 rounding lands on a tie; a NaN code is found."""
    from k2deploy.plugins.fp8 import dequantize

    rng = np.random.default_rng(1)
    rows, cols, fp8 = 200, 384, 128  # rows past a whole FP8 block
    bits = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    bits[bits & 0x7F == int8.NAN_MAGNITUDE] = 0
    bits[:4, :128] = np.arange(256, dtype=np.uint8).reshape(2, 128).repeat(2, 0)[:, :128]  # every magnitude
    bits[5, 32:64] = 0x80  # a block of negative zeros
    bits[bits & 0x7F == int8.NAN_MAGNITUDE] = 0
    scale = np.exp(rng.uniform(-12, 4, (-(-rows // fp8), cols // fp8))).astype(np.float32)
    weight = dequantize(torch.from_numpy(bits).view(torch.float8_e4m3fn), torch.from_numpy(scale), fp8).numpy()
    row_scales = np.repeat(scale, fp8, axis=0)[:rows]
    for block in (128, 32):
        want_codes, want_scales = int8.quantize_rows(weight, block)
        largest = int8.fp8_block_maxima(bits, block)
        codes, scales = int8.fp8_codes(bits, largest, block), int8.fp8_scales(largest, row_scales, fp8, block)
        assert np.abs(codes.astype(int) - want_codes).max() <= 1
        assert (codes != want_codes).mean() < 1e-3
        assert np.allclose(scales, want_scales, rtol=1e-6, atol=0)
    assert codes[5, 1].tolist() == [int8.ZERO_POINT] * 32 and scales[5, 1] == 0  # block 32: the zeros' block
    bits[7, 9] = 0xFF
    assert int8.fp8_block_maxima(bits, 32)[7, 0] == int8.NAN_MAGNITUDE


def _contrib_graph(node: onnx.NodeProto, inputs: dict, initializers: dict):
    import onnxruntime as ort

    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in inputs],
        [onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(v, n) for n, v in initializers.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21),
                                                         onnx.helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


def test_the_int8_ops_match_their_eager_faces():
    """MatMulNBits and QMoE (int8 activations) against the eager ops on the same codes: within the int8
    rounding of the activations (measured 0.8% of the largest output)."""
    rng = np.random.default_rng(0)
    e, m, f, k, n, block = 8, 128, 64, 3, 5, 32
    x = rng.standard_normal((n, m)).astype(np.float32)
    codes, scales = int8.quantize_rows(rng.standard_normal((48, m)).astype(np.float32), block)
    eager = int8.linear_int8(torch.from_numpy(x), torch.from_numpy(codes), torch.from_numpy(scales)).numpy()
    node = onnx.helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=m, N=48, bits=8,
                                 block_size=block, accuracy_level=int8.INT8_COMPUTE)
    got = _contrib_graph(node, {"x": x}, {"B": codes, "S": scales})
    assert np.abs(got - eager).max() <= 0.02 * np.abs(eager).max()

    fc1 = [int8.quantize_rows(rng.standard_normal((2 * f, m)).astype(np.float32), block) for _ in range(e)]
    fc2 = [int8.quantize_rows(rng.standard_normal((m, f)).astype(np.float32), block) for _ in range(e)]
    fc1_codes, fc1_scales = np.stack([c for c, _ in fc1]).reshape(e, 2 * f, m), np.stack([s for _, s in fc1])
    fc2_codes, fc2_scales = np.stack([c for c, _ in fc2]).reshape(e, m, f), np.stack([s for _, s in fc2])
    expert_ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)])
    route_weights = rng.random((n, k)).astype(np.float32)
    eager = int8.moe_experts_int8(*map(torch.from_numpy, (x, expert_ids, route_weights, fc1_codes, fc1_scales,
                                                          fc2_codes, fc2_scales))).numpy()
    chosen, mixing = np.zeros((n, e), np.float32), np.zeros((n, e), np.float32)
    np.put_along_axis(chosen, expert_ids, 1.0, axis=1)
    np.put_along_axis(mixing, expert_ids, route_weights, axis=1)
    node = onnx.helper.make_node(
        "QMoE", ["x", "chosen", "fc1", "fc1_s", "", "fc2", "fc2_s", "", "", "", "", "", "", "", "mixing"], ["y"],
        domain="com.microsoft", k=k, activation_type="swiglu", activation_alpha=1.0, activation_beta=0.0,
        normalize_routing_weights=0, swiglu_fusion=1, expert_weight_bits=8, block_size=block,
        accuracy_level=int8.INT8_COMPUTE, quant_type="int")
    got = _contrib_graph(node, {"x": x, "chosen": chosen, "mixing": mixing},
                         {"fc1": fc1_codes, "fc1_s": fc1_scales, "fc2": fc2_codes, "fc2_s": fc2_scales})
    assert np.abs(got - eager).max() <= 0.02 * np.abs(eager).max()


def _int8_cache_attention_inputs(rng, b, s, h, d, v, c, r, t) -> dict:
    """The op's inputs in its declared order: a past of t cached entries and s new ones, both as stored."""
    kv_b_weight = torch.from_numpy(rng.standard_normal((h * (d + v), c)))
    tensors = {
        "q_nope": rng.standard_normal((b, s, h, d)), "q_pe": rng.standard_normal((b, s, h, r)),
        "past_codes": rng.integers(1, 256, (t, b, c)).astype(np.uint8), "past_scale": rng.random((t, b, 1)) / 50,
        "past_rope": rng.standard_normal((t, b, r)).astype(np.float16),
        "new_codes": rng.integers(1, 256, (b, s, c)).astype(np.uint8), "new_scale": rng.random((b, s, 1)) / 50,
        "new_rope": rng.standard_normal((b, s, r)).astype(np.float16),
        **dict(zip(("w_uk_codes", "w_uk_scale", "w_uv_codes", "w_uv_scale"),
                   (t.numpy() for t in mla.absorbed_int8(kv_b_weight, h, d, v)))),
        "mask": np.concatenate([rng.random((b, s, t)) > 0.3, np.tril(np.ones((s, s), bool))[None].repeat(b, 0)], -1),
    }
    tensors = {k: a.astype(np.float32) if a.dtype == np.float64 else a for k, a in tensors.items()}
    assert list(tensors) == list(mla.ATTENTION_INT8_CACHE.inputs)
    return tensors


def _run_int8_cache_attention(tensors: dict, h: int, d: int, v: int) -> np.ndarray:
    """The op's ONNX function, as ONNX Runtime runs it in a layer graph."""
    import onnxruntime as ort

    spec = mla.ATTENTION_INT8_CACHE
    node = onnx.helper.make_node(spec.name, spec.inputs, ["out"], domain="k2deploy", nope_dim=d, v_dim=v,
                                 softmax_scale=0.3)
    types = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.float16): onnx.TensorProto.FLOAT16,
             np.dtype(np.uint8): onnx.TensorProto.UINT8, np.dtype(np.int8): onnx.TensorProto.INT8,
             np.dtype(bool): onnx.TensorProto.BOOL}
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info(k, types[a.dtype], a.shape)
                                                 for k, a in tensors.items()],
                                   [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)])
    model = onnx.helper.make_model(graph, functions=[mla.mla_attention_int8_cache_function(h, d, v, 0.3)],
                                   opset_imports=[onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("k2deploy", 1),
                                                  onnx.helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return session.run(None, tensors)[0]


@pytest.mark.parametrize("t", [7, 0])
def test_attention_over_the_int8_cache_matches_its_eager_face(t):
    b, s, h, d, v, c, r = 2, 3, 4, 8, 6, 16, 5
    tensors = _int8_cache_attention_inputs(np.random.default_rng(1), b, s, h, d, v, c, r, t)
    eager = mla.mla_attention_int8_cache_eager(*map(torch.from_numpy, tensors.values()), d, v, 0.3).numpy()
    got = _run_int8_cache_attention(tensors, h, d, v)
    # the queries and probabilities are rounded to 8 bits per row for the integer products: measured 1.0% (t = 7)
    # and 0.5% (t = 0) of the largest output here, 0.3-2.1% over seeds 0-11; a wrong scale, zero point or transpose
    # gives errors of the outputs' own size, and so did uint8 x int8 products on a CPU without VNNI (saturated sums)
    assert np.abs(got - eager).max() < 0.02 * np.abs(eager).max()


def test_every_integer_product_of_the_cpu_graphs_is_uint8_by_uint8(tiny_cpu_artifact):
    """ONNX Runtime sums uint8 x int8 byte pairs in 16 bits on x86 CPUs without VNNI and saturates there; uint8 x
    uint8 is exact on every CPU. Checked on the graphs' types, since a CPU with VNNI computes either exactly."""
    layer = onnx.load(str(tiny_cpu_artifact / "graphs" / "layer_001.onnx"), load_external_data=False)
    graph = onnx.inliner.inline_local_functions(layer).graph
    producers = {out: node for node in graph.node for out in node.output}
    stored = {t.name: t.data_type for t in graph.initializer}
    stored.update({v.name: v.type.tensor_type.elem_type for v in graph.input})

    def elem_type(name: str) -> int:
        """Through the ops that keep their input's type back to a Cast, an initializer or a graph input."""
        if name in stored:
            return stored[name]
        node = producers[name]
        if node.op_type == "Cast":
            return next(a.i for a in node.attribute if a.name == "to")
        assert node.op_type in ("Reshape", "Transpose", "Slice", "Gather", "Concat", "Unsqueeze", "Squeeze", "Identity"), node
        return elem_type(node.input[0])

    products = [n for n in graph.node if n.op_type == "MatMulInteger"]
    # queries into the latent, scores and probabilities times codes over the past and the new, out through W_UV
    assert len(products) == 6
    for node in products:
        assert [elem_type(name) for name in node.input[:2]] == [onnx.TensorProto.UINT8] * 2, node.name


def test_the_int8_cache_attention_reads_a_new_entry_as_it_reads_a_cached_one():
    """The chunk's own entries are attended as stored: the last positions of a chunk give the outputs they give
    when the chunk's first positions are already in the cache (a prefill in two chunks, or a decode step), to
    float rounding, in the ONNX function and in the eager op."""
    b, s, h, d, v, c, r, t, k = 2, 5, 4, 8, 6, 16, 5, 7, 3
    whole = _int8_cache_attention_inputs(np.random.default_rng(2), b, s, h, d, v, c, r, t)
    split = dict(whole, q_nope=whole["q_nope"][:, k:], q_pe=whole["q_pe"][:, k:], mask=whole["mask"][:, k:],
                 new_codes=whole["new_codes"][:, k:], new_scale=whole["new_scale"][:, k:],
                 new_rope=whole["new_rope"][:, k:])
    for past, new in (("past_codes", "new_codes"), ("past_scale", "new_scale"), ("past_rope", "new_rope")):
        split[past] = np.concatenate([whole[past], whole[new][:, :k].transpose(1, 0, 2)])
    got, alone = _run_int8_cache_attention(whole, h, d, v), _run_int8_cache_attention(split, h, d, v)
    np.testing.assert_allclose(alone, got[:, k:], rtol=1e-5, atol=1e-6 * np.abs(got).max())
    eager = [mla.mla_attention_int8_cache_eager(*map(torch.from_numpy, x.values()), d, v, 0.3).numpy()
             for x in (whole, split)]
    np.testing.assert_allclose(eager[1], eager[0][:, k:], rtol=1e-5, atol=1e-6 * np.abs(eager[0]).max())


def _agreement(checkpoint, runs: dict) -> dict:
    """runs: name -> (artifact, its decode path) -> name -> score difference and teacher-forced agreement."""
    reference = load_transformer(Checkpoint.open(checkpoint))
    results = {}
    with torch.no_grad():
        for name, (path, decode) in runs.items():
            generator = Generator(load_model(load_manifest(path), decode=decode))
            results[name] = {"score": parity.score_difference(reference, generator, PROMPT),
                             **parity.teacher_forced(reference, generator, PROMPT, TEACHER_FORCED_STEPS)}
    return results


def test_cpu_lowering_agreement_on_tiny(tiny_checkpoint, tiny_cpu_artifact, tiny_artifacts):
    """256 teacher-forced positions on tiny, each lowering and decode path against its own bound. Measured: the cpu
    lowering (int8 weights, cache and attention) agrees on 0.949 of the argmaxes through the native step and 0.941
    through its graphs on an AVX-512 VNNI host (0.9375 on an AVX2 one: ONNX Runtime's int8 kernels and the native
    step's products take their float sums in each instruction set's order), the exact FP8 graph with its FP8 cache
    0.969: random tiny weights leave small margins between the top logits, so both lossy paths flip a few. Prompt logits, which hold the cache's rounding of the prompt's own
    entries: max |d| 0.33 (2.7 for the exact graph with its FP8 cache). A wrong scale or expert gives chance."""
    results = _agreement(tiny_checkpoint, {"native": (tiny_cpu_artifact, "native"), "graphs": (tiny_cpu_artifact, "onnx"),
                                           "fp8": (tiny_artifacts["fp8"], "onnx")})
    for path in ("native", "graphs"):  # the cpu lowering through either decode path
        cpu = results[path]
        assert cpu["score"] < 1.0 and cpu["argmax_agreement"] >= 0.90 and cpu["mean_abs_logit_error"] < 0.15, path
    assert results["fp8"]["score"] < 8.0 and results["fp8"]["argmax_agreement"] >= 0.90


def test_cpu_lowering_agreement_on_small(tmp_path):
    """256 teacher-forced positions on small (Kimi K2's attention dims, 64 experts, vocab 32768). Measured: 0.844
    for the cpu lowering, 0.859 for the exact FP8 graph with its FP8 cache: the int8 lowering costs about what
    the FP8 cache does. Mean |dlogit| 0.16; prompt logits max |d| 2.5. A broken lowering (a wrong scale, a wrong
    expert) gives chance."""
    checkpoint = write_checkpoint(tmp_path / "small", preset_config("small"), seed=0, shard_bytes=SHARD_BYTES["small"])
    export_artifact(ExportOptions(str(checkpoint), target="cpu"), tmp_path / "cpu")
    result = _agreement(checkpoint, {"cpu": (tmp_path / "cpu", "native")})["cpu"]
    assert result["score"] < 4.0
    assert result["argmax_agreement"] >= 0.8 and result["mean_abs_logit_error"] < 0.2


def test_a_cpu_artifact_refuses_other_runtimes_in_one_line(tiny_cpu_artifact):
    for flags, runner in ((["--provider", "cuda"], "ONNX Runtime's cuda provider"), (["--backend", "tensorrt"], "TensorRT")):
        result = run_cli("generate", tiny_cpu_artifact, "--prompt-ids", "1,2", *flags)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "lowered for --target cpu" in result.stderr and runner in result.stderr
    from k2deploy.export.tensorrt_graph import tensorrt_copies

    with pytest.raises(K2Error, match="lowered for --target cpu .* cannot run on TensorRT"):
        tensorrt_copies(load_manifest(tiny_cpu_artifact))


def test_export_targets_and_their_caches(tiny_checkpoint, tmp_path):
    refused = run_cli("export", tiny_checkpoint, "--out", tmp_path / "a", "--target", "cuda", "--kv-cache", "int8")
    assert refused.returncode == 2 and "--kv-cache int8 is the cache of --target cpu" in refused.stderr
    assert not (tmp_path / "a" / MANIFEST_FILE).exists()
    exported = run_cli("export", tiny_checkpoint, "--out", tmp_path / "b", "--target", "cpu", "--kv-cache", "fp8",
                       "--json")
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["target"] == "cpu"
    manifest = load_manifest(tmp_path / "b")
    assert manifest.kv_cache["format"] == "fp8" and manifest.data["target"] == "cpu"
    assert ("k2deploy", "MlaAttention") in _ops(tmp_path / "b" / "graphs" / "layer_001.onnx")
    tokens = run_cli("generate", tmp_path / "b", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json")
    assert tokens.returncode == 0 and len(json.loads(tokens.stdout)["token_ids"]) == 4


def test_an_artifact_without_a_recorded_target_is_the_exact_fp8_graph(tiny_artifacts, tmp_path):
    import shutil

    art = shutil.copytree(tiny_artifacts["fp8"], tmp_path / "art")
    data = json.loads((art / MANIFEST_FILE).read_text())
    assert data.pop("target") == "cuda"
    (art / MANIFEST_FILE).write_text(json.dumps(data))
    result = run_cli("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")
    assert result.returncode == 0, result.stderr
