"""Hostile or broken input, second round: JSON nested past any sane depth wherever JSON is read, config values
out of range or not finite, non-finite sampling options. Each is one line on stderr, exit 2, no traceback, refused
before any work or memory proportional to it."""

import json
import struct

import numpy as np
import pytest

from cli_runner import run_cli
from k2deploy.core.checkpoint.presets import preset_config
from k2deploy.core.config import ModelConfig
from k2deploy.core.errors import K2Error
from k2deploy.core.json_files import loads
from k2deploy.core.manifest import file_record

DEEP = 100_000  # past Python's recursion limit: json.loads itself fails
NESTED = 100  # within it, past the bound


def _nested(depth: int) -> str:
    return '{"x": ' + "[" * depth + "]" * depth + "}"


def _one_line(result, message):
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("depth", [NESTED, DEEP])
def test_json_past_the_depth_bound_is_refused_as_garbled_json(depth):
    with pytest.raises(json.JSONDecodeError, match="nested deeper than 64 levels"):
        loads(_nested(depth))
    assert loads(_nested(60)) == json.loads(_nested(60))


@pytest.mark.parametrize("name, message", [("config.json", "nested deeper than 64 levels"),
                                           ("model.safetensors.index.json", "not a valid index")])
def test_deeply_nested_checkpoint_json_is_one_line(tiny_copy, name, message):
    (tiny_copy / name).write_text(_nested(DEEP))
    _one_line(run_cli("inspect", tiny_copy), message)


def test_a_shard_header_nested_deep_is_one_line(tiny_copy):
    shard = sorted(tiny_copy.glob("*.safetensors"))[0]
    header = _nested(DEEP).encode()
    shard.write_bytes(struct.pack("<Q", len(header)) + header)
    _one_line(run_cli("inspect", tiny_copy), f"shard {shard.name} has a garbled header")


def test_deeply_nested_manifest_and_tokenizer_config_are_one_line(tiny_cpu_artifact, tmp_path):
    import shutil

    art = shutil.copytree(tiny_cpu_artifact, tmp_path / "art")
    config = art / "tokenizer" / "tokenizer_config.json"
    config.write_text(_nested(DEEP))
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"]["tokenizer/tokenizer_config.json"] = file_record(art, "tokenizer/tokenizer_config.json")
    (art / "manifest.json").write_text(json.dumps(manifest))
    _one_line(run_cli("generate", art, "--prompt", "hi", "--max-new-tokens", "1"), "nested deeper than 64 levels")
    (art / "manifest.json").write_text(_nested(DEEP))
    _one_line(run_cli("generate", art, "--prompt-ids", "1,2", "--max-new-tokens", "1"), "nested deeper than 64 levels")


def test_a_deeply_nested_tools_file_is_one_line(tiny_cpu_artifact, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text("[" + _nested(DEEP) + "]")
    _one_line(run_cli("generate", tiny_cpu_artifact, "--prompt", "hi", "--chat", "--tools", tools,
                      "--max-new-tokens", "1"), "nested deeper than 64 levels")


def _config(**changes) -> dict:
    raw = preset_config("tiny").to_dict()
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 100_000}, "'num_hidden_layers' must lie in [1, 1,024], got 100,000"),
    ({"num_hidden_layers": 10**12}, "'num_hidden_layers' must lie in [1, 1,024]"),
    ({"vocab_size": 10**9}, "'vocab_size' must lie in [1, 4,194,304]"),
    ({"num_attention_heads": 10**6, "num_key_value_heads": 10**6}, "'num_attention_heads' must lie in"),
    ({"max_position_embeddings": 10**12}, "'max_position_embeddings' must lie in"),
    ({"rope_theta": float("nan")}, "'rope_theta' must be a finite positive number, got nan"),
    ({"rope_theta": -1}, "'rope_theta' must be a finite positive number, got -1"),
    ({"routed_scaling_factor": float("nan")}, "'routed_scaling_factor' must be a finite positive number"),
    ({"rms_norm_eps": float("inf")}, "'rms_norm_eps' must be a finite positive number"),
    ({"rope_scaling": {"type": "yarn", "factor": float("nan"), "original_max_position_embeddings": 4096}},
     "'rope_scaling' factor is nan"),
    ({"rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": -5}},
     "original_max_position_embeddings must be a positive integer"),
])
def test_config_values_out_of_range_are_refused(changes, message):
    with pytest.raises(K2Error) as refused:
        ModelConfig.from_dict(_config(**changes))
    assert message in str(refused.value)


def test_a_checkpoint_claiming_a_trillion_layers_is_refused_at_once(tiny_copy):
    raw = json.loads((tiny_copy / "config.json").read_text())
    raw["num_hidden_layers"] = 10**12
    (tiny_copy / "config.json").write_text(json.dumps(raw))
    _one_line(run_cli("inspect", tiny_copy), "'num_hidden_layers' must lie in [1, 1,024]")


def test_make_checkpoint_with_too_many_layers_is_refused_before_writing(tmp_path):
    _one_line(run_cli("make-checkpoint", tmp_path / "out", "--preset", "tiny", "--layers", "100000"),
              "'num_hidden_layers' must lie in [1, 1,024]")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", [["--temperature", "nan"], ["--temperature", "inf"], ["--top-p", "nan"]])
def test_non_finite_sampling_options_are_one_line(tiny_cpu_artifact, option):
    _one_line(run_cli("generate", tiny_cpu_artifact, "--prompt-ids", "1,2", "--max-new-tokens", "2", *option),
              "must")


def test_score_into_a_folder_is_refused_and_a_file_is_written_by_its_own_name(tiny_cpu_artifact, tmp_path):
    _one_line(run_cli("score", tiny_cpu_artifact, "--prompt-ids", "1,2", "--out", tmp_path), "is a folder")
    out = tmp_path / "logits"
    result = run_cli("score", tiny_cpu_artifact, "--prompt-ids", "1,2,3", "--out", out)
    assert result.returncode == 0 and f"wrote {out}:" in result.stdout, result.stderr
    assert np.load(out).shape[0] == 3 and not (tmp_path / "logits.npy").exists()


def test_an_empty_layer_range_is_called_empty(tiny_checkpoint, tmp_path):
    _one_line(run_cli("export", tiny_checkpoint, "--out", tmp_path / "art", "--layers", "2:1"),
              "--layers 2:1 is empty")


def test_an_empty_checkpoint_or_output_path_is_refused_and_nothing_is_written(tiny_checkpoint, tmp_path, monkeypatch):
    """"" is not the working folder: `export "" --out art` names the empty checkpoint path, `export CKPT --out ""`
    the empty --out, and neither writes a file where it runs."""
    monkeypatch.chdir(tmp_path)
    _one_line(run_cli("export", "", "--out", tmp_path / "art"), "the checkpoint path is empty")
    _one_line(run_cli("export", tiny_checkpoint, "--out", ""), "--out is empty")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, message", [(["--max-batch", "100000"], "is more than this server runs at once"),
                                             (["--body-timeout", "0"], "--body-timeout must be more than 0"),
                                             (["--drain-timeout", "nan"], "--drain-timeout must be at least 0"),
                                             (["--drain-timeout", "inf"], "--drain-timeout must be at most 604800"),
                                             (["--drain-timeout", "1e12"], "--drain-timeout must be at most"),
                                             (["--header-timeout", "inf"], "--header-timeout must be at most"),
                                             (["--allow-origin", "evil"], "is not an origin")])
def test_serve_options_out_of_range_are_one_line_before_loading(tiny_cpu_artifact, option, message):
    _one_line(run_cli("serve", tiny_cpu_artifact, "--port", "0", *option), message)


@pytest.mark.parametrize("option, message", [(["--logit-bias", "x"], "expected TOKEN_ID=BIAS"),
                                             (["--logit-bias", "99999=1"], "outside the vocabulary"),
                                             (["--logit-bias", "5=101"], "[-100, 100]"),
                                             (["--min-p", "2"], "min_p must lie in [0, 1]"),
                                             (["--presence-penalty", "9"], "presence_penalty must lie in [-2, 2]"),
                                             (["--seed", str(10**23)], "seed must fit in a signed 64-bit integer"),
                                             (["--seed", str(-2**63 - 1)], "seed must fit")])
def test_generate_sampling_options_out_of_range_are_one_line(tiny_cpu_artifact, option, message):
    _one_line(run_cli("generate", tiny_cpu_artifact, "--prompt-ids", "1,2", "--max-new-tokens", "2", *option),
              message)


@pytest.mark.parametrize("ids", ["1,,2", ",1", "1, ,2"])
def test_prompt_ids_with_an_empty_id_are_refused(tiny_cpu_artifact, ids):
    _one_line(run_cli("generate", tiny_cpu_artifact, "--prompt-ids", ids, "--max-new-tokens", "1"),
              "expected comma-separated integers")


@pytest.mark.parametrize("value", ["OFF", "Off", " off "])
def test_core_leases_off_in_any_case_makes_no_folder(tmp_path, monkeypatch, value):
    from k2deploy.runtime.backends.native.core_leases import LEASES_VARIABLE, lease_folder

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(LEASES_VARIABLE, value)
    assert lease_folder() is None and list(tmp_path.iterdir()) == []


def test_core_leases_in_a_relative_folder_are_refused_and_no_folder_is_made(tmp_path, monkeypatch):
    from k2deploy.runtime.backends.native.core_leases import LEASES_VARIABLE, lease_folder

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(LEASES_VARIABLE, "leases")
    with pytest.raises(K2Error, match="give an absolute folder"):
        lease_folder()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(LEASES_VARIABLE, str(tmp_path / "leases"))
    assert lease_folder() == tmp_path / "leases"
