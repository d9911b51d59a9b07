"""A Kimi-layout checkpoint written by other tools (torch + safetensors, Kimi's shard naming)."""

import json

import pytest

from cli_runner import run_cli
from k2deploy.core.checkpoint import layout
from k2deploy.core.checkpoint.presets import preset_config
from k2deploy.core.sizes import count_parameters

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F32": torch.float32}


def _write_foreign(directory, config):
    """Two shards named as Kimi names them, tensors in another order, torch's own writer."""
    directory.mkdir()
    specs = layout.all_tensors(config)[::-1]
    halves = [specs[: len(specs) // 2], specs[len(specs) // 2:]]
    weight_map = {}
    for number, half in enumerate(halves, start=1):
        shard = f"model-{number}-of-2.safetensors"
        tensors = {s.name: torch.randn(s.shape).to(TORCH_DTYPES[s.dtype]) for s in half}
        safetensors_torch.save_file(tensors, directory / shard, metadata={"format": "pt"})
        weight_map.update({s.name: shard for s in half})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = config.to_dict()
    raw["some_future_field"] = {"kept": True}
    (directory / "config.json").write_text(json.dumps(raw))


def test_inspect_reads_a_checkpoint_this_project_did_not_write(tmp_path):
    config = preset_config("tiny")
    _write_foreign(tmp_path / "foreign", config)
    result = run_cli("inspect", tmp_path / "foreign", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    formula = count_parameters(config)
    assert info["parameters"] == {"total": formula.total, "active_per_token": formula.active_per_token}
    assert info["bytes"]["shards"] == 2
