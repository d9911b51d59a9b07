"""The runtime path runs on a machine where `import torch` (and onnx, onnxscript) fails."""

import json

import pytest

from child_env import blocked, child_env
from cli_runner import run_cli


def _env_without_torch(tmp_path):
    """torch, onnx and onnxscript raise on import."""
    return child_env(blocked(tmp_path, "torch", "onnx", "onnxscript"))


@pytest.mark.slow
def test_generate_score_and_inspect_import_no_torch(tiny_artifacts, tmp_path):
    env = _env_without_torch(tmp_path)
    art = tiny_artifacts["fp8"]
    check = run_cli("make-checkpoint", tmp_path / "c", env=env)  # the core needs no torch either
    assert check.returncode == 0, check.stderr
    generated = run_cli("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json", env=env)
    assert generated.returncode == 0, generated.stderr
    result = json.loads(generated.stdout)
    assert len(result["token_ids"]) == 4 and result["ttft_ms"] > 0 and isinstance(result["text"], str)
    text = run_cli("generate", art, "--prompt", "hello there", "--chat", "--max-new-tokens", "3", "--json", env=env)
    assert text.returncode == 0, text.stderr
    for ray in ([], ["--ray", "auto"]):  # stages in this process, then on Ray actors started from this environment
        placed = run_cli("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json",
                         "--placement", "0:1@cpu,1:3@cpu", *ray, env=env)
        assert placed.returncode == 0, placed.stderr
        assert json.loads(placed.stdout)["token_ids"] == result["token_ids"]
    scored = run_cli("score", art, "--prompt-ids", "1,2,3", "--out", tmp_path / "logits.npy", env=env)
    assert scored.returncode == 0, scored.stderr
    assert run_cli("inspect", art, env=env).returncode == 0
    # and the blocker does block: the export side fails without torch
    refused = run_cli("export", tmp_path / "c", "--out", tmp_path / "a", env=env)
    assert refused.returncode == 2 and "pip install 'k2deploy[export]'" in refused.stderr
    assert "is not installed on this serving host" in refused.stderr and "Traceback" not in refused.stderr


def test_score_writes_the_logits_of_every_position(tiny_artifacts, tmp_path):
    import numpy as np

    result = run_cli("score", tiny_artifacts["bf16"], "--prompt-ids", "5,17,300,42", "--out", tmp_path / "l.npy", "--json")
    assert result.returncode == 0, result.stderr
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (4, 1024) and logits.dtype == np.float32


def test_generate_rejects_bad_input_in_one_line(tiny_artifacts):
    for args, message in [
        (["--prompt-ids", "1,x"], "expected comma-separated integers"),
        (["--prompt-ids", "5000"], "outside the vocabulary"),
        (["--prompt-ids", "1", "--top-p", "0"], "top_p must lie in (0, 1]"),
        (["--prompt-ids", "1", "--max-new-tokens", "5000"], "exceeds the context"),
    ]:
        result = run_cli("generate", tiny_artifacts["fp8"], *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    missing = run_cli("generate", "/nonexistent/art", "--prompt-ids", "1")
    assert missing.returncode == 2 and "not an artifact directory" in missing.stderr
