"""The native decode step (runtime/backends/native/decoder.py): the same token's logits and cache entry as the graphs, the
choice between them (auto, native, onnx) and its reasons, and its build."""

import _ctypes
import dataclasses
import gc
import json
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from child_env import child_env
from cli_runner import run_cli
from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native import build, choice
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.backends.native.build import NativeUnavailable
from k2deploy.runtime.backends.native.decoder import GraphWeights, NativeDecoder
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.backends.native.model import NativeModel
from k2deploy.runtime.backends.onnx.model import OrtModel
from k2deploy.runtime.engine.requests import GenerationRequest, TokenLogprob
from k2deploy.runtime.engine.sampling import SamplingParams
from k2deploy.runtime.engine.step_loop import StepLoop

PROMPT = [5, 17, 300, 42, 9, 1000, 77, 3, 640, 12, 12, 401]
STEPS = 48


def _native_or_skip(artifact) -> NativeModel:
    """The artifact's model decoding through the native step: a failure where it cannot run but a C compiler
    exists (the artifact then does not fit the step), a skip only without a compiler."""
    try:
        build.build()
    except NativeUnavailable as exc:
        pytest.skip(f"the native decode step cannot be built here: {exc}")
    return load_model(load_manifest(artifact), decode="native")


def _teacher_forced(model, tokens: list[int]) -> tuple[np.ndarray, dict]:
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
    logits up to 15); cached latent codes within 3 steps of the graphs', rope keys and scales within 1%. Layer by
    layer the two agree to float rounding (the next test); over many positions an int8 rounding step or a
    near-tied expert flips now and then and the difference grows through the layers. A wrong scale, expert or
    cache row gives chance agreement."""
    native = _native_or_skip(tiny_cpu_artifact)
    graphs = OrtModel(load_manifest(tiny_cpu_artifact))
    assert native.decode_kernels == f"native ({native.native.isa}; asked for)" and not isinstance(graphs, NativeModel)
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


def layer_by_layer(artifact) -> list[tuple[float, int]]:
    """One decode position, layer by layer, from the same input hidden state and the same cache, through the
    layer graph and the native layer -> per layer (largest |native - graph| of the output over the largest change
    the layer made to the hidden state, largest difference of the new entry's latent codes); also asserts that the
    new entry's scale is the graph's."""
    graphs = OrtModel(load_manifest(artifact))
    native = _native_or_skip(artifact).native
    generator = Generator(graphs)
    cache = graphs.new_cache(1, 64)
    token = int(generator.prefill([PROMPT], cache)[0].argmax())
    position = len(PROMPT)
    cache.reserve([0], [position + 1])
    view = cache.view([0]).entries()
    new = view.new_entries(np.array([[position]], np.int64))
    hidden = graphs.embed_session.run(None, {"token_ids": np.array([[token]], np.int64)})[0]
    found = []
    for layer in range(graphs.num_layers):
        pools = {name: array[layer].copy() for name, array in view.pages.arrays.items()}  # the native layer's copy
        expected = graphs.run_layer(layer, hidden, np.array([[position]], np.int64), view, new)
        got = native.layer_step(layer, hidden[0, 0], position, view.page_table[0], pools)
        change = np.abs(expected[0, 0] - hidden[0, 0]).max()
        page, offset = view.page_table[0, position // 64], position % 64  # the new entry, as each wrote it
        codes = pools["latent"][page, offset].astype(int) - view.entries["latent"][0, 0].astype(int)
        np.testing.assert_allclose(pools["latent_scale"][page, offset], view.entries["latent_scale"][0, 0], rtol=1e-5)
        found.append((float(np.abs(got - expected[0, 0]).max() / change), int(np.abs(codes).max())))
        hidden = expected
    return found


@pytest.mark.parametrize("experts", ["int8", "int4"])
def test_each_layer_is_its_graph_to_float_rounding(tiny_cpu_artifact, tiny_int4_cpu_artifact, experts):
    """With 8-bit routed experts and with an INT4 checkpoint's own 4-bit ones, the native layer's output is the layer graph's to float rounding (measured on tiny: within 5e-7 of each
    layer's change of the hidden state, relatively; the claim 1e-3 leaves room for another order of float sums),
    its new cache entry within one int8 step. The graphs' and the native step's int8 roundings are the same ones,
    so the spread of whole-model logits above comes from a rounding step or a near-tied expert that flips now and
    then, and grows through the layers, not from different maths."""
    artifact = tiny_int4_cpu_artifact if experts == "int4" else tiny_cpu_artifact
    for layer, (error, codes) in enumerate(layer_by_layer(artifact)):
        assert error < 1e-3 and codes <= 1, layer


def chunked_prefill(artifact, chunk: int, length: int = 300) -> tuple[np.ndarray, dict]:
    """A `length`-token prompt through the native step `chunk` tokens a step -> the logits at every position and the
    cache's pools."""
    model = load_model(load_manifest(artifact), decode="native")
    prompt = np.random.default_rng(5).integers(2, 1000, length)
    table = np.arange((length + 63) // 64)
    store = model.new_store(len(table))
    hidden = np.concatenate([model.native.steps(prompt[at:at + chunk], np.arange(at, min(at + chunk, length)),
                                                np.repeat(table[None], len(prompt[at:at + chunk]), 0), store.arrays)
                             for at in range(0, length, chunk)])
    return model.native.logits(hidden), store.arrays


_LEVEL_CHECK = """
import json, sys
import numpy as np
import test_native_decode
layers = test_native_decode.layer_by_layer(sys.argv[1])
alone, together = (test_native_decode.chunked_prefill(sys.argv[1], chunk, 160)[0] for chunk in (1, 160))
print(json.dumps({"layers": layers, "chunks_agree": bool(np.array_equal(alone, together))}))
"""


@pytest.mark.parametrize("level", build.levels())
def test_every_instruction_set_level_gives_the_graphs_layers(tiny_cpu_artifact, tiny_int4_cpu_artifact, level):
    """Each instruction-set level's build (its own -march, its own lowering of isa.h's dot4 and interleave4) gives
    every layer the graph's output to float rounding and its cache entry within one int8 step, and a prompt's logits
    to the bit whether its tokens come one a step or all in one (its own row tiles and products of several inputs),
    checked in a process of its own for every level this CPU runs; a level it cannot run is a skip that names it (an
    AVX-512 host runs them all)."""
    if level not in build.host_levels():
        pytest.skip(f"this CPU cannot run the {level} build")
    env = child_env(Path(__file__).parent)
    env[build.ISA_VARIABLE] = level
    for artifact in (tiny_cpu_artifact, tiny_int4_cpu_artifact):  # 8-bit and 4-bit routed experts
        run = subprocess.run([sys.executable, "-c", _LEVEL_CHECK, str(artifact)], capture_output=True, text=True,
                             env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        for layer, (error, codes) in enumerate(got["layers"]):
            assert error < 1e-3 and codes <= 1, (level, artifact.name, layer, error, codes)
        assert got["chunks_agree"], (level, artifact.name)


# One process per thread count (a process's pool is sized once): 156 native steps from an empty cache (three pages,
# ten chunks of the attention's position split, unevenly shared); prints a hash of the last six steps' logits.
_LOGITS_HASH = """
import hashlib, sys
import numpy as np
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.backends.onnx.host_pages import LatentPages
model = load_model(load_manifest(sys.argv[1]), threads=int(sys.argv[2]), decode="native")
store, table, digest = LatentPages(model.kv_cache, model.num_layers, 3), np.arange(3), hashlib.sha256()
for position in range(156):
    hidden = model.native.step((position * 37) % 500 + 3, position, table, store.arrays)
    if position >= 150:
        digest.update(model.native.logits(hidden).tobytes())
print(digest.hexdigest())
"""


def test_the_native_step_gives_the_same_bits_on_any_number_of_threads(tiny_cpu_artifact):
    """Products' rows, heads and positions are split over the threads, but every row is one thread's and every
    sum whose order a split could change is taken in a fixed order: two and three threads give one thread's
    logits to the bit, over a context of several pages."""
    _native_or_skip(tiny_cpu_artifact)
    hashes = {}
    for threads in (1, 2, 3):
        run = subprocess.run([sys.executable, "-c", _LOGITS_HASH, str(tiny_cpu_artifact), str(threads)],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        hashes[threads] = run.stdout.strip()
    assert hashes[1] == hashes[2] == hashes[3]


def test_a_batch_step_gives_each_sequence_its_own_step_to_the_bit(tiny_cpu_artifact):
    """Several sequences in one native step (each weight read once for all): every sequence's hidden state and
    new cache entries are those of its own step alone, to the bit, whatever their lengths."""
    native = _native_or_skip(tiny_cpu_artifact).native
    model = load_model(load_manifest(tiny_cpu_artifact), decode="native")
    store = model.new_store(6)
    tables = np.array([[0, 1], [2, 3], [4, 5]])
    lengths = [70, 5, 64]  # past a page, inside one, a page exactly
    for row, length in enumerate(lengths):
        for position in range(length):
            native.step((position * 31 + row * 7) % 900 + 2, position, tables[row], store.arrays)
    tokens, positions = np.array([11, 250, 3]), np.array(lengths)
    alone = {name: array.copy() for name, array in store.arrays.items()}
    expected = np.stack([native.step(int(t), int(p), table, alone) for t, p, table in zip(tokens, positions, tables)])
    got = native.steps(tokens, positions, tables, store.arrays)
    assert np.array_equal(got, expected)
    for name in alone:
        assert np.array_equal(store.arrays[name], alone[name]), name
    assert np.array_equal(native.logits(got), np.stack([native.logits(row) for row in expected]))


def test_generate_decodes_a_batch_natively_as_each_prompt_alone(tiny_cpu_artifact):
    """The step loop's prefill of several prompts and each of its decode steps go through the native step in one
    call, and each sequence's tokens are the ones it gets alone."""
    model = _native_or_skip(tiny_cpu_artifact)
    batches, steps = [], model.native.steps
    model.native.steps = lambda tokens, *rest: batches.append(len(tokens)) or steps(tokens, *rest)
    generator = Generator(model)
    prompts = [PROMPT, [9, 8, 7], PROMPT[:5] * 3]
    params = SamplingParams(max_new_tokens=12)
    together = generator.generate(prompts, params)
    assert batches[0] == sum(map(len, prompts))  # the prompts' tokens: one batch of native steps
    assert batches[1:] == [3] * (params.max_new_tokens - 1)  # then each decode step, the three sequences at once
    alone = [generator.generate([prompt], params)[0] for prompt in prompts]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_auto_decodes_natively_only_where_it_measured_no_slower(tiny_cpu_artifact, tmp_path, monkeypatch):
    """auto times layer 0 both ways at the first start (figures kept in the build's cache folder, keyed by the
    build, the artifact and the threads) and takes the native step unless the graph was over 10% faster, letting
    the native weights go before the graphs load; a later start reads the figures, and a damaged file is measured
    again."""
    _native_or_skip(tiny_cpu_artifact)
    monkeypatch.setenv("K2DEPLOY_NATIVE_CACHE", str(tmp_path))
    timed, decoders = [], []
    figures = {"faster": (0.5, 1.0), "slower": (2.0, 1.0), "within the margin": (1.05, 1.0)}
    monkeypatch.setattr(choice, "time_graph_layer", lambda model: timed.append(1) or figures[case][1])
    monkeypatch.setattr(choice, "time_native_layer", lambda native, manifest: figures[case][0])

    class Recorded(NativeDecoder):
        def __init__(self, *args):
            super().__init__(*args)
            decoders.append(weakref.ref(self))

    def graphs(*args, **kwargs):  # the whole model's graphs load only once the native weights are gone
        if "slower than" in kwargs.get("decode_kernels", ""):
            gc.collect()
            assert all(ref() is None for ref in decoders)
        return OrtModel(*args, **kwargs)

    monkeypatch.setattr(choice, "NativeDecoder", Recorded)
    monkeypatch.setattr(choice, "OrtModel", graphs)
    case = "slower"
    model = load_model(load_manifest(tiny_cpu_artifact), decode="auto", threads=1)
    assert not isinstance(model, NativeModel) and model.decode_kernels.startswith("onnx (native ")
    assert "slower than the graphs here" in model.decode_kernels and "2.000 ms" in model.decode_kernels
    assert timed == [1]
    kept = load_model(load_manifest(tiny_cpu_artifact), decode="auto", threads=1)
    assert not isinstance(kept, NativeModel) and "kept from an earlier run" in kept.decode_kernels and timed == [1]
    (tmp_path / choice.CHOICES).write_text('{"' + '": {"native_ms": -1}}')  # damaged: measured again
    case = "faster"
    model = load_model(load_manifest(tiny_cpu_artifact), decode="auto", threads=1)
    assert isinstance(model, NativeModel) and timed == [1, 1]
    assert model.decode_kernels.startswith(f"native ({model.native.isa}; layer 0 measured 0.500 ms")
    assert json.loads((tmp_path / choice.CHOICES).read_text())  # rewritten whole
    case = "within the margin"
    (tmp_path / choice.CHOICES).unlink()
    assert isinstance(load_model(load_manifest(tiny_cpu_artifact), decode="auto", threads=1), NativeModel)
    case = "slower"  # but the graphs would not fit (a real-size MoE layer on a 24 GB host): nothing is timed
    (tmp_path / choice.CHOICES).unlink()
    need = choice.graphs_memory(load_manifest(tiny_cpu_artifact))
    monkeypatch.setattr(choice, "available_memory", lambda: need - 1)
    model = load_model(load_manifest(tiny_cpu_artifact), decode="auto", threads=1)
    assert isinstance(model, NativeModel) and "the graphs would need about" in model.decode_kernels
    assert timed == [1, 1, 1] and not (tmp_path / choice.CHOICES).exists()


def test_the_first_layer_is_timed_both_ways(tiny_cpu_artifact):
    model = _native_or_skip(tiny_cpu_artifact)
    graphs = OrtModel(load_manifest(tiny_cpu_artifact), layers=range(1), embed=False)
    assert graphs.embed_session is None and graphs.head_session is None and len(graphs.layer_sessions) == 1
    assert choice.time_graph_layer(graphs) > 0
    assert choice.time_native_layer(model.native, model.manifest) > 0


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
    model = load_model(load_manifest(tiny_artifacts["fp8"]), decode="auto")
    assert not isinstance(model, NativeModel)
    assert model.decode_kernels.startswith("onnx (native: ") and "int8 cache" in model.decode_kernels
    with pytest.raises(K2Error, match="native decode step cannot run.*use --decode onnx"):
        load_model(load_manifest(tiny_artifacts["fp8"]), decode="native")
    with pytest.raises(K2Error, match="unknown decode kernels"):
        load_model(load_manifest(tiny_artifacts["fp8"]), decode="fast")


def test_auto_keeps_to_the_graphs_where_the_weights_cannot_be_mapped_beside_them(tiny_cpu_artifact, monkeypatch):
    monkeypatch.setattr("k2deploy.runtime.backends.native.decoder.available_memory", lambda: 1 << 20)
    model = load_model(load_manifest(tiny_cpu_artifact), decode="auto")
    assert not isinstance(model, NativeModel) and "runs on them in memory" in model.decode_kernels
    assert "1 MiB" not in model.decode_kernels and "GiB is available" in model.decode_kernels


def test_an_artifact_holding_its_weights_in_rows_keeps_to_the_graphs_and_says_export_again(tiny_cpu_artifact):
    """An artifact exported before the tiles (no weight_layout in its manifest) runs through the graphs."""
    loaded = load_manifest(tiny_cpu_artifact)
    data = {k: v for k, v in loaded.data.items() if k != "weight_layout"}
    with pytest.raises(NativeUnavailable, match="holds them in rows .* export it again"):
        NativeDecoder.check_target(dataclasses.replace(loaded, data=data))


def test_a_model_past_the_steps_routing_limits_keeps_to_the_graphs(tiny_cpu_artifact):
    loaded = load_manifest(tiny_cpu_artifact)
    grouped = dict(loaded.data["model_config"], n_routed_experts=130, n_group=65, topk_group=4)
    manifest = dataclasses.replace(loaded, data=dict(loaded.data, model_config=grouped))
    with pytest.raises(NativeUnavailable, match="n_group 65 \\(at most 64\\)"):
        NativeDecoder(manifest, 1, 64)


def test_a_build_whose_contract_differs_from_the_runtimes_is_refused(tiny_cpu_artifact, monkeypatch):
    """The library's constants and struct sizes (k2_contract) are checked against the Python side's at load."""
    _native_or_skip(tiny_cpu_artifact)
    monkeypatch.setattr("k2deploy.runtime.backends.native.decoder.PAGE_SIZE", 32)
    with pytest.raises(NativeUnavailable, match="does not match this runtime: page 64 \\(here 32\\)"):
        NativeDecoder(load_manifest(tiny_cpu_artifact), 1, 64)


def test_a_graph_whose_weights_are_not_the_expected_shape_is_refused(tiny_cpu_artifact):
    weights = GraphWeights(load_manifest(tiny_cpu_artifact), "layer_000")
    with pytest.raises(NativeUnavailable, match="input_layernorm.weight is"):
        weights.floats("input_layernorm.weight", (7,))
    with pytest.raises(NativeUnavailable, match="missing"):
        weights.floats("no_such.weight", (7,))


@pytest.mark.parametrize("graph", ["layer_001", "head", "embed"])
def test_the_native_load_hashes_each_weights_file_in_the_read_that_maps_it(tiny_cpu_artifact, tmp_path, graph):
    """With the graphs left unhashed at load (as generate and serve load an artifact), the native step checks
    every data file it maps against the manifest's chunk digests in the read that brings it into memory: an
    altered byte of one file is refused by name, and an intact artifact leaves no file of the model unhashed."""
    _native_or_skip(tiny_cpu_artifact)
    intact = load_manifest(tiny_cpu_artifact, hash_graphs=False)
    assert intact.unhashed == set(intact.graph_files())
    NativeDecoder(intact, 1, 64)
    assert intact.unhashed == set()
    artifact = shutil.copytree(tiny_cpu_artifact, tmp_path / "artifact")
    data = artifact / load_manifest(artifact).graph_entry(graph)["data"]
    altered = bytearray(data.read_bytes())
    altered[len(altered) // 2] ^= 0x01  # same size: only its hash tells
    data.write_bytes(bytes(altered))
    with pytest.raises(K2Error, match=f"file graphs/{graph}.data does not match its digests"):
        NativeDecoder(load_manifest(artifact, hash_graphs=False), 1, 64)

def test_the_build_says_what_is_missing_and_leaves_only_finished_libraries(tmp_path, monkeypatch):
    monkeypatch.setenv("K2DEPLOY_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(NativeUnavailable, match="does not run"):
        build.build()
    monkeypatch.delenv("CC")
    try:
        built = build.build()
    except NativeUnavailable as exc:
        pytest.skip(f"no C compiler here: {exc}")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [built.name, built.name + ".sha256"]
    assert build.build() == built  # a second call takes the cached build
    whole = built.read_bytes()
    for damage in (whole[:len(whole) // 3], b"\x7fELF" + bytes(1000), Path(_ctypes.__file__).read_bytes()):
        built.write_bytes(damage)  # truncated, random, another library: built again, never loaded
        assert build.build() == built and built.read_bytes() == whole


@pytest.mark.parametrize("writes, message", [("", "exited without writing a library"),
                                             ("printf 'not a library' > \"$out\"", "is not its library")])
def test_a_compiler_that_writes_nothing_or_garbage_is_named_and_nothing_is_sealed(tmp_path, monkeypatch, writes,
                                                                                 message):
    """CC=/bin/true (exits 0, writes nothing) or a CC that writes a file that is no library: the refusal names the
    compiler, not the cache folder, and the cache keeps nothing that a later load would take."""
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\nout=""\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                        + (writes or "true") + "\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("K2DEPLOY_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(compiler))
    with pytest.raises(NativeUnavailable, match=message) as refused:
        build.build()
    assert str(compiler) in str(refused.value) and "K2DEPLOY_NATIVE_CACHE" not in str(refused.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_build_maps_nothing_into_the_process_that_built_it(tmp_path):
    """The build's check that its library loads runs in a child: a process that built the library and later sees
    its cached file rewritten in place (a damaged cache, rebuilt) exits cleanly, not with SIGBUS from a mapping."""
    child = ("import sys; from pathlib import Path; from k2deploy.runtime.backends.native import build as b\n"
             "try:\n    built = b.build()\nexcept b.NativeUnavailable:\n    sys.exit(0)\n"
             "built.write_bytes(b'damaged')\n")
    env = {**child_env(Path(__file__).parent), "K2DEPLOY_NATIVE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_generate_takes_decode_and_refuses_native_where_it_cannot_run(tiny_cpu_artifact, tiny_artifacts):
    runs = {(decode, threads): run_cli("generate", tiny_cpu_artifact, "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                                       "--json", "--decode", decode, "--threads", threads)
            for decode, threads in (("native", "1"), ("native", "2"), ("onnx", "1"))}
    assert all(run.returncode == 0 for run in runs.values()), [run.stderr for run in runs.values()]
    tokens = {key: json.loads(run.stdout)["token_ids"] for key, run in runs.items()}
    assert tokens["native", "1"] == tokens["native", "2"]
    kernels = {key: json.loads(run.stdout)["decode_kernels"] for key, run in runs.items()}
    assert kernels["native", "1"].startswith("native (") and kernels["onnx", "1"] == "onnx"
    assert all(f"decode: {kernels[key]}" in run.stderr for key, run in runs.items())  # said on stderr too
    refused = run_cli("generate", tiny_artifacts["fp8"], "--prompt-ids", "1,2", "--decode", "native")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "native decode step cannot run" in refused.stderr


def _greedy(model, prompts: list[list[int]], params: SamplingParams) -> list[list[TokenLogprob]]:
    """The prompts as concurrent requests of one step loop -> each one's sampled tokens with their logprobs."""
    loop = StepLoop(model, len(prompts), max(map(len, prompts)) + params.max_new_tokens, max_queue=0)
    got: list[list[TokenLogprob]] = [[] for _ in prompts]
    for row, prompt in enumerate(prompts):
        loop.submit(GenerationRequest(list(prompt), params, lambda update, row=row: got[row].extend(update.logprobs)))
    loop.run_until_done()
    return got


def test_sixteen_concurrent_requests_get_their_solo_tokens_and_logprobs_to_the_bit(tiny_cpu_artifact):
    """Batch invariance on the cpu target: where the native step runs the model, a request's tokens and logprobs
    are the ones it gets alone, whatever else shares its prefill and decode steps (each token's products, routing,
    experts and attention are its own, in the same order)."""
    model = _native_or_skip(tiny_cpu_artifact)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 1000, int(n)).tolist() for n in rng.integers(3, 90, 16)]
    params = SamplingParams(max_new_tokens=12, logprobs=2)
    together = _greedy(model, prompts, params)
    alone = [_greedy(model, [prompt], params)[0] for prompt in prompts]
    assert all(len(tokens) == params.max_new_tokens for tokens in together)
    assert together == alone


class _BreakingGrammar:
    """A grammar stand-in that allows every token for `good` tokens, then breaks: its matcher raises ("consume"), or
    it forbids every token, so that sampling raises ("sample")."""

    def __init__(self, good: int, how: str):
        self.good, self.how, self.read = good, how, 0

    def allowed(self, logits: np.ndarray) -> np.ndarray:
        return np.full_like(logits, -np.inf) if self.how == "sample" and self.read >= self.good else logits

    def consume(self, token: int) -> None:
        self.read += 1
        if self.how == "consume" and self.read > self.good:
            raise K2Error("the matcher broke")


def test_a_request_whose_grammar_or_sampler_fails_fails_alone(tiny_cpu_artifact):
    """A batch of 8 where one request's grammar raises mid-decode and another's sampling does: those two get an
    error and leave, the step goes on, and the other 6 finish with their solo tokens and logprobs."""
    model = _native_or_skip(tiny_cpu_artifact)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(2, 1000, int(n)).tolist() for n in rng.integers(3, 40, 8)]
    params = SamplingParams(max_new_tokens=10, logprobs=1)
    alone = [_greedy(model, [prompt], params)[0] for prompt in prompts]
    loop = StepLoop(model, len(prompts), 64, max_queue=0)
    got = [[] for _ in prompts]
    errors: dict[int, str] = {}
    broken = {2: _BreakingGrammar(3, "consume"), 5: _BreakingGrammar(4, "sample")}

    def deliver(update, row):
        got[row].extend(update.logprobs)
        if update.error:
            errors[row] = update.error

    for row, prompt in enumerate(prompts):
        loop.submit(GenerationRequest(list(prompt), params, lambda update, row=row: deliver(update, row),
                                      constraint=broken.get(row)))
    loop.run_until_done()
    assert set(errors) == {2, 5}
    assert "the matcher broke" in errors[2] and "no token may come next" in errors[5]
    assert [got[row] for row in range(8) if row not in broken] == [alone[row] for row in range(8) if row not in broken]
    assert got[2] == alone[2][:3] and got[5] == alone[5][:4]  # what each sent before it broke
    assert loop.scheduler.running() == [] and loop.cache.pool.used == 0


@pytest.mark.parametrize("experts", ["int8", "int4"])
@pytest.mark.parametrize("chunk", [1, 64])
def test_a_prompt_chunked_any_way_gives_the_same_logits_to_the_bit(tiny_cpu_artifact, tiny_int4_cpu_artifact, chunk,
                                                                   experts):
    """A 300-token prompt through the native step whole (up to 512 tokens a step), or 64 or 1 token a step: the
    same cache entries and the same logits at every position, to the bit. One token a step takes the attention of a
    query alone and each product one input at a time; a chunk takes the attention in row tiles and the products
    several inputs a pass (int8 and 4-bit experts alike)."""
    artifact = tiny_cpu_artifact if experts == "int8" else tiny_int4_cpu_artifact
    _native_or_skip(artifact)
    whole, whole_cache = chunked_prefill(artifact, 512)
    chunked, chunked_cache = chunked_prefill(artifact, chunk)
    assert np.array_equal(whole, chunked)
    for name in whole_cache:
        assert np.array_equal(whole_cache[name], chunked_cache[name]), name


def test_a_cache_whose_pools_do_not_fit_the_model_is_refused(tiny_cpu_artifact):
    """The step writes into the cache's pools in place: pools of another shape than the model's (an edited
    kv_cache) are a one-line refusal, never a write past their end."""
    model = _native_or_skip(tiny_cpu_artifact)
    store = model.new_store(2)
    narrow = {**store.arrays, "latent": store.arrays["latent"][..., :32].copy()}
    with pytest.raises(K2Error, match="latent pool is uint8 \\[3, 2, 64, 32\\], the native step takes \\[3, 2, 64, 64\\]"):
        model.native.step(1, 0, np.arange(2), narrow)


def test_an_artifact_whose_kv_cache_does_not_fit_its_model_is_refused_before_the_native_step(tiny_cpu_artifact,
                                                                                          tmp_path):
    art = shutil.copytree(tiny_cpu_artifact, tmp_path / "art")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["kv_cache"]["latent_dim"] = 32
    (art / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli("generate", art, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "kv_cache dims (32, 16) are not its model's (64, 16)" in result.stderr
