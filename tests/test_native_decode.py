"""The native decode step (runtime/native_decode.py): the same token's logits and cache entry as the graphs, the
choice between them (auto, native, onnx) and its reasons, and its build."""

import numpy as np
import pytest

from cli import run_cli
from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime import native_build
from k2deploy.runtime.generator import Generator
from k2deploy.runtime.native_build import NativeUnavailable
from k2deploy.runtime.native_decode import GraphWeights
from k2deploy.runtime.ort_backend import OrtModel
from k2deploy.runtime.sampling import SamplingParams

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 3, 640, 12, 12, 401]
STEPS = 48


def _native_or_skip(artifact) -> OrtModel:
    model = OrtModel(load_manifest(artifact), decode="auto")
    if model.native is None:
        pytest.skip(f"the native decode step does not run here: {model.decode_kernels}")
    return model


def _teacher_forced(model: OrtModel, tokens: list[int]) -> tuple[np.ndarray, dict]:
    """Logits after the prompt and after each of `tokens` fed in turn [len(tokens) + 1, vocab], and the cache's
    pools."""
    generator = Generator(model)
    cache = model.new_cache(1, len(PROMPT) + len(tokens) + 1)
    got = [generator.prefill([PROMPT], cache)[0]]
    for token in tokens:
        got.append(generator.decode(np.array([token]), np.array([True]), cache)[0])
    return np.stack(got), cache.store.arrays


def test_native_steps_give_the_graphs_logits_and_cache_entries(tiny_cpu_artifact):
    """Measured on tiny (49 teacher-forced positions): 46 argmaxes the same, mean |dlogit| 0.031, largest 1.9 (of
    logits up to 15); cached latent codes within 3 steps of the graphs', rope keys and scales within 1%. Layer 0's
    entries are the graphs' to one code: the rest is the routed experts, whose activations the native step
    quantises to int8 (per block of 128, as the linears' MatMulNBits does) where ONNX Runtime's QMoE multiplies
    float32 activations by dequantised weights. A wrong scale, expert or cache row gives chance agreement."""
    native = _native_or_skip(tiny_cpu_artifact)
    graphs = OrtModel(load_manifest(tiny_cpu_artifact), decode="onnx")
    assert native.decode_kernels == "native" and graphs.native is None
    continuation = [int(t) for t in Generator(graphs).generate([PROMPT], SamplingParams(max_new_tokens=STEPS))[0].token_ids]
    expected, expected_cache = _teacher_forced(graphs, continuation)
    got, got_cache = _teacher_forced(native, continuation)
    assert native.stage_seconds["native_step"] > 0 and "native_step" not in graphs.stage_seconds
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.85
    assert np.abs(got - expected).mean() < 0.1 and np.abs(got - expected).max() < 0.25 * np.abs(expected).max()
    for name, array in expected_cache.items():  # both caches hold the sequence in the same pages
        mine, theirs = got_cache[name].astype(np.float64), array.astype(np.float64)
        tolerance = 6 if name == "latent" else 0.03 * np.abs(theirs).max()
        assert np.abs(mine - theirs).max() <= tolerance, name


def test_the_step_refuses_a_token_or_position_outside_the_model(tiny_cpu_artifact):
    model = _native_or_skip(tiny_cpu_artifact)
    cache = model.new_cache(1, 64)
    table = np.zeros(1, np.int64)
    with pytest.raises(K2Error, match="outside the vocabulary"):
        model.native.step(model.config.vocab_size, 0, table, cache.store.arrays)
    with pytest.raises(K2Error, match="past the sequence's pages"):
        model.native.step(1, 64, table, cache.store.arrays)
    with pytest.raises(K2Error, match="page table names pages"):
        model.native.step(1, 0, np.array([10 ** 6]), cache.store.arrays)


def test_auto_falls_back_to_the_graphs_and_says_why(tiny_artifacts):
    model = OrtModel(load_manifest(tiny_artifacts["fp8"]), decode="auto")
    assert model.native is None
    assert model.decode_kernels.startswith("onnx (native: ") and "int8 cache" in model.decode_kernels
    with pytest.raises(K2Error, match="native decode step cannot run.*use --decode onnx"):
        OrtModel(load_manifest(tiny_artifacts["fp8"]), decode="native")
    with pytest.raises(K2Error, match="unknown decode kernels"):
        OrtModel(load_manifest(tiny_artifacts["fp8"]), decode="fast")


def test_a_graph_whose_weights_are_not_the_expected_shape_is_refused(tiny_cpu_artifact):
    weights = GraphWeights(load_manifest(tiny_cpu_artifact).graph_file("layer_000"))
    with pytest.raises(NativeUnavailable, match="input_layernorm.weight is"):
        weights.floats("input_layernorm.weight", (7,))
    with pytest.raises(NativeUnavailable, match="missing"):
        weights.floats("no_such.weight", (7,))


def test_the_build_says_what_is_missing_and_leaves_only_finished_libraries(tmp_path, monkeypatch):
    monkeypatch.setenv("K2DEPLOY_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(NativeUnavailable, match="does not run"):
        native_build.build()
    monkeypatch.delenv("CC")
    try:
        built = native_build.build()
    except NativeUnavailable as exc:
        pytest.skip(f"no C compiler here: {exc}")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built.name] and built.suffix == ".so"
    assert native_build.build() == built  # a second call takes the cached build


def test_generate_takes_decode_and_refuses_native_where_it_cannot_run(tiny_cpu_artifact, tiny_artifacts):
    native = run_cli("generate", tiny_cpu_artifact, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json",
                     "--decode", "native", "--threads", "1")
    graphs = run_cli("generate", tiny_cpu_artifact, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json",
                     "--decode", "onnx", "--threads", "1")
    assert native.returncode == 0 and graphs.returncode == 0, native.stderr + graphs.stderr
    refused = run_cli("generate", tiny_artifacts["fp8"], "--prompt-ids", "1,2", "--decode", "native")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "native decode step cannot run" in refused.stderr
