"""INT4 checkpoints in Kimi-K2-Thinking's layout (compressed-tensors pack-quantized routed experts, the rest BF16):
read and validated, written by make-checkpoint, exported with the checkpoint's own 4-bit codes."""

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.utils.match import match_name

from k2deploy.core import int4, native_tiles
from k2deploy.core.checkpoint import layout
from k2deploy.core.checkpoint.presets import K2_THINKING_INT4, SHARD_BYTES, preset_config
from k2deploy.core.checkpoint.reader import Checkpoint
from k2deploy.core.checkpoint.synthetic import write_checkpoint
from k2deploy.core.config import ModelConfig
from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import load_manifest
from k2deploy.bench import parity
from k2deploy.export.exporter import ExportOptions, export_artifact
from k2deploy.export.tiled_buffers import untiled, untiled_scales
from k2deploy.export.weights import load_transformer
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.backends.onnx.model import OrtModel

from cli_runner import run_cli

pytestmark = pytest.mark.slow  # INT4 exports and their eager references

PROMPT = list(range(5, 69))
EXPERT = "model.layers.1.mlp.experts.{}.{}"


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("int4") / "tiny"
    return write_checkpoint(path, preset_config("tiny", weights="int4"), seed=0, shard_bytes=SHARD_BYTES["tiny"])


@pytest.fixture(scope="module")
def int4_artifacts(int4_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4_artifacts")
    plans = {"cpu": ExportOptions(str(int4_checkpoint), target="cpu"),
             "cuda_bf16": ExportOptions(str(int4_checkpoint), target="cuda", kv_cache="bf16"),
             "cuda": ExportOptions(str(int4_checkpoint), target="cuda")}
    return {name: export_artifact(options, root / name) and root / name for name, options in plans.items()}


@pytest.fixture(scope="module")
def int4_reference(int4_checkpoint):
    return load_transformer(Checkpoint.open(int4_checkpoint))


def test_packing_is_compressed_tensors_own_bit_for_bit():
    codes = np.random.default_rng(0).integers(-8, 8, size=(24, 256)).astype(np.int8)
    theirs = pack_to_int32(torch.from_numpy(codes), 4).numpy()
    assert np.array_equal(int4.pack(codes), theirs)
    assert np.array_equal(int4.unpack(theirs), codes)
    assert np.array_equal(unpack_from_int32(torch.from_numpy(int4.pack(codes)), 4, torch.Size(codes.shape)).numpy(),
                          codes)


def test_the_checkpoint_holds_kimi_k2_thinkings_layout_as_compressed_tensors_writes_it(int4_checkpoint):
    """Routed experts INT4 (packed words equal to compressed-tensors' packing of their codes), the rest BF16."""
    checkpoint = Checkpoint.open(int4_checkpoint)
    entries = checkpoint.entries
    assert checkpoint.config.int4 == K2_THINKING_INT4
    packed = checkpoint.raw(EXPERT.format(3, "gate_proj.weight_packed"))
    assert entries[EXPERT.format(3, "gate_proj.weight_packed")].dtype == "I32" and packed.shape == (96, 24)
    assert entries[EXPERT.format(3, "gate_proj.weight_scale")].dtype == "BF16"
    assert entries[EXPERT.format(3, "gate_proj.weight_scale")].shape == (96, 6)
    assert list(checkpoint.raw(EXPERT.format(3, "down_proj.weight_shape"))) == [192, 96]
    codes = torch.from_numpy(int4.unpack(packed))
    assert np.array_equal(pack_to_int32(codes, 4).numpy(), packed)
    for bf16 in ("model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        assert entries[bf16].dtype == "BF16"
    # the reader dequantises as compressed-tensors defines it: the signed code times its group's scale
    scale = checkpoint.raw(EXPERT.format(3, "gate_proj.weight_scale")).astype(np.float32)
    expected = codes.numpy().astype(np.float32) * np.repeat(scale, 32, axis=1)
    np.testing.assert_array_equal(checkpoint.float32(EXPERT.format(3, "gate_proj.weight")), expected)


def test_exact_targets_match_the_eager_reference_on_the_dequantised_weights(int4_reference, int4_artifacts):
    """cuda's graph (run here by ONNX Runtime's CPU provider): QMoE 4-bit at float32 accuracy over the checkpoint's
    codes, BF16 linears. Every attention reads the cache as stored, so prompt logits differ from the float32
    reference by the cache's rounding alone: measured 0.02 with the BF16 cache (as for an FP8 checkpoint's exact
    graph); greedy tokens identical and every teacher-forced argmax agrees."""
    with torch.no_grad():
        generator = Generator(OrtModel(load_manifest(int4_artifacts["cuda_bf16"])))
        assert parity.score_difference(int4_reference, generator, PROMPT) < 0.05
        same, expected, got = parity.greedy_agreement(int4_reference, generator, PROMPT, 24)
        forced = parity.teacher_forced(int4_reference, generator, PROMPT, 32)
    assert got == expected and forced["argmax_agreement"] == 1.0


def test_qmoe_over_the_checkpoints_codes_is_the_eager_maths_to_float_rounding():
    """The 4-bit QMoE node at accuracy_level 0 (exact targets) equals its eager face to float rounding; at 4 (cpu:
    int8 activations) within 3% of the output's size. A swapped nibble order or gate/up order gives errors of the
    output's own size."""
    import onnxruntime as ort

    from k2deploy import plugins
    from k2deploy.plugins.int4 import EXACT, INT8_ACTIVATIONS, moe_experts_int4
    from k2deploy.runtime.backends.onnx.thread_pool import session_options

    rng = np.random.default_rng(1)
    e, f, m, n, k = 8, 64, 128, 5, 2
    fc1 = rng.integers(0, 256, size=(e, 2 * f, m // 2), dtype=np.uint8)
    fc2 = rng.integers(0, 256, size=(e, m, f // 2), dtype=np.uint8)
    s1 = (rng.uniform(0.5, 1.5, size=(e, 2 * f, m // 32)) * 0.02).astype(np.float32)
    s2 = (rng.uniform(0.5, 1.5, size=(e, m, f // 32)) * 0.02).astype(np.float32)
    x = rng.standard_normal((n, m)).astype(np.float32)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int64)
    weights = rng.uniform(0.1, 1.0, size=(n, k)).astype(np.float32)
    for accuracy, tolerance in ((EXACT, 1e-5), (INT8_ACTIVATIONS, 0.03)):
        class One(torch.nn.Module):
            def forward(self, x, ids, weights):
                return moe_experts_int4(x, ids, weights, *map(torch.from_numpy, (fc1, s1, fc2, s2)), accuracy)

        inputs = tuple(map(torch.from_numpy, (x, ids, weights)))
        eager = One()(*inputs).numpy()
        program = torch.onnx.export(One().eval(), inputs, dynamo=True, opset_version=21,
                                    custom_translation_table=plugins.translation_table(),
                                    input_names=["x", "ids", "weights"])
        session = ort.InferenceSession(program.model_proto.SerializeToString(), session_options(),
                                       providers=["CPUExecutionProvider"])
        got = session.run(None, {"x": x, "ids": ids, "weights": weights})[0]
        assert np.abs(got - eager).max() <= tolerance * np.abs(eager).max()


def test_cpu_lowering_agreement_on_the_int4_checkpoint(int4_reference, int4_artifacts):
    """cpu: the experts' 4-bit codes through QMoE with int8 activations, BF16 linears re-quantised to int8, the int8
    cache. Measured on 64 teacher-forced steps: argmax agreement 0.94, mean |dlogit| 0.084 (the FP8 checkpoint's
    cpu lowering on the same prompt: 0.91 / 0.052); a wrong nibble order or scale gives chance."""
    with torch.no_grad():
        generator = Generator(load_model(load_manifest(int4_artifacts["cpu"]), decode="native"))
        result = parity.teacher_forced(int4_reference, generator, PROMPT, 64)
    assert result["argmax_agreement"] >= 0.9 and result["mean_abs_logit_error"] < 0.15


def _initializer(artifact, stem: str, name: str, rows: int) -> np.ndarray:
    """A stack of `rows`-row weights of the graph as rows, taken back out of the native step's tiles where the
    target holds it so (cpu)."""
    graph = onnx.load(str(artifact / "graphs" / f"{stem}.onnx"))
    held = {t.name: t for t in graph.graph.initializer}
    if name in held:
        return onnx.numpy_helper.to_array(held[name])
    tiled = onnx.numpy_helper.to_array(held[name + native_tiles.SUFFIX])
    return (untiled_scales if name.endswith("scales") else untiled)(torch.from_numpy(tiled), rows).numpy()


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_each_experts_codes_in_the_artifact_are_the_checkpoints(int4_checkpoint, int4_artifacts, target):
    checkpoint = Checkpoint.open(int4_checkpoint)
    c = checkpoint.config
    fc1 = _initializer(int4_artifacts[target], "layer_001", "mlp.experts_fc1_codes", 2 * c.moe_intermediate_size)
    fc2 = _initializer(int4_artifacts[target], "layer_001", "mlp.experts_fc2_codes", c.hidden_size)  # [e, m, f / 2]
    scales = _initializer(int4_artifacts[target], "layer_001", "mlp.experts_fc1_scales", 2 * c.moe_intermediate_size)
    for expert in range(checkpoint.config.n_routed_experts):
        words = {p: checkpoint.raw(EXPERT.format(expert, f"{p}.weight_packed")) for p in ("gate_proj", "up_proj",
                                                                                        "down_proj")}
        assert np.array_equal(fc1[expert, 0::2].view("<i4"), words["gate_proj"])
        assert np.array_equal(fc1[expert, 1::2].view("<i4"), words["up_proj"])
        assert np.array_equal(fc2[expert].view("<i4"), words["down_proj"])
        up_scale = checkpoint.raw(EXPERT.format(expert, "up_proj.weight_scale")).astype(np.float32)
        assert np.array_equal(scales[expert, 1::2], up_scale)


def test_the_manifest_and_inspect_say_each_weight_groups_format_and_bytes(int4_artifacts, int4_checkpoint):
    manifest = json.loads((int4_artifacts["cpu"] / "manifest.json").read_text())
    formats = manifest["weight_formats"]
    c = preset_config("tiny")
    e, f, m = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    # codes half a byte a weight, float32 scales one per 32 weights: three projections of f x m per expert
    assert formats["routed experts"]["bytes"] == moe_layers * e * 3 * f * m * (0.5 + 4 / 32)
    assert formats["routed experts"]["format"].startswith("int4")
    assert formats["linears"]["format"].startswith("int8")
    shown = run_cli("inspect", int4_artifacts["cpu"])
    assert shown.returncode == 0 and "routed experts" in shown.stdout and "int4" in shown.stdout
    checkpoint = run_cli("inspect", int4_checkpoint, "--json")
    by_format = json.loads(checkpoint.stdout)["bytes"]["by_format"]
    assert by_format["int4"] == moe_layers * e * 3 * (f * m // 2 + f * m // 32 * 2 + 16)


def test_cuda_export_says_where_the_4bit_experts_run(int4_checkpoint, tmp_path):
    result = run_cli("export", int4_checkpoint, "--out", tmp_path / "cuda", "--target", "cuda")
    assert result.returncode == 0, result.stderr
    assert "note: the 4-bit experts run as a float32 QMoE node" in result.stderr and "CPU provider" in result.stderr
    cpu = run_cli("export", int4_checkpoint, "--out", tmp_path / "cpu", "--target", "cpu", "--layers", "1:2")
    assert cpu.returncode == 0 and "note:" not in cpu.stderr


def test_tensorrt_is_refused_in_one_line(int4_checkpoint, tmp_path):
    result = run_cli("export", int4_checkpoint, "--out", tmp_path / "trt", "--target", "tensorrt")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "no TensorRT plugin" in result.stderr and "--target cuda" in result.stderr
    assert not (tmp_path / "trt" / "manifest.json").exists()


def _config_with(**changes) -> dict:
    raw = preset_config("tiny", weights="int4").to_dict()
    weights = raw["quantization_config"]["config_groups"]["group_0"]["weights"]
    for key, value in changes.items():
        if key == "ignore":
            raw["quantization_config"]["ignore"] = value
        else:
            weights[key] = value
    return raw


@pytest.mark.parametrize("changes, said", [
    ({"num_bits": 8}, "weights.num_bits is 8"),
    ({"symmetric": False}, "weights.symmetric is False"),
    ({"strategy": "channel"}, "weights.strategy is 'channel'"),
    ({"group_size": 20}, "group_size must be a positive multiple of 8"),
    ({"group_size": 64}, "group_size 64 does not divide the input width 96"),
    ({"ignore": "lm_head"}, "ignore must be a list"),
    ({"ignore": ["re:(unclosed"]}, "is not a regular expression"),
    ({"ignore": ["re:(?!.*experts).*"]}, "rewrite it in RE2 syntax"),  # lookahead: Python's re, not RE2
])
def test_an_int4_scheme_this_reader_cannot_read_is_one_line_naming_the_field(changes, said):
    with pytest.raises(K2Error, match="quantization_config") as error:
        config = ModelConfig.from_dict(_config_with(**changes))
        layout.all_tensors(config)  # where a group that does not divide some projection's width shows
    assert said in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("entry", ["lm_head", "model.layers.0.mlp.gate_proj", "re:.*mlp.gate$", "re:.*self_attn.*",
                                   r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", r"re:model\.layers\.1\.mlp\.experts\.1",
                                   r"re:.*experts\.(0|2)\..*_proj$", "re:layers"])
def test_ignore_entries_match_as_compressed_tensors_matches_them(entry):
    """From the name's start, not necessarily to its end (`re.match`): experts.1 covers experts.10 to 15 too."""
    names = [s.name.rsplit(".", 1)[0] for s in layout.all_tensors(preset_config("tiny")) if s.role == "proj"]
    names += ["lm_head", "model.layers.1.mlp.gate"]
    scheme = int4.Int4Scheme(32, (entry,))
    theirs = [match_name(name, entry) for name in names]
    assert [not scheme.quantizes(name) for name in names] == theirs


def test_a_backtracking_ignore_pattern_takes_no_time(tmp_path):
    """`(.+)+z$` takes Python's `re` hours on a 40-character name (0.23 s at 22, x4 for every two more); these
    names are up to 43. Matched by RE2, a nested pattern also ignores what it should."""
    ignore = ["lm_head", "re:(.+)+z$", "re:(.*self_attn.*)+$", "re:.*shared_experts.*",
              r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
    made = run_cli("make-checkpoint", tmp_path / "c", "--format", "int4", "--set",
                   f"quantization_config.ignore={json.dumps(ignore)}")
    assert made.returncode == 0, made.stderr
    stored = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in stored  # BF16: ignored
    assert "model.layers.1.mlp.experts.3.down_proj.weight_packed" in stored  # INT4: no name ends in z
    inspected = run_cli("inspect", tmp_path / "c")
    assert inspected.returncode == 0 and "int4" in inspected.stdout, inspected.stderr


def _damage(checkpoint, name: str, change) -> None:
    """Rewrites one tensor's bytes in place (same dtype and shape)."""
    opened = Checkpoint.open(checkpoint)
    entry = opened.entries[name]
    array = np.array(opened.raw(name))
    opened.close()
    change(array)
    with open(entry.shard, "r+b") as f:
        f.seek(entry.begin)
        f.write(array.tobytes())


@pytest.mark.parametrize("name, change, said", [
    (EXPERT.format(2, "up_proj.weight_scale"), lambda a: a.__setitem__((0, 0), np.nan), "non-finite scale"),
    (EXPERT.format(2, "up_proj.weight_shape"), lambda a: a.__setitem__(1, 7), "says [96, 7]"),
])
def test_a_damaged_int4_tensor_stops_the_export_naming_it(int4_checkpoint, tmp_path, name, change, said):
    damaged = shutil.copytree(int4_checkpoint, tmp_path / "damaged")
    _damage(damaged, name, change)
    result = run_cli("export", damaged, "--out", tmp_path / "art", "--target", "cpu")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert name in result.stderr and said in result.stderr


def test_make_checkpoint_writes_every_preset_in_int4(tmp_path):
    """The real K2 dimensions too: bytes per MoE layer as Kimi-K2-Thinking's (checked by formula, not written)."""
    k2 = preset_config("k2", layers=2, weights="int4")
    per_projection = 2048 * 7168 // 2 + 2048 * 7168 // 32 * 2 + 16  # codes, bf16 scales, int64 shape
    expert_bytes = sum(s.numel * (4 if s.dtype == "I32" else 2 if s.dtype == "BF16" else 8)
                       for s in layout.layer_tensors(k2, 1) if layout.is_routed_expert(s.name))
    assert expert_bytes == 384 * 3 * per_projection
    assert expert_bytes / (384 * 3 * 2048 * 7168) == pytest.approx(0.5625, abs=1e-5)  # FP8: 1.0002 bytes a weight
    result = run_cli("make-checkpoint", tmp_path / "small", "--preset", "small", "--format", "int4", "--layers", "2",
                     "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["format"] == "int4"
    assert Checkpoint.open(tmp_path / "small").config.weight_format == "int4"


def test_export_weights_int4_requantises_an_fp8_checkpoints_experts(tiny_checkpoint, tiny_reference, tmp_path):
    """FP8 experts to INT4 groups of 32 (lossy: random tiny weights are not trained for 4 bits): every value within
    half a step of its FP8 one; the exact graph (BF16 cache) against the FP8 reference, measured on 64 teacher-forced
    steps: argmax agreement 0.75, mean |dlogit| 0.27 (the same graph with the FP8 experts: 1.0 / 0.003)."""
    export_artifact(ExportOptions(str(tiny_checkpoint), target="cuda", kv_cache="bf16", weights="int4"),
                    tmp_path / "int4")
    manifest = json.loads((tmp_path / "int4" / "manifest.json").read_text())
    assert manifest["weight_formats"]["routed experts"]["format"].startswith("int4 re-quantised")
    generator = Generator(OrtModel(load_manifest(tmp_path / "int4")))
    m = preset_config("tiny").hidden_size
    codes = _initializer(tmp_path / "int4", "layer_001", "mlp.experts_fc2_codes", m)
    scales = _initializer(tmp_path / "int4", "layer_001", "mlp.experts_fc2_scales", m)
    fp8_down = Checkpoint.open(tiny_checkpoint).float32(EXPERT.format(5, "down_proj.weight"))
    words = np.ascontiguousarray(codes[5]).view("<i4")
    requantised = int4.dequantize(words, scales[5], 32)
    assert np.abs(requantised - fp8_down).max() <= np.abs(fp8_down).max() / 7 / 2 * 1.01  # half a step at most
    with torch.no_grad():
        result = parity.teacher_forced(tiny_reference, generator, PROMPT, 64)
    assert 0.5 <= result["argmax_agreement"] and result["mean_abs_logit_error"] < 0.5
