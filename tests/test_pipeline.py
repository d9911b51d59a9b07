"""Pipeline stages over layer ranges, in one process and on Ray actors (Ray started here, on this host), stepped
through a compiled graph or through tasks: the prompt logits and greedy tokens of one process; each stage's own
memory check and file hashes; the server over Ray stages, and a stage that dies mid-stream."""

from __future__ import annotations

import shutil
import socket
import time
from argparse import Namespace

import httpx
import numpy as np
import pytest

from cli_runner import run_cli

from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import load_manifest
from k2deploy.core.placement import parse_placement
from k2deploy.runtime.stages import ray_compiled
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.backends.onnx.model import OrtModel
from k2deploy.runtime.stages.pipeline import StageRunner
from k2deploy.runtime.stages.placed import load_placed
from k2deploy.runtime.engine.sampling import SamplingParams
from k2deploy.runtime.stages.stage_messages import pack, unpack
from k2deploy.runtime.backends.onnx.thread_pool import core_cpus, share_cpus
from k2deploy.runtime.engine.config import resolve_engine_config
from k2deploy.runtime.loading import load_backend

pytestmark = pytest.mark.slow  # stages on Ray actors and in processes

ray = pytest.importorskip("ray")

PLACEMENTS = ["0:1@cpu,1:3@cpu", "0:1@cpu,1:2@cpu,2:3@cpu"]
PROMPTS = [[5, 17, 300, 42, 9, 77, 3], [8, 1, 640]]


@pytest.fixture(scope="module")
def ray_address():
    ray.init(num_cpus=4, include_dashboard=False, namespace="k2deploy", log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _whole_and_placed(artifact, placement, ray_address):
    """The whole model and its stages, both through the graphs (a cpu artifact's stages would take the native
    step by default: test_cpu_stages_run_the_native_step... holds those)."""
    manifest = load_manifest(artifact)
    whole = Generator(OrtModel(manifest, threads=1))
    placed = Generator(load_placed(manifest, placement, ray_address, "cpu", 1, 4096, decode="onnx"))
    return whole, placed


def _same_logits_and_tokens(whole, placed):
    difference = np.abs(placed.score(PROMPTS[0]) - whole.score(PROMPTS[0])).max()
    assert difference <= 1e-5, difference
    params = SamplingParams(max_new_tokens=8)  # two prompts: a micro-batch per stage, in flight together on Ray
    assert ([g.token_ids for g in placed.generate(PROMPTS, params)]
            == [g.token_ids for g in whole.generate(PROMPTS, params)])


@pytest.mark.parametrize("on_ray", [False, True], ids=["one process", "ray actors"])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=["2 stages", "3 stages"])
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_stages_give_the_logits_and_tokens_of_one_process(tiny_artifacts, ray_address, cache, placement, on_ray):
    whole, placed = _whole_and_placed(tiny_artifacts[cache], placement, ray_address if on_ray else None)
    if on_ray:  # a step is one run of a compiled graph, not tasks; the first stage runs in this process
        assert placed.model.stages.graph is not None
        assert placed.model.stages.local is not None and len(placed.model.stages.actors) == placement.count(",")
    _same_logits_and_tokens(whole, placed)


@pytest.mark.parametrize("on_ray", [False, True], ids=["one process", "ray actors"])
def test_cpu_stages_run_the_native_step_and_give_its_logits_and_tokens_to_the_bit(tiny_cpu_artifact, ray_address,
                                                                                   on_ray):
    """A cpu artifact's stages each run their range of layers through the native step (each maps only its own
    files; the first embeds, the last runs the head), and say so; the hidden state crosses between them as it is,
    so the logits and tokens are the whole native model's to the bit."""
    from k2deploy.runtime.backends.native.choice import load_model
    from k2deploy.runtime.backends.native.build import NativeUnavailable, build

    try:
        build()
    except NativeUnavailable as exc:
        pytest.skip(f"the native decode step cannot be built here: {exc}")
    manifest = load_manifest(tiny_cpu_artifact)
    whole = Generator(load_model(manifest, threads=1, decode="native"))
    placed = Generator(load_placed(manifest, "0:1@cpu,1:3@cpu", ray_address if on_ray else None, "cpu", 1, 4096,
                                   decode="native"))
    kernels = placed.model.decode_kernels
    assert kernels.startswith("stages 0:1 native (") and ", 1:3 native (" in kernels, kernels
    assert np.array_equal(placed.score(PROMPTS[0]), whole.score(PROMPTS[0]))
    params = SamplingParams(max_new_tokens=8)
    assert ([g.token_ids for g in placed.generate(PROMPTS, params)]
            == [g.token_ids for g in whole.generate(PROMPTS, params)])


def test_a_stage_that_cannot_run_natively_says_why_or_takes_the_graphs(tiny_artifacts, tiny_cpu_artifact):
    """--decode native on an artifact the native step does not run is a one-line error naming the stage; auto takes
    the graphs and says why; onnx takes the graphs."""
    from k2deploy.runtime.backends.native.choice import load_stage

    fp8 = load_manifest(tiny_artifacts["fp8"])
    with pytest.raises(K2Error, match="cannot run stage 0:1"):
        load_stage(fp8, range(0, 1), threads=1, decode="native")
    assert load_stage(fp8, range(0, 1), threads=1).decode_kernels.startswith("onnx (native: ")
    assert load_stage(load_manifest(tiny_cpu_artifact), range(1, 3), threads=1, decode="onnx").decode_kernels == \
        "onnx (asked for)"


def test_an_idle_server_releases_the_compiled_graph_and_the_next_request_compiles_it(tiny_artifacts, ray_address,
                                                                                     monkeypatch):
    from k2deploy.runtime.engine.requests import GenerationRequest
    from k2deploy.runtime.serve import engine_thread
    from k2deploy.runtime.serve.metrics import ServerMetrics

    monkeypatch.setattr(engine_thread, "IDLE_WAIT_S", 0.05)
    monkeypatch.setattr(engine_thread, "IDLE_RELEASE_S", 0.2)
    whole, placed = _whole_and_placed(tiny_artifacts["fp8"], PLACEMENTS[1], ray_address)
    stages = placed.model.stages
    held_a_graph = []  # at each release: whether there was a compiled graph to let go of
    release = stages.release
    stages.release = lambda: (held_a_graph.append(stages.graph is not None), release())
    config = resolve_engine_config(load_manifest(tiny_artifacts["fp8"]), max_batch=2, max_context=64, max_queue=4)
    engine = engine_thread.Engine(placed.model, config, ServerMetrics())
    engine.start()

    def released() -> bool:
        deadline = time.monotonic() + 30
        while stages.graph is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        return stages.graph is None

    try:
        assert released()  # started and never asked: the actors stop polling
        updates = []
        params = SamplingParams(max_new_tokens=6)
        engine.submit(GenerationRequest(list(PROMPTS[0]), params, updates.append))
        deadline = time.monotonic() + 60
        while not any(u.finish_reason or u.error for u in updates) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(u.error for u in updates), updates
        assert [t for u in updates for t in u.token_ids] == whole.generate([PROMPTS[0]], params)[0].token_ids
        assert released()  # idle again after the request: released again
        assert held_a_graph == [True, True]  # the request compiled the graph again, once
    finally:
        engine.stop()


def test_where_no_graph_compiles_one_line_says_so_and_tasks_step(tiny_artifacts, ray_address, monkeypatch, capsys):
    def refuse(*args):
        raise RuntimeError("no channels here")

    monkeypatch.setattr(ray_compiled.CompiledStep, "__init__", refuse)
    whole, placed = _whole_and_placed(tiny_artifacts["fp8"], PLACEMENTS[1], ray_address)
    notice = capsys.readouterr().err.strip().splitlines()
    assert len(notice) == 1 and "run as tasks" in notice[0] and "no channels here" in notice[0], notice
    assert placed.model.stages.graph is None
    _same_logits_and_tokens(whole, placed)


def test_the_int8_cache_stages_too(tiny_cpu_artifact, ray_address):
    whole, placed = _whole_and_placed(tiny_cpu_artifact, PLACEMENTS[0], ray_address)
    assert np.abs(placed.score(PROMPTS[0]) - whole.score(PROMPTS[0])).max() <= 1e-5
    assert placed.model.stage_seconds.keys() >= {"embed", "layer_000", "layer_002", "head"}
    # two stages on this host: the first in this process, not pinned (the process does more than its stage); the
    # second on an actor that keeps to the second share of the cores
    stages = placed.model.stages
    assert stages.local is not None and stages.local.pinned_cpus() is None
    assert ray.get([actor.pinned_cpus.remote() for actor in stages.actors]) == [sorted(share_cpus(core_cpus(), 1, 2))]


def test_every_stage_on_an_actor_when_asked(tiny_artifacts, ray_address):
    manifest = load_manifest(tiny_artifacts["fp8"])
    whole = Generator(OrtModel(manifest, threads=1))
    placed = Generator(load_placed(manifest, PLACEMENTS[1], ray_address, "cpu", 1, 4096, driver_stage=False))
    assert placed.model.stages.local is None and len(placed.model.stages.actors) == 3
    _same_logits_and_tokens(whole, placed)


def test_a_driver_stage_that_fails_with_micro_batches_in_flight_leaves_no_result_to_answer_the_next_step(
        tiny_artifacts, ray_address):
    whole, placed = _whole_and_placed(tiny_artifacts["fp8"], PLACEMENTS[0], ray_address)
    stages = placed.model.stages
    forward, calls = stages.local.forward, []

    def second_fails(*args):
        calls.append(1)
        if len(calls) == 2:  # the first micro-batch is on its way through the actor by now
            raise K2Error("the driver's stage failed")
        return forward(*args)

    stages.local.forward = second_fails
    with pytest.raises(K2Error, match="the driver's stage failed"):
        placed.generate(PROMPTS, SamplingParams(max_new_tokens=2))
    assert stages.graph is None
    stages.local.forward = forward
    _same_logits_and_tokens(whole, placed)


def test_a_stage_message_gives_back_its_arrays_and_refuses_a_cut_or_padded_one():
    arrays = (np.array([[5, 17]]), np.arange(6, dtype=np.int32).reshape(2, 3), np.array([[True, False]]),
              None, np.zeros((0, 4), np.int64), np.linspace(-1, 1, 30, dtype=np.float32).reshape(2, 3, 5))
    message = pack(arrays)
    back = unpack(message)
    assert len(back) == len(arrays)
    for sent, got in zip(arrays, back):
        assert (got is None) if sent is None else (got.dtype == sent.dtype and np.array_equal(got, sent))
    for bad in (b"", message[:-8], message + bytes(8), b"\x01\x09\x01" + bytes(13)):
        with pytest.raises(K2Error, match="pipeline stage message is malformed"):
            unpack(bad)


def test_a_placement_that_does_not_fit_says_what_would(tiny_artifacts):
    manifest = load_manifest(tiny_artifacts["fp8"])
    with pytest.raises(Exception, match=r"stage 0 \(layers 0:3 on h0/cpu\) needs .* would fit"):
        load_backend(manifest, resolve_engine_config(manifest, Namespace(placement="0:3@cpu"),
                                                     cache_tokens=4096 * 10**9))


def test_a_ray_stage_checks_its_own_hosts_memory(tiny_artifacts, ray_address):
    manifest = load_manifest(tiny_artifacts["fp8"])
    with pytest.raises(K2Error, match=rf"stage [01] \(layers [01]:[13] on h0/cpu\) needs .* on host "
                                      rf"{socket.gethostname()} offers .*; --max-total-tokens \d+ would fit") as refused:
        placed = Namespace(placement="0:1@cpu,1:3@cpu", ray=ray_address)
        load_backend(manifest, resolve_engine_config(manifest, placed,
                                                     cache_tokens=10**12 // manifest.config.num_hidden_layers))
    assert len(str(refused.value).splitlines()) == 1


def test_a_stage_hashes_only_its_own_files(tiny_artifacts, tmp_path):
    artifact = shutil.copytree(tiny_artifacts["fp8"], tmp_path / "artifact")
    manifest = load_manifest(artifact)
    head = artifact / manifest.graphs["head"]["data"]
    altered = bytearray(head.read_bytes())
    altered[-1] ^= 0xFF  # same size: only its hash tells
    head.write_bytes(bytes(altered))
    first, last = parse_placement("0:1@cpu,1:3@cpu", manifest.config.num_hidden_layers)
    assert StageRunner(str(artifact), first, "cpu", 1).ready() is False  # loads: the head is not its file
    with pytest.raises(K2Error, match=f"file {manifest.graphs['head']['data']} does not match its digests"):
        StageRunner(str(artifact), last, "cpu", 1)


def test_an_unreachable_ray_address_is_one_line(tiny_artifacts):
    done = run_cli("generate", tiny_artifacts["fp8"], "--prompt-ids", "1,2", "--ray", "127.0.0.1:9")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "no Ray cluster answers there" in done.stderr


def test_serving_over_ray_stages_survives_a_stage_that_dies(tiny_artifacts, ray_address, tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from serving import MODEL, Server

    server = Server(tiny_artifacts["bf16"], tmp_path, "--ray", ray_address, "--placement", PLACEMENTS[0],
                    "--max-batch", "2")
    try:
        client = server.client()
        whole = Generator(OrtModel(load_manifest(tiny_artifacts["bf16"]), threads=1))
        answer = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
        expected = whole.generate([PROMPTS[1]], SamplingParams(max_new_tokens=6))[0]
        assert answer.usage.completion_tokens == len(expected.token_ids)

        stage = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith(f"k2deploy-{server.process.pid}-") and a["name"].endswith("-stage-1"))
        stream = iter(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3000, temperature=0,
                                                stream=True))
        next(stream)
        ray.kill(ray.get_actor(stage, namespace="k2deploy"), no_restart=False)  # Ray restarts it
        with pytest.raises(openai.APIError, match="pipeline stage"):
            for _ in stream:
                pass
        deadline = time.monotonic() + 90
        statuses = set()
        while (health := httpx.get(f"{server.url}/health", timeout=30)).status_code != 200:
            statuses.add((health.status_code, "pipeline stage 1" in health.json()["status"]))
            assert time.monotonic() < deadline, health.text
            time.sleep(0.5)
        assert statuses <= {(503, True)}
        again = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
        assert again.choices[0].text == answer.choices[0].text
    finally:
        server.stop()
