"""An artifact (its manifest too) and a checkpoint index are untrusted input: every way of pointing the runtime
outside the artifact, at something that is not a file, or at content the manifest misdescribes is one line,
exit 2, no traceback, and nothing outside the artifact is opened."""

import json
import os
import shutil

import pytest

from cli_runner import run_cli
import onnx
from onnx.external_data_helper import _get_all_tensors

from k2deploy.core.manifest import MANIFEST_FILE, file_record


def _rename_file(data, art, new_name):
    data["files"][new_name] = data["files"].pop("graphs/layer_001.data")
    data["graphs"]["layers"][1]["data"] = new_name


def _add_file(data, art, name, make):
    make(art / name)
    data["files"][name] = {"bytes": 0, "sha256": "0" * 64}


def _unlist_graph(data, art):
    del data["files"]["graphs/layer_001.onnx"]


def _set(path, value):
    def edit(data, art):
        *parents, leaf = path
        target = data
        for key in parents:
            target = target[key]
        target[leaf] = value
    return edit


def _rehash(data, art, name):
    data["files"][name] = file_record(art, name)


def _swap_layer_graphs(data, art):
    first, second = art / "graphs/layer_000.onnx", art / "graphs/layer_001.onnx"
    first_bytes = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(first_bytes)
    for name in ("graphs/layer_000.onnx", "graphs/layer_001.onnx"):
        _rehash(data, art, name)


def _redirect_data(location):
    """layer_001.onnx's external tensors made to read `location` instead of layer_001.data."""
    def edit(data, art):
        graph = onnx.load(art / "graphs/layer_001.onnx", load_external_data=False)
        for tensor in _get_all_tensors(graph):
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save(graph, art / "graphs/layer_001.onnx")
        _rehash(data, art, "graphs/layer_001.onnx")
    return edit


CASES = {
    "a parent path": (lambda d, a: _rename_file(d, a, "../outside.data"), "points outside the artifact"),
    "an absolute path": (lambda d, a: _rename_file(d, a, "/etc/passwd"), "points outside the artifact"),
    "a link to a device": (lambda d, a: _add_file(d, a, "graphs/zero", lambda p: os.symlink("/dev/zero", p)),
                           "links outside the artifact"),
    "a pipe": (lambda d, a: _add_file(d, a, "graphs/pipe", os.mkfifo), "is not a regular file"),
    "a graph left out of files": (_unlist_graph, "is not listed in 'files', so it cannot be verified"),
    "files as a list": (_set(["files"], ["graphs/embed.onnx"]), "malformed manifest ('files' must be an object"),
    "no graphs": (lambda d, a: d.pop("graphs"), "malformed manifest ('graphs' must hold"),
    "a bad hash record": (_set(["files", "graphs/embed.onnx", "sha256"], 5), "must hold a sha256 or chunk digests"),
    "an edited hidden_size": (_set(["model_config", "hidden_size"], 256),
                              "manifest.json does not describe graphs/embed.onnx: hidden has 192"),
    "an edited cache format": (_set(["kv_cache", "format"], "bf16"),
                               "kv_cache format 'bf16' does not go with its latent_scale_group 64"),
    "a cache format of the same layout": (_set(["kv_cache", "format"], "int8"),
                                          "new_latent is FLOAT8E4M3FN, the manifest's cache format 'int8' needs UINT8"),
    "edited cache dims": (_set(["kv_cache", "latent_dim"], 32), "kv_cache dims (32, 16) are not its model's (64, 16)"),
    "two layer graphs swapped": (_swap_layer_graphs, "holds graph 'layer_001', the manifest lists it as 'layer_000'"),
    "a layer entry renumbered": (_set(["graphs", "layers", 1, "layer"], 0), "graphs.layers[1] says it is layer 0"),
    "a graph reading another layer's data": (_redirect_data("layer_000.data"),
                                             "reads tensors from 'layer_000.data', not from its listed data file"),
    "a graph reading outside the artifact": (_redirect_data("../../outside.data"),
                                             "reads tensors from '../../outside.data'"),
    "a bogus target": (_set(["target"], "bogus"), "target 'bogus'"),
    "chunks a byte long": (_set(["files", "graphs/layer_001.data", "chunk_bytes"], 1),
                           "must hold a digest for each of its chunk_bytes chunks"),
    "a chunk digest short": (lambda d, a: d["files"]["graphs/layer_001.data"]["chunk_blake3"].pop(),
                             "must hold a digest for each of its chunk_bytes chunks"),
    "a chunk digest altered": (_set(["files", "graphs/layer_001.data", "chunk_blake3", 0], "0" * 64),
                               "file graphs/layer_001.data does not match its digests"),
    "a sha256 beside BLAKE3 chunk digests": (_set(["files", "graphs/layer_001.data", "sha256"], "0" * 64),
                                            "must hold BLAKE3 chunk digests alone, not a sha256 beside them"),
    "BLAKE3 chunk digests in a version 4 manifest": (_set(["format_version"], 4),
                                                     "which format version 4 does not have"),
    "a data file's record as a wrong whole sha256": (
        lambda d, a: d["files"].__setitem__("graphs/layer_001.data", {
            "bytes": d["files"]["graphs/layer_001.data"]["bytes"], "sha256": "0" * 64}),
        "file graphs/layer_001.data does not match its digests"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_manifest_that_points_astray_is_refused_in_one_line(tiny_artifacts, tmp_path, case):
    edit, message = CASES[case]
    art = shutil.copytree(tiny_artifacts["fp8"], tmp_path / "art")
    data = json.loads((art / MANIFEST_FILE).read_text())
    edit(data, art)
    (art / MANIFEST_FILE).write_text(json.dumps(data))
    result = run_cli("generate", art, "--prompt-ids", "1,2", "--max-new-tokens", "1")
    assert result.returncode == 2, (case, result.stderr)
    assert message in result.stderr and "Traceback" not in result.stderr, (case, result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("shard, message", [
    ("../model-00001.safetensors", "is not a file of the checkpoint folder"),
    ("/etc/passwd", "is not a file of the checkpoint folder"),
    ("sub/model.safetensors", "is not a file of the checkpoint folder"),
])
def test_a_checkpoint_index_naming_a_shard_elsewhere_is_refused(tiny_copy, shard, message):
    index = tiny_copy / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    result = run_cli("inspect", tiny_copy)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_inspect_verify_hashes_every_file_and_says_what_it_checked(tiny_artifacts, tmp_path, tiny_copy):
    """`inspect` reads the manifest and checks sizes only, and says so; `--verify` hashes every file: a byte
    changed in place (same size) is found, in one line."""
    art = shutil.copytree(tiny_artifacts["bf16"], tmp_path / "art")
    verified = run_cli("inspect", art, "--verify", "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["digests_verified"] is True
    target = art / json.loads((art / MANIFEST_FILE).read_text())["graphs"]["head"]["data"]
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    quick = run_cli("inspect", art)
    assert quick.returncode == 0 and "digests not checked (--verify" in quick.stdout
    refused = run_cli("inspect", art, "--verify")
    assert refused.returncode == 2 and "does not match its digests" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    checkpoint = run_cli("inspect", tiny_copy, "--verify")
    assert checkpoint.returncode == 2 and "a checkpoint records none" in checkpoint.stderr
