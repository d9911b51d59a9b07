"""The exporter's artifact: its manifest, its FP8 graphs, resuming, and refusing damaged artifacts."""

import json
import os

import onnx
import pytest

from cli_runner import run_cli
from k2deploy.core.errors import K2Error
from k2deploy.core.manifest import FORMAT_VERSION, MANIFEST_FILE, load_manifest

pytest.importorskip("torch")

from k2deploy.export import exporter  # noqa: E402
from k2deploy.export.exporter import ExportOptions, export_artifact  # noqa: E402

pytestmark = pytest.mark.slow  # exports of every target, resumed and interrupted


def test_manifest_names_every_file_graph_and_the_cache(tiny_artifacts):
    manifest = load_manifest(tiny_artifacts["fp8"])
    data = manifest.data
    assert data["format_version"] == FORMAT_VERSION and data["complete"]
    assert [g["layer"] for g in data["graphs"]["layers"]] == [0, 1, 2]
    assert [g["structure"] for g in data["graphs"]["layers"]] == ["dense", "moe", "moe"]
    for relative, record in data["files"].items():
        assert (tiny_artifacts["fp8"] / relative).stat().st_size == record["bytes"]
        if relative.endswith(".data"):  # the graphs' data: a BLAKE3 digest a chunk
            assert len(record["chunk_blake3"]) == -(-record["bytes"] // record["chunk_bytes"]) and "sha256" not in record
        else:
            assert len(record["sha256"]) == 64
    assert {"tokenizer/tiktoken.model", "tokenizer/tokenizer_config.json"} <= set(data["files"])
    assert data["versions"]["torch"] and data["versions"]["onnx"]
    assert data["kv_cache"]["bytes_per_token_per_layer"] == 64 + 4 + 2 * 16


def test_decode_graphs_take_the_cache_as_fp8_and_keep_fp8_weights(tiny_artifacts):
    layer = onnx.load(tiny_artifacts["fp8"] / "graphs" / "layer_001.onnx", load_external_data=False)
    inputs = {i.name: i.type.tensor_type.elem_type for i in layer.graph.input}
    assert inputs["page_table"] == onnx.TensorProto.INT64
    assert inputs["latent_pages"] == onnx.TensorProto.UINT8  # the e4m3 bits: ONNX gathers no e4m3
    assert inputs["rope_pages"] == onnx.TensorProto.FLOAT16
    outputs = {o.name: o.type.tensor_type.elem_type for o in layer.graph.output}
    assert outputs["new_latent"] == onnx.TensorProto.FLOAT8E4M3FN
    shapes = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in layer.graph.input}
    assert shapes["page_table"] == ["batch", "table"] and shapes["latent_pages"] == ["pages", 64, 64]
    weights = {t.name: t for t in layer.graph.initializer}
    assert weights["self_attn.q_a_proj.weight"].data_type == onnx.TensorProto.FLOAT8E4M3FN
    assert all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights.values())
    custom = [(n.domain, n.op_type) for n in layer.graph.node if n.domain == "k2deploy"]
    assert sorted(custom) == [("k2deploy", "MlaAttention"), ("k2deploy", "MoeExperts"), ("k2deploy", "MoeRoute")]
    assert {f.name for f in layer.functions} >= {"MlaAttention", "MoeExperts", "MoeRoute"}
    # the artifact is the checkpoint's size, not four times it
    checkpoint_bytes = sum(f.stat().st_size for f in (tiny_artifacts["fp8"] / "graphs").glob("*.data"))
    manifest = load_manifest(tiny_artifacts["fp8"])
    assert checkpoint_bytes < 1.1 * sum(os.path.getsize(p) for p in _shards(manifest))


def _shards(manifest):
    root = manifest.data["checkpoint"]["path"]
    return [os.path.join(root, f) for f in os.listdir(root) if f.endswith(".safetensors")]


def _export_interrupted_after_two_graphs(checkpoint, out, monkeypatch) -> list[str]:
    """Runs an export that a Ctrl-C stops after its second graph; -> the stems written."""
    written, real_write = [], exporter.write_graph

    def write_then_die(model, functions, directory, stem, *args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(stem)
        return real_write(model, functions, directory, stem, *args, **kwargs)

    monkeypatch.setattr(exporter, "write_graph", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        export_artifact(ExportOptions(str(checkpoint)), out)
    monkeypatch.setattr(exporter, "write_graph", real_write)
    return written


def test_an_interrupted_export_resumes_with_finished_graphs_kept(tiny_checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "art"
    real_write = exporter.write_graph
    written = _export_interrupted_after_two_graphs(tiny_checkpoint, out, monkeypatch)
    assert not (out / MANIFEST_FILE).exists()
    with pytest.raises(K2Error, match="no manifest.json; the export is unfinished"):
        load_manifest(out)
    kept = {stem: (out / "graphs" / f"{stem}.data").stat().st_mtime_ns for stem in written}
    redone = []
    monkeypatch.setattr(exporter, "write_graph", lambda m, f, d, stem, *a, **k: redone.append(stem) or real_write(m, f, d, stem, *a, **k))
    export_artifact(ExportOptions(str(tiny_checkpoint)), out)
    assert redone == ["layer_001", "layer_002", "head"] and written == ["embed", "layer_000"]
    assert {stem: (out / "graphs" / f"{stem}.data").stat().st_mtime_ns for stem in written} == kept
    load_manifest(out)  # complete and consistent


def test_an_export_stopped_mid_graph_leaves_no_half_written_file(tiny_checkpoint, tmp_path):
    """The command line turns SIGTERM into Terminated, raised where the export is, as Ctrl-C raises KeyboardInterrupt."""
    from k2deploy.commands.command import Terminated

    def stop(nbytes, label):
        raise Terminated

    with pytest.raises(Terminated):
        export_artifact(ExportOptions(str(tiny_checkpoint), target="cpu"), tmp_path / "art", on_progress=stop)
    assert os.listdir(tmp_path / "art" / "graphs") == []
    export_artifact(ExportOptions(str(tiny_checkpoint), target="cpu"), tmp_path / "art")  # the rerun takes it up
    load_manifest(tmp_path / "art")


def test_export_refuses_to_overwrite_and_force_redoes(tiny_artifacts, tiny_checkpoint):
    result = run_cli("export", tiny_checkpoint, "--out", tiny_artifacts["bf16"], "--kv-cache", "bf16")
    assert result.returncode == 2 and "already holds an exported artifact; pass --force" in result.stderr


@pytest.mark.parametrize("damage, message", [
    ("alter", "does not match its digests"),
    ("truncate", "it was altered or truncated"),
    ("delete", "is missing"),
    ("version", "format version 99"),
])
def test_a_damaged_artifact_is_a_clear_error_at_load(tiny_artifacts, tmp_path, damage, message):
    import shutil

    art = shutil.copytree(tiny_artifacts["fp8"], tmp_path / "art")
    target = art / "graphs" / "layer_001.data"
    if damage == "alter":
        data = bytearray(target.read_bytes())
        data[100] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(target, 10)
    elif damage == "delete":
        target.unlink()
    else:
        manifest = json.loads((art / MANIFEST_FILE).read_text())
        manifest["format_version"] = 99
        (art / MANIFEST_FILE).write_text(json.dumps(manifest))
    result = run_cli("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_inspect_reads_artifacts(tiny_artifacts):
    result = run_cli("inspect", tiny_artifacts["fp8"], "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["kind"] == "artifact" and info["kv_cache_bytes_per_token_per_layer"] == 100
    assert info["kv_cache_bytes_per_token"] == 300
    assert "100 bytes per token per layer" in run_cli("inspect", tiny_artifacts["fp8"]).stdout


def test_kimi_k2_attention_dimensions_cache_at_656_bytes(tmp_path):
    """The small preset has Kimi K2's kv_lora 512 and rope 64: export one layer and read the figure back."""
    checkpoint = tmp_path / "small"
    made = run_cli("make-checkpoint", checkpoint, "--preset", "small", "--layers", "2",
                   "--set", "n_routed_experts=8", "--set", "hidden_size=256", "--set", "vocab_size=1024",
                   "--set", "bos_token_id=768", "--set", "eos_token_id=769", "--json")
    assert made.returncode == 0, made.stderr
    for target, cache, figure in (("cuda", "fp8", 656), ("cpu", "int8", 512 + 4 + 128)):  # int8: one scale per token
        out = tmp_path / f"art-{cache}"
        exported = run_cli("export", checkpoint, "--out", out, "--layers", "1:2", "--target", target, "--json")
        assert exported.returncode == 0, exported.stderr
        info = json.loads(run_cli("inspect", out, "--json").stdout)
        assert info["kv_cache_bytes_per_token_per_layer"] == figure and not info["complete"]
        refused = run_cli("generate", out, "--prompt-ids", "1,2")
        assert refused.returncode == 2 and "holds only layers 1:2" in refused.stderr


def test_progress_without_a_terminal_is_a_line_per_graph_and_a_resume_says_what_it_kept(tiny_checkpoint, tmp_path,
                                                                                         monkeypatch):
    out = tmp_path / "art"
    _export_interrupted_after_two_graphs(tiny_checkpoint, out, monkeypatch)
    resumed = run_cli("export", tiny_checkpoint, "--out", out)  # stderr is a file here, not a terminal
    assert resumed.returncode == 0, resumed.stderr
    tokenizer, *lines = resumed.stderr.strip().splitlines()
    assert tokenizer == "export: tokenizer: tiktoken.model, tokenizer_config.json, generation_config.json"
    assert lines[0] == "export: resuming: 2 graphs kept from the unfinished export, 3 to write"
    assert [line.split()[1] for line in lines[1:]] == ["layer_001", "layer_002", "head"]
    assert all(" written (" in line for line in lines[1:])


def test_a_resume_over_another_checkpoints_bytes_writes_every_graph_again(tmp_path, monkeypatch):
    """seed 1's export stopped after two graphs, the checkpoint rewritten with seed 2 in the same folder, the export
    run again: nothing of seed 1 is kept (it says so), and the artifact is seed 2's own, graph for graph."""
    checkpoint, out, fresh = tmp_path / "ckpt", tmp_path / "art", tmp_path / "fresh"
    assert run_cli("make-checkpoint", checkpoint, "--preset", "tiny", "--seed", "1").returncode == 0
    _export_interrupted_after_two_graphs(checkpoint, out, monkeypatch)
    assert run_cli("make-checkpoint", checkpoint, "--preset", "tiny", "--seed", "2", "--force").returncode == 0
    resumed = run_cli("export", checkpoint, "--out", out)
    assert resumed.returncode == 0, resumed.stderr
    assert "is not kept: the checkpoint's files changed since" in resumed.stderr and "resuming" not in resumed.stderr
    assert run_cli("export", checkpoint, "--out", fresh).returncode == 0
    for name in ("embed", "layer_000", "head"):
        assert (out / "graphs" / f"{name}.data").read_bytes() == (fresh / "graphs" / f"{name}.data").read_bytes()
    sources = json.loads((out / MANIFEST_FILE).read_text())["checkpoint"]["files"]
    assert set(sources) >= {"config.json"} and all(len(r["sampled_blake3"]) == 64 for r in sources.values())


def test_out_never_touches_a_file_the_export_did_not_write(tiny_checkpoint, tmp_path):
    """A folder that is not an artifact is refused (one line naming a file in it), with --force too, its files
    untouched; --force over an artifact removes only the artifact's own files; the checkpoint's parent is refused."""
    user = tmp_path / "u"
    (user / "graphs").mkdir(parents=True)
    (user / "graphs" / "embed.onnx").write_text("mine")
    for extra in ([], ["--force"]):
        refused = run_cli("export", tiny_checkpoint, "--out", user, *extra)
        assert refused.returncode == 2 and "is not empty and holds no artifact (graphs is in it)" in refused.stderr
    (user / MANIFEST_FILE).write_text('{"name": "my notes"}')  # a manifest.json that is not an artifact's
    refused = run_cli("export", tiny_checkpoint, "--out", user, "--force")
    assert refused.returncode == 2 and "holds no artifact" in refused.stderr
    assert (user / "graphs" / "embed.onnx").read_text() == "mine" and (user / MANIFEST_FILE).exists()
    parent = run_cli("export", tiny_checkpoint, "--out", tiny_checkpoint.parent)
    assert parent.returncode == 2 and "holds no artifact" in parent.stderr
    art = tmp_path / "art"
    assert run_cli("export", tiny_checkpoint, "--out", art).returncode == 0
    (art / "graphs" / "notes.txt").write_text("kept")
    again = run_cli("export", tiny_checkpoint, "--out", art, "--force")
    assert again.returncode == 0, again.stderr
    assert (art / "graphs" / "notes.txt").read_text() == "kept"
    load_manifest(art)
    manifest = json.loads((art / MANIFEST_FILE).read_text())  # a manifest naming folders and paths outside
    manifest["files"] |= {"graphs": {"bytes": 1}, ".": {"bytes": 1}, "../outside.txt": {"bytes": 1}}
    (art / MANIFEST_FILE).write_text(json.dumps(manifest))
    (tmp_path / "outside.txt").write_text("kept")
    again = run_cli("export", tiny_checkpoint, "--out", art, "--force")
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert (art / "graphs" / "notes.txt").read_text() == "kept" and (tmp_path / "outside.txt").read_text() == "kept"
    load_manifest(art)
