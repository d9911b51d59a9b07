"""benchmarks/gpu_check.py: its --dry-run (imports, the launch plan, the real-size layer's shapes) runs anywhere."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=child_env(),
                          timeout=300)


def test_the_dry_run_writes_the_plan_of_every_plugin_and_the_real_size_layer(tmp_path):
    done = _run("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["checks"] == [] and report["moe_layer"] == []
    launches = report["plan"]["launches"]
    assert set(launches) == {f"{plugin} {dims}" for dims in ("tiny", "k2")
                             for plugin in ("MoeRoute", "MoeExpertsUp", "MoeExpertsDown", "MlaAttention")}
    # TensorRT's order: input pointers, int32 scalars, output pointers
    up = launches["MoeExpertsUp k2"]
    assert up["signature"] == ["*fp32", "*i64", "*u8", "*fp32", "*u8", "*fp32", "i32", "i32", "i32", "*fp32"]
    assert up["scalars"] == [8, 7168, 2048] and up["grid"] == [8 * 8, 2048 // 32]
    layer = report["plan"]["layer"]
    assert layer["routed_expert_fp8_bytes"] == 3 * 384 * 2048 * 7168
    cells = {(c["batch"], c["context"]): c for c in layer["cells"]}
    assert set(cells) == {(b, t) for b in (1, 8, 32) for t in (128, 4096, 32768)}
    assert cells[(32, 32768)]["cache_bytes"] == 32 * 32768 * 656
    assert cells[(32, 128)]["weight_bytes"] > cells[(1, 128)]["weight_bytes"]  # more tokens choose more experts
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "dry run" in markdown and "| MlaAttention k2 | mla_attention_kernel |" in markdown


def test_without_a_gpu_the_full_check_says_so_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the full check would run")
    done = _run("--out", str(tmp_path))
    assert done.returncode == 2 and "no CUDA GPU visible" in done.stderr and "Traceback" not in done.stderr
