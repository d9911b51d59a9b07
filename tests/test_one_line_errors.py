"""What goes wrong around a command is one line on stderr, exit code 2, and no traceback, as docs/cli.md says."""

import errno
import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from cli_runner import run_cli
from k2deploy.commands.command import run_command
from k2deploy.commands.output_paths import write_output_file
from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import MANIFEST_FILE, file_record


def _one_line(result, message):
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def _artifact_copy(tiny_artifacts, tmp_path):
    return shutil.copytree(tiny_artifacts["fp8"], tmp_path / "art")


def _rewrite_manifest(art, edit):
    data = json.loads((art / MANIFEST_FILE).read_text())
    edit(data)
    (art / MANIFEST_FILE).write_text(json.dumps(data))


def test_score_into_a_missing_folder_is_refused_before_the_model_runs(tiny_artifacts, tmp_path):
    _one_line(run_cli("score", tiny_artifacts["fp8"], "--prompt-ids", "1,2", "--out", tmp_path / "nowhere" / "x.npy"),
              "does not exist; create it first")


def _under_a_file(tmp_path):
    (tmp_path / "a-file").write_text("")
    return tmp_path / "a-file" / "out"


OUTPUT_PROBLEMS = {  # a path the command cannot write: (the path, what the error says)
    "name too long": (lambda tmp_path: tmp_path / ("x" * 300), "choose a shorter name"),
    "under a file": (_under_a_file, "is not a folder"),
    "no new files there": (lambda tmp_path: Path("/proc/k2deploy-out"), "cannot create files in /proc"),
}
OUTPUT_COMMANDS = {  # each command's output path, refused before the command reads anything else
    "score": lambda tmp_path, out: ["score", tmp_path, "--prompt-ids", "1,2", "--out", out],
    "make-checkpoint": lambda tmp_path, out: ["make-checkpoint", out],
    "bench": lambda tmp_path, out: ["bench", tmp_path, "--out", out],
    "bench compare": lambda tmp_path, out: ["bench", "compare", tmp_path, "--out", out],
    "export": lambda tmp_path, out: ["export", tmp_path, "--out", out],
    "quickstart": lambda tmp_path, out: ["quickstart", "--out", out],
}


@pytest.mark.parametrize("command, problem", [*((c, p) for c in ("score", "make-checkpoint") for p in OUTPUT_PROBLEMS),
                                              *((c, "name too long") for c in ("bench", "bench compare", "export",
                                                                               "quickstart"))])
def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path, command, problem):
    if problem == "no new files there" and not Path("/proc/self").exists():
        pytest.skip("needs Linux's /proc")
    path, message = OUTPUT_PROBLEMS[problem]
    out = path(tmp_path)
    result = run_cli(*OUTPUT_COMMANDS[command](tmp_path, out))
    _one_line(result, message)
    assert str(out) in result.stderr


def test_an_output_file_ends_whole_or_untouched(tmp_path):
    out = tmp_path / "logits.npy"
    out.write_bytes(b"before")

    def fail_halfway(file):
        file.write(b"half")
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(K2Error, match=f"--out {out}: cannot write it \\(Input/output error\\); choose another path"):
        write_output_file(out, fail_halfway, "--out")
    assert out.read_bytes() == b"before" and os.listdir(tmp_path) == ["logits.npy"]
    write_output_file(out, lambda file: file.write(b"after"), "--out")
    assert out.read_bytes() == b"after" and os.listdir(tmp_path) == ["logits.npy"]


def test_output_closed_early_is_one_line(tiny_artifacts):
    child = subprocess.Popen([sys.executable, "-m", "k2deploy", "inspect", str(tiny_artifacts["fp8"]), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()  # like `| head` that has read enough
    stderr = child.stderr.read()
    child.wait(timeout=120)
    _one_line(namedtuple("Result", "returncode stderr")(child.returncode, stderr), "broken pipe")


def test_a_corrupt_export_journal_is_one_line(tiny_checkpoint, tmp_path):
    out = tmp_path / "art"
    out.mkdir()
    (out / ".export-journal.json").write_text("{not json")
    _one_line(run_cli("export", tiny_checkpoint, "--out", out), "the export journal is corrupt")


def test_inspect_on_an_unfinished_export_says_to_resume(tmp_path):
    (tmp_path / ".export-journal.json").write_text(json.dumps({"options": {}, "done": {}}))
    _one_line(run_cli("inspect", tmp_path), "unfinished export, rerun export to resume")


def test_a_chat_template_error_is_one_line(tiny_artifacts, tmp_path):
    art = _artifact_copy(tiny_artifacts, tmp_path)
    config_file = art / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{{ messages[0]['content'] + no_such_helper() }}"
    config_file.write_text(json.dumps(config))
    _rewrite_manifest(art, lambda d: d["files"].update({"tokenizer/tokenizer_config.json":
                                                       file_record(art, "tokenizer/tokenizer_config.json")}))
    _one_line(run_cli("generate", art, "--prompt", "hi", "--chat"), "the chat template cannot render these messages")


def test_an_explicit_eager_baseline_without_its_checkpoint_is_an_error(tiny_artifacts, tmp_path):
    art = _artifact_copy(tiny_artifacts, tmp_path)
    _rewrite_manifest(art, lambda d: d["checkpoint"].update(path=str(tmp_path / "gone")))
    _one_line(run_cli("bench", art, "--baseline", "eager", "--batch", "1", "--prompt-len", "4", "--gen-len", "2",
                      "--repeats", "1", "--out", tmp_path / "bench"), "--baseline eager: the checkpoint")


def test_an_unknown_set_key_names_the_closest_field(tmp_path):
    _one_line(run_cli("make-checkpoint", tmp_path / "c", "--preset", "tiny", "--set", "n_routed_expert=8"),
              "the config has no field 'n_routed_expert'; did you mean n_routed_experts?")


def test_partial_folders_of_killed_runs_are_removed(tmp_path):
    stale = tmp_path / ".c.partial-999999999"  # no such process
    stale.mkdir()
    made = run_cli("make-checkpoint", tmp_path / "c", "--preset", "tiny")
    assert made.returncode == 0, made.stderr
    assert not stale.exists() and (tmp_path / "c" / "config.json").exists()


def test_non_finite_logits_stop_sampling():
    from k2deploy.runtime.engine.sampling import SamplingParams, sample

    with pytest.raises(K2Error, match="non-finite logits"):
        sample(np.array([0.1, np.nan, 0.3], dtype=np.float32), SamplingParams(), np.random.default_rng(0))


def test_a_full_disk_is_one_line(capsys):
    def fill():
        raise OSError(errno.ENOSPC, "No space left on device", "ART/graphs/layer_003.data")

    assert run_command("export", fill) == 2
    err = capsys.readouterr().err
    assert "no space left on the device writing ART/graphs/layer_003.data" in err and "resumes" in err


def test_export_checks_free_space_first(tiny_checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from k2deploy.export import exporter

    monkeypatch.setattr(exporter.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(K2Error, match=r"1.00 kB free, the export needs about \d+\.\d\d MB more"):  # not "0.0 GB"
        exporter.export_artifact(exporter.ExportOptions(str(tiny_checkpoint), target="cpu"), tmp_path / "art")
    assert not (tmp_path / "art" / "graphs" / "embed.onnx").exists()
