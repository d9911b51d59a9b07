import pytest

from k2deploy.checkpoint.presets import SHARD_BYTES, preset_config
from k2deploy.checkpoint.synthetic import write_checkpoint


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
