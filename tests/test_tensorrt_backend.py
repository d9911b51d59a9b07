"""`build-engines` and the `tensorrt` backend (generate, score, bench, serve) end to end against the stand-in
for TensorRT and cuda-python in tests/stand_in/: its "engines" run the TensorRT copies of the graphs with
ONNX Runtime, its "device" memory is host memory. What this runs is k2deploy's own side of the TensorRT
path: the engine build loop and record, the profiles, the device buffers and cache, the copies between
them, the per-step bindings and the server's cache rows; what it cannot check is TensorRT itself."""

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from child_env import STAND_IN, blocked, child_env

pytestmark = pytest.mark.slow  # TensorRT-target exports and engine builds against the stand-in

pytest.importorskip("onnx")
pytest.importorskip("triton")  # build-engines wants triton for the ahead-of-time kernels

PROMPT = "1,5,9,200,7,8,9"


def _k2deploy(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k2deploy", *map(str, args)], capture_output=True, text=True,
                          env=env or child_env(STAND_IN), timeout=600)


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def built(request, tiny_artifacts, tmp_path_factory):
    """A copy of a tiny artifact with engines built for the stand-in GPU: (artifact, record)."""
    artifact = shutil.copytree(tiny_artifacts[request.param], tmp_path_factory.mktemp("trt") / request.param)
    done = _k2deploy("build-engines", artifact, "--max-batch", "4", "--max-seq", "64", "--json")
    assert done.returncode == 0, done.stderr
    return artifact, json.loads(done.stdout)


def test_build_engines_writes_an_engine_per_graph_and_its_record(built):
    artifact, record = built
    folder = artifact / "engines" / "nvidia-h200-sm90"
    assert record["gpu"] == {"name": "NVIDIA H200", "compute_capability": "9.0", "slug": "nvidia-h200-sm90"}
    assert set(record["engines"]) == {"embed", "layer_000", "layer_001", "layer_002", "head"}
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"{stem}.engine" for stem in record["engines"]] + ["engines.json"])
    assert set(record["plugins"].values()) == {"aot"}
    assert record["settings"]["max_batch"] == 4 and record["settings"]["max_seq"] == 64


def test_a_second_build_keeps_what_still_fits_and_rebuilds_a_changed_graph(built):
    artifact, _ = built
    done = _k2deploy("build-engines", artifact, "--max-batch", "4", "--max-seq", "64")
    assert done.returncode == 0 and done.stderr.count(" kept") == 5, done.stderr
    record_file = artifact / "engines" / "nvidia-h200-sm90" / "engines.json"
    record = json.loads(record_file.read_text())
    record["engines"]["head"]["onnx_sha256"] = "0" * 64  # as if head's TensorRT copy had changed since
    record_file.write_text(json.dumps(record))
    done = _k2deploy("build-engines", artifact, "--max-batch", "4", "--max-seq", "64")
    assert done.returncode == 0, done.stderr
    assert re.search(r"head\s+built", done.stderr) and done.stderr.count(" kept") == 4, done.stderr
    other = _k2deploy("build-engines", artifact, "--max-batch", "2", "--max-seq", "64")  # other settings: all anew
    assert other.returncode == 0 and " kept" not in other.stderr, other.stderr
    done = _k2deploy("build-engines", artifact, "--max-batch", "4", "--max-seq", "64")  # as the other tests want
    assert done.returncode == 0 and " kept" not in done.stderr, done.stderr


def test_score_and_generate_match_onnxruntime(built, tmp_path):
    artifact, _ = built
    for backend in ("tensorrt", "onnxruntime"):
        done = _k2deploy("score", artifact, "--prompt-ids", PROMPT, "--out", tmp_path / f"{backend}.npy",
                         "--backend", backend)
        assert done.returncode == 0, done.stderr
    logits, reference = (np.load(tmp_path / f"{b}.npy") for b in ("tensorrt", "onnxruntime"))
    assert logits.shape == reference.shape and np.abs(logits - reference).max() < 1e-4
    tokens = []
    for backend in ("tensorrt", "onnxruntime"):
        done = _k2deploy("generate", artifact, "--prompt-ids", PROMPT, "--max-new-tokens", "24", "--backend",
                         backend, "--json")
        assert done.returncode == 0, done.stderr
        tokens.append(json.loads(done.stdout)["token_ids"])
    assert tokens[0] == tokens[1] and len(tokens[0]) == 24


def test_beyond_the_engines_profile_is_a_clear_error(built):
    artifact, _ = built
    done = _k2deploy("generate", artifact, "--prompt-ids", ",".join(["5"] * 70), "--backend", "tensorrt")
    assert done.returncode != 0
    assert "k2deploy build-engines" in done.stderr and "--max-seq" in done.stderr and "Traceback" not in done.stderr


def test_bench_runs_on_the_tensorrt_backend(built, tmp_path):
    artifact, _ = built
    done = _k2deploy("bench", artifact, "--backend", "tensorrt", "--batch", "1,2", "--prompt-len", "16",
                     "--gen-len", "3", "--repeats", "1", "--warmup", "0", "--baseline", "none", "--out", tmp_path,
                     "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["backend"] == "tensorrt" and len(result["cells"]) == 2
    assert result["device"]["kind"] == "gpu" and result["device"]["label"].startswith("NVIDIA H200")
    assert result["device"]["slug"].startswith("gpu-nvidia-h200")  # results are filed under the GPU they ran on
    assert all(c["tpot_ms"]["median"] > 0 for c in result["cells"])


def test_serve_on_the_tensorrt_backend_batches_requests_without_torch(built, tmp_path):
    pytest.importorskip("openai")
    from serving import MODEL, Server

    artifact, _ = built
    server = Server(artifact, tmp_path, "--backend", "tensorrt", "--max-batch", "4", "--max-context", "63",
                    front=(STAND_IN,))
    try:
        assert "tensorrt)" in server.stdout_path.read_text()
        client = server.client()

        def complete(prompt):
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text

        prompts = [[1, 5, 9], [7, 8, 9, 10, 11, 12], [300], [42, 43]]
        alone = [complete(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(complete, prompts))
        assert together == alone
    finally:
        server.stop()


def test_python_plugin_engines_need_torch_where_they_run(tiny_artifacts, tmp_path):
    """Engines built with --no-aot run their plugins' kernels from Python: on a host without torch, loading
    them says so and how to do without, instead of failing inside TensorRT."""
    artifact = shutil.copytree(tiny_artifacts["fp8"], tmp_path / "jit")
    done = _k2deploy("build-engines", artifact, "--max-batch", "1", "--max-seq", "32", "--no-aot", "--json")
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)["plugins"].values()) == {"jit"}
    done = _k2deploy("generate", artifact, "--prompt-ids", PROMPT, "--backend", "tensorrt",
                     env=child_env(blocked(tmp_path, "torch"), STAND_IN))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "built with --no-aot" in done.stderr and "need torch" in done.stderr and "rebuild without --no-aot" in \
        done.stderr
    done = _k2deploy("generate", artifact, "--prompt-ids", PROMPT, "--max-new-tokens", "4", "--backend", "tensorrt")
    assert done.returncode == 0, done.stderr  # with torch there, the Python plugins are registered and it runs
