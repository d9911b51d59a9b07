import os

import pytest

from k2deploy.core.checkpoint.presets import SHARD_BYTES, preset_config
from k2deploy.core.checkpoint.synthetic import write_checkpoint



def _cuda_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a CUDA GPU the Triton kernels run in Triton's interpreter (tests/test_triton_kernels.py). Triton
# fixes the mode when it is first imported, so it is chosen here, before any test module imports it.
if not _cuda_gpu():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session", autouse=True)
def own_native_cache(tmp_path_factory):
    """The native step's builds and its `auto` choices (choices.json) in a folder of this test session's, for this
    process and every command it starts: no run reads what another run (or a user's own use) built or measured."""
    folder = tmp_path_factory.mktemp("native-cache")
    saved = os.environ.get("K2DEPLOY_NATIVE_CACHE")
    os.environ["K2DEPLOY_NATIVE_CACHE"] = str(folder)
    yield folder
    if saved is None:
        os.environ.pop("K2DEPLOY_NATIVE_CACHE", None)
    else:
        os.environ["K2DEPLOY_NATIVE_CACHE"] = saved


@pytest.fixture(scope="session", autouse=True)
def one_thread_pool():
    """The test process runs every model on one intra-op pool of one thread (a process has one pool, sized once):
    tests that ask for threads=1 get it whatever ran first, and a loaded CI machine is not oversubscribed."""
    pytest.importorskip("onnxruntime")
    from k2deploy.runtime.backends.onnx.thread_pool import process_threads

    return process_threads(1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny synthetic checkpoint, written once per test session; tests must not modify it."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    return write_checkpoint(path, preset_config("tiny"), seed=0, shard_bytes=SHARD_BYTES["tiny"])


@pytest.fixture
def tiny_copy(tiny_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    import shutil

    return shutil.copytree(tiny_checkpoint, tmp_path / "tiny")


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint exported once with each cache format: {"fp8": path, "bf16": path}."""
    pytest.importorskip("torch")
    from k2deploy.export.exporter import ExportOptions, export_artifact

    root = tmp_path_factory.mktemp("artifacts")
    return {cache: export_artifact(ExportOptions(str(tiny_checkpoint), kv_cache=cache, target="cuda"), root / cache) and root / cache
            for cache in ("fp8", "bf16")}


@pytest.fixture(scope="session")
def tiny_reference(tiny_checkpoint):
    pytest.importorskip("torch")
    from k2deploy.core.checkpoint.reader import Checkpoint
    from k2deploy.export.weights import load_transformer

    return load_transformer(Checkpoint.open(tiny_checkpoint))


@pytest.fixture(scope="session")
def tiny_cpu_artifact(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint exported for --target cpu (int8 weights, int8 latent cache)."""
    pytest.importorskip("torch")
    from k2deploy.export.exporter import ExportOptions, export_artifact

    out = tmp_path_factory.mktemp("artifacts") / "cpu"
    export_artifact(ExportOptions(str(tiny_checkpoint), target="cpu"), out)
    return out


@pytest.fixture(scope="session")
def tiny_int4_cpu_artifact(tmp_path_factory):
    """The tiny preset in Kimi-K2-Thinking's INT4 layout, exported for --target cpu (its routed experts as the
    checkpoint's own 4-bit codes, the rest int8)."""
    pytest.importorskip("torch")
    from k2deploy.export.exporter import ExportOptions, export_artifact

    checkpoint = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-int4", preset_config("tiny", weights="int4"),
                                  seed=0, shard_bytes=SHARD_BYTES["tiny"])
    out = tmp_path_factory.mktemp("artifacts") / "cpu-int4"
    export_artifact(ExportOptions(str(checkpoint), target="cpu"), out)
    return out


def pytest_collection_modifyitems(items):
    """The tiers (pyproject.toml's markers): `server` for a test whose module starts `k2deploy serve` (it uses
    tests/serving.py's Server), `ray` for one that takes the Ray cluster fixture."""
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and getattr(module, "Server", None) is not None:
            item.add_marker(pytest.mark.server)
        if "ray_address" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
