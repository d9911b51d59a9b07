import json
import os
import signal
import subprocess
import sys

import pytest

from cli_runner import run_cli
from k2deploy.core.checkpoint.presets import preset_config
from k2deploy.core.sizes import count_parameters


def test_make_checkpoint_then_inspect_json(tmp_path):
    out = tmp_path / "tiny"
    made = run_cli("make-checkpoint", out, "--preset", "tiny", "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["path"] == str(out)
    inspected = run_cli("inspect", out, "--json")
    assert inspected.returncode == 0, inspected.stderr
    info = json.loads(inspected.stdout)
    formula = count_parameters(preset_config("tiny"))
    assert info["parameters"] == {"total": formula.total, "active_per_token": formula.active_per_token}
    assert info["kv_cache_bytes_per_token_per_layer"]["fp8_latent"] == 64 + 4 + 16 * 2
    assert [row["kind"] for row in info["bytes"]["per_layer"]] == ["dense", "moe", "moe"]
    text = run_cli("inspect", out)
    assert "active per token" in text.stdout and "fp8_latent 100" in text.stdout


def test_make_checkpoint_layers_seed_and_set(tmp_path):
    out = tmp_path / "c"
    made = run_cli("make-checkpoint", out, "--layers", "2", "--seed", "3", "--set", "n_routed_experts=8", "--json")
    assert made.returncode == 0, made.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["n_routed_experts"]) == (2, 8)
    again = run_cli("make-checkpoint", out)
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr
    assert run_cli("make-checkpoint", out, "--force", "--json").returncode == 0


def test_an_invalid_override_leaves_nothing_behind(tmp_path):
    result = run_cli("make-checkpoint", tmp_path / "c", "--set", "num_experts_per_tok=99")
    assert result.returncode == 2 and "num_experts_per_tok" in result.stderr
    assert os.listdir(tmp_path) == []


# make-checkpoint in a child that waits, once its first bytes are on disk, for the signal the test sends (Ctrl-C
# as a terminal delivers it): the signal lands mid-write however fast the machine
WRITES_THEN_WAITS = """
import signal, sys
from k2deploy.commands.cli import main
from k2deploy.core.checkpoint import synthetic

def write_then_wait(f, chunk, write=synthetic.write_array):
    write(f, chunk)
    f.flush()
    print("writing", flush=True)
    signal.pause()

synthetic.write_array = write_then_wait
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sent, code, said", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                              (signal.SIGINT, 130, "interrupted")])
def test_a_signal_mid_write_removes_the_partial_folder(tmp_path, sent, code, said):
    child = subprocess.Popen([sys.executable, "-c", WRITES_THEN_WAITS, "make-checkpoint", tmp_path / "c"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "writing\n"
        assert [p.name for p in tmp_path.iterdir()] == [f".c.partial-{child.pid}"]
        child.send_signal(sent)
        _, err = child.communicate(timeout=600)
    finally:
        child.kill()  # a child a failed assertion left waiting; nothing once it has exited
    assert child.returncode == code and err.strip() == f"k2deploy make-checkpoint: {said}", err
    assert os.listdir(tmp_path) == []


def test_partial_folders_of_killed_writers_beside_the_output_are_removed(tmp_path):
    """Those of any output name whose process is gone; not a running writer's, nor folders named otherwise."""
    stale = [tmp_path / ".other.partial-999999998", tmp_path / ".c.partial-999999999"]  # no such processes
    for folder in stale:
        folder.mkdir()
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"half")
    kept = [tmp_path / f".running.partial-{os.getpid()}", tmp_path / ".notes.partial-draft", tmp_path / "x.partial-1"]
    for folder in kept:
        folder.mkdir()
    made = run_cli("make-checkpoint", tmp_path / "c")
    assert made.returncode == 0, made.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["c", *(folder.name for folder in kept)])


def test_a_checkpoint_larger_than_the_disk_is_refused_before_anything_is_written(tmp_path):
    result = run_cli("make-checkpoint", tmp_path / "c", "--preset", "k2", "--layers", "1024")  # 17.5 TB
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "free, the checkpoint needs 17.46 TB; write it where there is room" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", [[], ["make-checkpoint"], ["inspect"]])
def test_help(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0 and "usage: k2deploy" in result.stdout


def _damage(directory, how):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = directory / index["weight_map"]["model.layers.1.self_attn.o_proj.weight"]
    if how == "missing shard":
        shard.unlink()
    elif how == "truncated shard":
        os.truncate(shard, shard.stat().st_size // 2)
    elif how == "wrong shape":
        config = json.loads((directory / "config.json").read_text())
        config["moe_intermediate_size"] = 80
        (directory / "config.json").write_text(json.dumps(config))
    elif how == "unknown model_type":
        config = json.loads((directory / "config.json").read_text())
        config["model_type"] = "mixtral"
        (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing shard", "is missing from"),
        ("truncated shard", "is truncated"),
        ("wrong shape", "has shape"),
        ("unknown model_type", "unsupported model_type 'mixtral'"),
    ],
)
def test_bad_checkpoints_give_one_line_and_a_non_zero_exit(tiny_copy, how, message):
    result = run_cli("inspect", _damage(tiny_copy, how))
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_a_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "f.json").write_text("{}")
    result = run_cli("inspect", tmp_path / "f.json")
    assert result.returncode == 2 and "not a directory" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
