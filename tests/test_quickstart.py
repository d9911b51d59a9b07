"""The README's main job: `k2deploy quickstart` makes, exports, checks parity and generates."""

import json

import pytest

from cli_runner import run_cli

pytestmark = pytest.mark.slow  # the whole quickstart

pytest.importorskip("torch")


def test_quickstart_runs_the_whole_pipeline_and_holds_parity(tmp_path):
    result = run_cli("quickstart", "--out", tmp_path, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"]
    assert [row["step"] for row in report["steps"]] == [
        "make-checkpoint tiny (fp8)", "make-checkpoint tiny (int4)", "export (bf16 cache)", "parity (bf16 cache)",
        "export (fp8 cache)", "parity (fp8 cache)", "export (cpu target: int8)", "parity (cpu target: int8)",
        "export (int4 checkpoint, cpu target)", "parity (int4 checkpoint, cpu target)", "generate (cpu target)"]
    assert report["parity"]["bf16"]["greedy_identical_tokens"] == 32
    assert report["parity"]["bf16"]["score_max_abs_difference"] < 0.05  # the bf16 cache's rounding of the prompt
    assert report["parity"]["cpu"]["teacher_forced"]["argmax_agreement"] >= 0.9
    assert report["parity"]["int4"]["teacher_forced"]["argmax_agreement"] >= 0.8
    assert report["artifact"].endswith("artifact-cpu") and (tmp_path / "artifact-cpu" / "manifest.json").exists()
