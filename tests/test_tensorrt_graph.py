"""The TensorRT copies of an artifact's graphs (no TensorRT needed): plugin nodes, supported ops, same numbers."""

import json
import shutil

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from k2deploy.export.tensorrt_graph import (  # noqa: E402
    OPS_FILE, op_types, parser_ops, parser_problems, supported_ops, tensorrt_model, tensorrt_copies)
from k2deploy.core.cache_format import PAGE_SIZE  # noqa: E402
from k2deploy.core.manifest import load_manifest  # noqa: E402
from k2deploy.plugins.tensorrt import NAMESPACE, PLUGINS, VERSION  # noqa: E402
from k2deploy.runtime.backends.onnx.thread_pool import session_options  # noqa: E402

pytestmark = pytest.mark.slow  # TensorRT-target exports

# What the exported graphs need rewritten for the parser, per graph kind (layer_000 dense, layer_001 MoE).
EXPECTED_REWRITES = {
    "embed": {"plugin function bodies dropped": 0},  # a graph carries only the bodies of ops it uses
    "head": {"plugin function bodies dropped": 0},
    "layer_000": {"plugin function bodies dropped": 1, "MlaAttention plugin nodes": 1,
                  "CastLike -> Cast": 9,
                  "Cast from FP8 -> DequantizeLinear": 9, "Cast to FP8 -> QuantizeLinear": 1},
    "layer_001": {"plugin function bodies dropped": 3, "MlaAttention plugin nodes": 1, "MoeRoute plugin nodes": 1,
                  "MoeExperts -> MoeExpertsUp + MoeExpertsDown": 1, "MoeExpertsUp plugin nodes": 1,
                  "MoeExpertsDown plugin nodes": 1, "expert bits typed UINT8 -> FLOAT8E4M3FN": 3,
                  "CastLike -> Cast": 9,
                  "Cast from FP8 -> DequantizeLinear": 9, "Cast to FP8 -> QuantizeLinear": 1},
}


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def copies(request, tiny_artifacts, tmp_path_factory):
    """A private copy of a tiny artifact with its TensorRT copies written: (manifest, report)."""
    root = shutil.copytree(tiny_artifacts[request.param], tmp_path_factory.mktemp("trt") / request.param)
    manifest = load_manifest(root, verify_hashes=False)
    return manifest, tensorrt_copies(manifest)


def _load(manifest, report, stem, weights=False):
    return onnx.load(str(manifest.root / report[stem]["file"]), load_external_data=weights)


def test_the_operator_list_is_data_with_its_source():
    data = json.loads(OPS_FILE.read_text())
    assert data["source"]["url"].startswith("https://github.com/onnx/onnx-tensorrt/")
    assert data["source"]["commit"] and data["source"]["tensorrt"]
    ops = parser_ops()["operators"]
    assert ops["Split"]["supported"] and ops["DequantizeLinear"]["supported"]
    assert not ops["SplitToSequence"]["supported"] and not ops["SequenceAt"]["supported"]
    assert "FP8" not in ops["Cast"]["types"]  # why Cast to/from FP8 becomes Q/DQ


def test_every_graph_has_a_copy_without_plugin_function_bodies(copies):
    manifest, report = copies
    stems = {"embed", "head", *(f"layer_{e['layer']:03d}" for e in manifest.graphs["layers"])}
    assert set(report) == stems
    for stem in stems:
        model = _load(manifest, report, stem)
        assert not [f.name for f in model.functions if f.domain == NAMESPACE], stem
        assert parser_problems(model) == [], stem


def test_plugin_nodes_carry_their_resolving_attributes(copies):
    manifest, report = copies
    seen = set()
    for stem in report:
        for node in _load(manifest, report, stem).graph.node:
            if node.domain != NAMESPACE:
                continue
            seen.add(node.op_type)
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["plugin_namespace"] == NAMESPACE.encode()
            assert attrs["plugin_version"] == VERSION.encode()
            assert attrs.get("aot", 0) == int(PLUGINS[node.op_type].aot)
            assert set(PLUGINS[node.op_type].attributes) <= set(attrs)  # the plugin's own fields stay
            assert len(node.input) == len(PLUGINS[node.op_type].inputs)
    assert seen == set(PLUGINS)


def test_every_other_node_is_one_the_parser_supports(copies):
    manifest, report = copies
    supported = supported_ops()
    for stem in report:
        model = _load(manifest, report, stem)
        standard = [op for op in op_types(model) if "::" not in op]
        assert set(standard) <= supported, (stem, set(standard) - supported)
        assert report[stem]["op_types"] == op_types(model)


def test_the_rewrites_are_the_expected_ones(copies):
    manifest, report = copies
    cache = manifest.kv_cache["format"]
    for stem, expected in EXPECTED_REWRITES.items():
        rewrites = {k: v for k, v in report[stem]["rewrites"].items() if k not in ("folded constants",
                                                                                    "dead nodes removed")}
        # the 8 FP8 weights are dequantised and so are the new FP8 entries, which the layer attends to as stored
        # (the FP8 cache's pages go in as bits, widened through a table)
        if cache == "bf16":
            expected = {**expected}
            if "CastLike -> Cast" in expected:
                expected["Cast from FP8 -> DequantizeLinear"] = 8
                expected["CastLike -> Cast"] -= 1  # one CastLike belongs to the FP8 cache's scales
                del expected["Cast to FP8 -> QuantizeLinear"]
        assert rewrites == expected, stem
    assert report["layer_001"]["rewrites"]["folded constants"] > 100


def test_fp8_weights_stay_fp8_behind_dequantize(copies):
    manifest, report = copies
    model = _load(manifest, report, "layer_001")
    fp8 = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT8E4M3FN}
    assert fp8  # FP8 weights are still FP8 initializers
    for node in model.graph.node:
        for name in node.input:
            if name in fp8 and name != "k2trt_fp8_zero":
                assert node.op_type == "DequantizeLinear" or node.domain == NAMESPACE, (node.op_type, name)


def test_the_copy_reads_the_same_weight_files(copies):
    manifest, report = copies
    for stem, entry in report.items():
        assert entry["data"] == [f"graphs/{stem}.data"]
        model = _load(manifest, report, stem, weights=True)  # onnx resolves every external tensor
        onnx.checker.check_model(str(manifest.root / entry["file"]))
        for t in model.graph.initializer:
            assert all(".." not in e.value for e in t.external_data if e.key == "location")
    assert not list((manifest.root / "graphs").glob("*.data.*"))  # no second copy of any weights


def _widened(model) -> bytes:
    """The model with BF16 outputs cast to FLOAT (exact), which ONNX Runtime can hand back as numpy."""
    for i, value in enumerate(model.graph.output):
        if value.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            inner = value.name + "_bf16"
            for node in model.graph.node:
                node.output[:] = [inner if o == value.name else o for o in node.output]
            model.graph.node.append(helper.make_node("Cast", [inner], [value.name], to=TensorProto.FLOAT))
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    return model.SerializeToString()


def _runnable(manifest, path: str) -> bytes:
    """The TensorRT copy with the plugin-only rewrites undone (function bodies back, bits UINT8), for ONNX Runtime."""
    from k2deploy import plugins

    model = onnx.load(path)
    model.functions.extend(plugins.onnx_functions(manifest.config) + plugins.split_functions(manifest.config))
    for node in model.graph.node:
        if node.domain == NAMESPACE:
            kept = [a for a in node.attribute if a.name not in ("plugin_namespace", "plugin_version", "aot")]
            del node.attribute[:]
            node.attribute.extend(kept)
    for t in model.graph.initializer:
        if t.name.startswith("mlp.experts_") and t.name.endswith("_weight"):
            t.data_type = TensorProto.UINT8
    return _widened(model)


@pytest.mark.parametrize("shape", [(2, 5, 0), (2, 1, 6)], ids=["prefill", "decode"])
def test_the_rewritten_graphs_compute_the_same(copies, shape):
    import ml_dtypes

    manifest, report = copies
    config, cache = manifest.config, manifest.kv_cache
    b, s, t = shape
    pages = -(-t // PAGE_SIZE)  # each row's past in pages (positions past t masked)
    pool = max(1, b * pages)
    rng = np.random.default_rng(0)
    options = session_options()
    for stem in ("embed", "layer_000", "layer_001", "head"):
        original = ort.InferenceSession(_widened(onnx.load(str(manifest.root / f"graphs/{stem}.onnx"))), options,
                                        providers=["CPUExecutionProvider"])
        rewritten = ort.InferenceSession(_runnable(manifest, str(manifest.root / report[stem]["file"])), options,
                                         providers=["CPUExecutionProvider"])
        feeds = {}
        for value in original.get_inputs():
            if value.name == "token_ids":
                feeds["token_ids"] = rng.integers(0, config.vocab_size, (b, s)).astype(np.int64)
            elif value.name == "hidden":
                feeds["hidden"] = rng.standard_normal((b, s, config.hidden_size)).astype(np.float32)
            elif value.name == "positions":
                feeds["positions"] = np.broadcast_to(t + np.arange(s), (b, s)).astype(np.int64)
            elif value.name == "page_table":
                feeds["page_table"] = np.arange(b * pages).reshape(b, pages)[:, ::-1].copy()  # [b, n] pages, reversed
            elif value.name == "latent_pages":
                latent = rng.standard_normal((pool, PAGE_SIZE, config.kv_lora_rank))
                feeds["latent_pages"] = (latent.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
                                         if cache["format"] == "fp8" else ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                                             latent.astype(ml_dtypes.bfloat16).view(np.uint16), TensorProto.BFLOAT16))
            elif value.name == "rope_pages":
                feeds["rope_pages"] = rng.standard_normal((pool, PAGE_SIZE, config.qk_rope_head_dim)).astype(np.float16)
            elif value.name == "latent_scale_pages":
                feeds["latent_scale_pages"] = rng.random((pool, PAGE_SIZE, 1)).astype(np.float32)
        outputs = list(zip(original.get_outputs(), original.run(None, feeds), rewritten.run(None, feeds)))
        stepped = False  # a new entry one rounding step apart, which the layer's attention reads as stored
        for out, x, y in outputs:
            x, y = np.asarray(x), np.asarray(y)
            if out.name == "new_latent" and cache["format"] == "bf16":  # widened to float32 by _widened: bf16 values
                x, y = x.astype(ml_dtypes.bfloat16), y.astype(ml_dtypes.bfloat16)
            if x.dtype.itemsize == 1:  # FP8 bits: must be identical
                assert np.array_equal(x, y), (stem, out.name)
            elif x.dtype.itemsize == 2:  # float16 or bf16 bits: the two graphs' float32 values differ by rounding
                # order (the matmuls block their sums by shape and thread count), which can carry a value across a
                # 16-bit rounding boundary: equal, or one rounding step apart
                assert _steps_apart(x, y) <= 1, (stem, out.name, _steps_apart(x, y))
                stepped = stepped or _steps_apart(x, y) == 1
        for out, x, y in outputs:
            if np.asarray(x).dtype == np.float32 and out.name != "new_latent":
                # float32 rounding, or where the layer attended to an entry a step apart, what that step moves
                # (measured 8e-5 on a hidden output of standard deviation near 1)
                tolerance = 5e-4 if stepped else 1e-5
                np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=tolerance,
                                           err_msg=f"{stem} {out.name}")


def _steps_apart(x: np.ndarray, y: np.ndarray) -> int:
    """The most representable 16-bit values between two arrays of float16 or bf16 bits (same-sign values are
    ordered like their bit patterns; a sign change counts its distance through zero)."""
    def ordered(bits):
        bits = bits.view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return int(np.abs(ordered(x) - ordered(y)).max()) if x.size else 0


def test_a_model_with_an_unknown_custom_op_is_refused():
    node = helper.make_node("Mystery", ["x"], ["y"], domain=NAMESPACE)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(NAMESPACE, 1)])
    with pytest.raises(ValueError, match="no TensorRT plugin"):
        tensorrt_model(model)


def test_the_checker_names_what_the_parser_refuses():
    nodes = [helper.make_node("SplitToSequence", ["x"], ["seq"]),
             helper.make_node("SequenceAt", ["seq", "i"], ["y"]),
             helper.make_node("Cast", ["x"], ["z"], to=TensorProto.FLOAT8E4M3FN),
             helper.make_node("ReduceSum", ["x", "axes"], ["w"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x",)]
                              + [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                 helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z", "w")])
    problems = parser_problems(helper.make_model(graph))
    assert any("SplitToSequence" in p for p in problems) and any("SequenceAt" in p for p in problems)
    assert any("quantized type" in p for p in problems) and any("must be an initializer" in p for p in problems)


def test_a_tensorrt_export_carries_its_copies_and_building_engines_uses_them(tiny_checkpoint, tiny_artifacts, tmp_path):
    from k2deploy.export.exporter import ExportOptions, export_artifact

    out = tmp_path / "trt"
    export_artifact(ExportOptions(str(tiny_checkpoint), target="tensorrt"), out)
    manifest = load_manifest(out)  # every listed file verified by its hash, the copies included
    stems = ["embed", *(f"layer_{e['layer']:03d}" for e in manifest.graphs["layers"]), "head"]
    assert {f"graphs/{stem}.tensorrt.onnx" for stem in stems} <= set(manifest.data["files"])
    cuda_files = load_manifest(tiny_artifacts["fp8"]).data["files"]
    assert not [f for f in cuda_files if f.endswith(".tensorrt.onnx")]  # the cuda target's artifact has none
    # the export's copy is the rewrite of its exported graph
    layer = onnx.load(str(out / "graphs" / "layer_001.onnx"), load_external_data=False)
    shipped = onnx.load(str(out / "graphs" / "layer_001.tensorrt.onnx"), load_external_data=False)
    assert tensorrt_model(layer)[0].SerializeToString() == shipped.SerializeToString()
    assert parser_problems(shipped) == []

    written = {stem: (out / f"graphs/{stem}.tensorrt.onnx").stat().st_mtime_ns for stem in stems}
    copies = tensorrt_copies(manifest)
    assert {stem: c["file"] for stem, c in copies.items()} == {stem: f"graphs/{stem}.tensorrt.onnx" for stem in stems}
    assert not any(c["written"] for c in copies.values()) and copies["layer_001"]["data"] == ["graphs/layer_001.data"]
    assert {stem: (out / f"graphs/{stem}.tensorrt.onnx").stat().st_mtime_ns for stem in stems} == written
    # without AOT kernels the copies differ (no aot attribute): written beside the listed ones, which stay intact
    jit = tensorrt_copies(manifest, aot=False)
    assert all(c["written"] and c["file"].endswith(".tensorrt-jit.onnx") for c in jit.values())
    load_manifest(out)
