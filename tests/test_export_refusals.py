"""Export refuses what it cannot write correctly, in one line, before writing anything."""

import json

import numpy as np
import pytest

from cli_runner import run_cli
from k2deploy.core.manifest import MANIFEST_FILE

pytestmark = pytest.mark.slow  # an export per supported opset

pytest.importorskip("torch")


def _nan_scale(checkpoint):
    from k2deploy.core.checkpoint.reader import Checkpoint

    name = "model.layers.1.self_attn.q_a_proj.weight_scale_inv"
    with Checkpoint.open(checkpoint) as opened:
        entry = opened.entries[name]
    with open(entry.shard, "r+b") as f:
        f.seek(entry.begin)
        f.write(np.array([np.nan], dtype=np.float32).tobytes())
    return name


def _nan_code(checkpoint):
    from k2deploy.core.checkpoint.reader import Checkpoint

    with Checkpoint.open(checkpoint) as opened:
        entry = opened.entries["model.layers.1.mlp.experts.2.up_proj.weight"]
    with open(entry.shard, "r+b") as f:
        f.seek(entry.begin + 100)
        f.write(b"\x7f")  # e4m3fn's NaN


def _garbage_tokenizer(checkpoint):
    (checkpoint / "tiktoken.model").write_text("this is not base64 ranks\n")


CASES = {
    "opset 17": (["--opset", "17"], None, "--opset 17 is not supported; choose 21 to 24"),
    "opset 99": (["--opset", "99"], None, "--opset 99 is not supported; choose 21 to 24"),
    "out is the checkpoint": (["--out", "{ckpt}"], None, "is the checkpoint folder or inside it"),
    "out inside the checkpoint": (["--out", "{ckpt}/art"], None, "is the checkpoint folder or inside it"),
    "a NaN scale": ([], _nan_scale, "model.layers.1.self_attn.q_a_proj.weight_scale_inv holds a non-finite scale"),
    "a garbage tokenizer": ([], _garbage_tokenizer, "tiktoken.model"),
    "a NaN FP8 code, cpu target": (["--target", "cpu"], _nan_code,
                                   "model.layers.1.mlp.experts.2.fc1: its FP8 weight holds NaN codes"),
}


@pytest.mark.parametrize("case", CASES)
def test_export_refuses_in_one_line_and_writes_nothing(tiny_copy, tmp_path, case):
    flags, damage, message = CASES[case]
    if damage:
        damage(tiny_copy)
    flags = [f.format(ckpt=tiny_copy) for f in flags]
    out = tmp_path / "art"
    if "--out" not in flags:
        flags += ["--out", str(out)]
    result = run_cli("export", tiny_copy, *flags)
    assert result.returncode == 2, (case, result.stderr[-2000:])
    assert message in result.stderr and "Traceback" not in result.stderr, (case, result.stderr[-2000:])
    assert not (out / MANIFEST_FILE).exists() and not (tiny_copy / "art").exists()


@pytest.mark.parametrize("opset", [22, 23, 24])
def test_every_supported_opset_exports_and_runs(tiny_checkpoint, tmp_path, opset):
    out = tmp_path / f"art{opset}"
    exported = run_cli("export", tiny_checkpoint, "--out", out, "--opset", str(opset), "--json")
    assert exported.returncode == 0, exported.stderr[-2000:]
    generated = run_cli("generate", out, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert len(json.loads(generated.stdout)["token_ids"]) == 2
