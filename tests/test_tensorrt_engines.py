"""The engine record checked on load, and what build-engines and --backend tensorrt say without TensorRT."""

import argparse
import json

import pytest

from k2deploy.core.errors import K2Error
from k2deploy.runtime.engine.config import resolve_engine_config
from k2deploy.runtime.loading import load_backend
from k2deploy.core.tensorrt.environment import INSTALL_HINT, GpuInfo, require_tensorrt, tensorrt_available
from k2deploy.export.tensorrt_engines import profile_shapes
from k2deploy.commands.engines_command import add_build_engines_parser
from k2deploy.commands.runtime_options import add_runtime_options
from k2deploy.core.tensorrt.engine_record import (
    RECORD_FILE, check_record, engines_dir, find_engines, make_record, read_record, write_record)

H200 = GpuInfo("NVIDIA H200", "9.0")
L40S = GpuInfo("NVIDIA L40S", "8.9")
DIGEST = "ab" * 32


@pytest.fixture
def built(tmp_path):
    """A fake artifact with a fake engine folder for the H200: (artifact, folder, record)."""
    folder = engines_dir(tmp_path, H200)
    folder.mkdir(parents=True)
    (folder / "embed.engine").write_bytes(b"plan")
    record = make_record(H200, "10.13.0.35", DIGEST, {"embed": {"engine": "embed.engine", "onnx": "graphs/e.onnx"}},
                         {"max_batch": 8}, {"MoeRoute": "aot"}, folder)
    write_record(folder, record)
    return tmp_path, folder, read_record(folder)


def test_gpu_folder_names():
    assert H200.slug == "nvidia-h200-sm90"
    assert GpuInfo("NVIDIA GeForce RTX 4090", "8.9").slug == "nvidia-geforce-rtx-4090-sm89"
    assert engines_dir("ART", H200).as_posix() == "ART/engines/nvidia-h200-sm90"


def test_a_fitting_record_passes(built):
    artifact, folder, record = built
    assert record["engines"]["embed"]["bytes"] == 4 and len(record["engines"]["embed"]["sha256"]) == 64
    check_record(record, H200, "10.13.0.35", DIGEST, artifact, folder)
    assert find_engines(artifact, H200) == folder


@pytest.mark.parametrize("gpu, version, digest, message", [
    (L40S, "10.13.0.35", DIGEST, "built for NVIDIA H200 \\(compute capability 9.0\\), this GPU is NVIDIA L40S"),
    (GpuInfo("NVIDIA H200", "10.0"), "10.13.0.35", DIGEST, "compute capability 10.0"),
    (H200, "11.4.0.106", DIGEST, "built with TensorRT 10.13.0.35, this is TensorRT 11.4.0.106"),
    (H200, "10.13.0.35", "cd" * 32, "another export"),
])
def test_a_record_for_something_else_is_a_clear_error(built, gpu, version, digest, message):
    artifact, folder, record = built
    with pytest.raises(K2Error, match=message) as caught:
        check_record(record, gpu, version, digest, artifact, folder)
    assert f"k2deploy build-engines {artifact}" in str(caught.value) and "\n" not in str(caught.value)


def test_altered_engines_and_records_are_refused(built):
    artifact, folder, record = built
    (folder / "embed.engine").write_bytes(b"other plan")
    with pytest.raises(K2Error, match="missing or altered"):
        check_record(record, H200, "10.13.0.35", DIGEST, artifact, folder)
    with pytest.raises(K2Error, match="record version"):
        check_record({**record, "format_version": 99}, H200, "10.13.0.35", DIGEST, artifact)
    (folder / RECORD_FILE).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(K2Error, match="not a k2deploy engine record"):
        read_record(folder)


def test_no_engines_for_this_gpu_names_the_ones_there_are(built):
    artifact, _, _ = built
    with pytest.raises(K2Error, match="no TensorRT engines for this GPU, NVIDIA L40S \\(there are engines for "
                                      "nvidia-h200-sm90\\); build them with `k2deploy build-engines"):
        find_engines(artifact, L40S)


def test_profiles_cover_prefill_and_decode():
    latent = ["pages", 64, 512]
    assert profile_shapes(latent, "prefill", 8, 4096) == ((1, 64, 512), (512, 64, 512), (512, 64, 512))
    assert profile_shapes(["batch", "table"], "decode", 8, 4096) == ((1, 0), (8, 32), (8, 64))
    assert profile_shapes(["batch", "seq", 7168], "decode", 8, 4096) == ((1, 1, 7168), (8, 1, 7168), (8, 1, 7168))
    with pytest.raises(K2Error, match="no optimisation-profile range"):
        profile_shapes(["tokens"], "decode", 8, 4096)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="k2deploy")
    sub = parser.add_subparsers(dest="command", required=True)
    add_build_engines_parser(sub)
    run = sub.add_parser("generate")
    add_runtime_options(run)
    return parser.parse_args(argv)


def test_cli_options():
    args = _parse(["build-engines", "ART", "--max-batch", "4", "--max-seq", "2048", "--workspace", "8", "--no-aot"])
    assert (args.artifact, args.gpu, args.max_batch, args.max_seq, args.workspace, args.no_aot) == \
        ("ART", "auto", 4, 2048, 8.0, True)
    assert _parse(["generate"]).backend == "onnxruntime"
    assert _parse(["generate", "--backend", "tensorrt"]).backend == "tensorrt"


@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is installed here")
def test_without_tensorrt_build_engines_says_what_to_install(tmp_path):
    args = _parse(["build-engines", str(tmp_path)])
    with pytest.raises(K2Error) as caught:
        args.func(args)
    assert str(caught.value) == INSTALL_HINT
    assert "pip install tensorrt" in INSTALL_HINT and "\n" not in INSTALL_HINT


@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is installed here")
def test_without_tensorrt_the_backend_says_what_to_install(tiny_artifacts):
    from k2deploy.core.manifest import load_manifest

    manifest = load_manifest(tiny_artifacts["fp8"])
    with pytest.raises(K2Error, match="pip install tensorrt"):
        load_backend(manifest, resolve_engine_config(manifest, argparse.Namespace(backend="tensorrt")))


def test_the_onnxruntime_backend_is_the_default_one(tiny_artifacts):
    pytest.importorskip("onnxruntime")
    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.backends.onnx.model import OrtModel

    manifest = load_manifest(tiny_artifacts["fp8"])
    model = load_backend(manifest, resolve_engine_config(manifest, argparse.Namespace(provider="cpu", threads=1)))
    assert isinstance(model, OrtModel)
    with pytest.raises(K2Error, match="unknown backend"):
        load_backend(manifest, resolve_engine_config(manifest, argparse.Namespace(backend="tvm")))


def test_engines_build_and_match_onnxruntime(tiny_artifacts, tmp_path):
    """Runs only where TensorRT and a GPU are: builds the tiny artifact's engines and compares logits."""
    try:
        require_tensorrt()
    except K2Error as exc:
        pytest.skip(str(exc))
    import shutil

    import numpy as np

    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.engine.generator import Generator
    from k2deploy.export.tensorrt_engines import build_engines

    artifact = shutil.copytree(tiny_artifacts["fp8"], tmp_path / "art")
    record = build_engines(artifact, max_batch=2, max_seq=64, workspace_gb=2)
    assert set(record["engines"]) == {"embed", "layer_000", "layer_001", "layer_002", "head"}
    manifest = load_manifest(artifact)
    prompt = [1, 5, 9, 200, 7]
    reference = Generator(load_backend(manifest, resolve_engine_config(manifest))).score(prompt)
    on_tensorrt = resolve_engine_config(manifest, argparse.Namespace(backend="tensorrt"))
    logits = Generator(load_backend(manifest, on_tensorrt)).score(prompt)
    np.testing.assert_allclose(logits, reference, atol=2e-2)


class FakeCuda:
    """Device memory as one bytearray: enough to check the device cache's address arithmetic here."""

    def __init__(self):
        self.memory = bytearray(1)  # address 0 stays unused

    def malloc(self, nbytes):
        address = len(self.memory)
        self.memory.extend(bytes(max(int(nbytes), 1)))
        return address

    def memset(self, pointer, nbytes, stream):
        self.memory[pointer:pointer + nbytes] = bytes(nbytes)

    def copy_2d(self, dst, dst_pitch, src, src_pitch, width, height, stream):
        for i in range(height):
            self.memory[dst + i * dst_pitch:dst + i * dst_pitch + width] = \
                self.memory[src + i * src_pitch:src + i * src_pitch + width]

    def free(self, pointer):
        pass

    def device_synchronize(self):
        pass

    def to_device(self, pointer, array, stream):
        self.memory[pointer:pointer + array.nbytes] = array.tobytes()


CACHE_SPEC = {"format": "fp8", "latent_dim": 8, "rope_dim": 4, "latent_scale_group": 4, "page_size": 64}
ARRAYS = ("latent", "rope", "latent_scale")


def test_the_device_pages_store_entries_where_the_host_pages_do():
    """Ragged prefills and decode runs with gaps, across page boundaries, for rows whose page tables are out of
    order: each entry lands in the same page and offset on the device as on the host."""
    import numpy as np
    pytest.importorskip("onnxruntime")

    cuda, device, host = _device_and_host_pages(layers=2, pages=6)
    table = np.array([[4, 1], [0, 5], [3, 2]])  # rows' pages in position order
    rng = np.random.default_rng(0)
    for layer, (positions, valid) in enumerate([
        (np.broadcast_to(np.arange(60, 64 + 6), (3, 10)), np.arange(10)[None] < np.array([[10], [2], [7]])),
        (np.array([[62, 63, 64, 66], [2, 3, 9, 9], [63, 64, 65, 70]]),
         np.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1]], dtype=bool)),
    ]):
        _store([host.view(table), device.view(table)], layer, positions, valid,
               _random_entries(rng, 3, positions.shape[1]))
    for name in ARRAYS:
        array = host.arrays[name]
        assert array.any(), name
        np.testing.assert_array_equal(_read_pages(cuda, device, name, array), array, err_msg=name)


def test_device_views_bind_each_layers_pool_and_the_page_table():
    import numpy as np
    pytest.importorskip("onnxruntime")

    cuda, device, host = _device_and_host_pages(layers=2, pages=3)
    table = np.array([[2, 0], [1, 0]])
    view = device.view(table)
    from k2deploy.core.cache_format import PAGE_SIZE

    view.new_entries(np.array([[PAGE_SIZE, PAGE_SIZE + 1], [3, 4]]))  # pasts of one page at most: one column
    for layer in range(2):
        inputs = view.past_inputs(layer)
        shape, address = inputs["page_table"]
        assert shape == (2, 1)
        np.testing.assert_array_equal(_read(cuda, address, table[:, :1]), table[:, :1])
        for name in ARRAYS:
            shape, address = inputs[f"{name}_pages"]
            assert shape == host.arrays[name][layer].shape
            assert address == device.layer_address(name, layer)
            assert (address - device.layer_address(name, 0)) % 256 == 0  # each layer's pool 256-byte aligned


def _device_and_host_pages(layers, pages):
    """DevicePages on FakeCuda and LatentPages of the same pool."""
    from k2deploy.runtime.backends.onnx.host_pages import LatentPages
    from k2deploy.runtime.backends.tensorrt.device_cache import DevicePages

    cuda = FakeCuda()
    return cuda, DevicePages(CACHE_SPEC, layers, pages, cuda, stream=None), LatentPages(CACHE_SPEC, layers, pages)


def _random_entries(rng, b, s):
    import numpy as np

    return {"latent": rng.integers(0, 255, (b, s, 8), dtype=np.uint8),
            "rope": rng.standard_normal((b, s, 4)).astype(np.float16),
            "latent_scale": rng.random((b, s, 2)).astype(np.float32)}


def _store(views, layer, positions, valid, entries):
    """A layer's new entries [b, s, width] written where a host view and a device view give their layers'
    outputs, then stored by each view."""
    host_view, device_view = views
    host_view.new_entries(positions)
    addresses = device_view.new_entries(positions)
    cuda = device_view.pages.cuda
    for name, array in entries.items():
        host_view.entries[name][:] = array
        address = addresses[f"new_{name}"]
        cuda.memory[address:address + array.nbytes] = array.tobytes()
    for view in views:
        view.store(layer, positions, valid)


def _read(cuda, address, like):
    import numpy as np

    return np.frombuffer(bytes(cuda.memory[address:address + like.nbytes]), dtype=like.dtype).reshape(like.shape)


def _read_pages(cuda, device, name, like):
    """A device pool array as the host's [layers, pages, PAGE_SIZE, ...]: each layer's pool at its own address."""
    import numpy as np

    return np.stack([_read(cuda, device.layer_address(name, layer), like[layer]) for layer in range(len(like))])


@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is installed here")
@pytest.mark.parametrize("command", ["serve", "generate", "score", "bench"])
def test_without_tensorrt_each_runtime_command_says_what_to_install(tiny_artifacts, command):
    from cli_runner import run_cli

    extra = {"generate": ["--prompt", "hi"], "score": ["--prompt-ids", "1,2", "--out", "unused.npy"]}.get(command, [])
    done = run_cli(command, tiny_artifacts["fp8"], "--backend", "tensorrt", *extra)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [f"k2deploy {command}: error: {INSTALL_HINT}"]


def test_an_engine_whose_inputs_differ_from_the_graph_is_refused_on_load():
    from types import SimpleNamespace

    from k2deploy.runtime.backends.tensorrt.backend import check_engine_io

    trt = SimpleNamespace(float32="f32", fp8="fp8", bfloat16="bf16", int64="i64")
    graph = {"inputs": [{"name": "hidden", "dtype": "FLOAT"}, {"name": "past_latent", "dtype": "FLOAT8E4M3FN"}],
             "outputs": [{"name": "hidden_out", "dtype": "FLOAT"}]}

    class Engine:
        def __init__(self, io):
            self.io, self.num_io_tensors = io, len(io)

        def get_tensor_name(self, index):
            return list(self.io)[index]

        def get_tensor_dtype(self, name):
            return self.io[name]

    check_engine_io(trt, Engine({"hidden": "f32", "past_latent": "fp8", "hidden_out": "f32"}), "layer_000", graph, "ART")
    with pytest.raises(K2Error, match="engine layer_000 does not match the artifact's graph \\(extra_input extra; "
                                      "past_latent is bf16, expected FLOAT8E4M3FN\\); rebuild with `k2deploy "
                                      "build-engines ART`"):
        check_engine_io(trt, Engine({"hidden": "f32", "past_latent": "bf16", "hidden_out": "f32", "extra_input": "f32"}),
                        "layer_000", graph, "ART")
