"""The artifact manifest: the one contract between the exporter and the runtime.

`ART/manifest.json` names every file with its size and digests, every graph with its inputs
and outputs, the model config, the KV-cache format and the versions that made it. It is
written last and atomically, so an artifact without one is unfinished and never loads.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from .config import ModelConfig
from .errors import K2Error
from .file_hashes import CHUNK_DIGESTS, SMALLEST_CHUNK, chunk_count, chunk_key, files_matching
from .json_files import check_version, read_document
from .onnx_wire import graph_facts

FORMAT = "k2deploy-artifact"
FORMAT_VERSION = 5  # 2: the latent cache is paged (page_table and <array>_pages inputs); 3: graphs name themselves;
# 4: the int8 lowering's absorbed W_UK / W_UV are bytes code + 128 (exact integer products on every x86 CPU);
# 5: data files hold BLAKE3 chunk digests (chunk_blake3) in place of sha256 ones
READ_VERSIONS = (4, 5)  # a version 4 artifact's sha256 records are checked as they were
GRAPH_KEY = "k2deploy.graph"  # each .onnx's metadata_props: which graph it is ("embed", "layer_003", "head")
MANIFEST_FILE = "manifest.json"
HASH_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(root: Path, relative: str) -> dict:
    path = root / relative
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


@dataclass(frozen=True)
class Manifest:
    root: Path
    data: dict
    unhashed: set = field(default_factory=set, compare=False, repr=False)  # listed files whose sha256 is still to
    # check: the graphs' files where the manifest was loaded with hash_graphs False, each hashed as it is opened

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.data["model_config"], source=f"{self.root / MANIFEST_FILE} model_config")

    @property
    def kv_cache(self) -> dict:
        return self.data["kv_cache"]

    @property
    def graphs(self) -> dict:
        return self.data["graphs"]

    def path(self, relative: str) -> Path:
        return inside(self.root, relative, "file")

    def graph_entry(self, name: str) -> dict:
        """Graph `name`'s record ("embed", "head" or "layer_NNN"): its file, data file, inputs and outputs."""
        graphs = self.graphs
        if not name.startswith("layer_"):
            return graphs[name]
        index = int(name.removeprefix("layer_")) - graphs["layer_range"][0]
        entry = graphs["layers"][index]
        if entry.get("layer") != int(name.removeprefix("layer_")):
            raise K2Error(f"{self.root / MANIFEST_FILE}: graphs.layers[{index}] says it is layer "
                          f"{entry.get('layer')!r}, not {name}; re-export the artifact")
        return entry

    def graph_file(self, name: str, hash_data: bool = True) -> Path:
        """The .onnx of graph `name` ("embed", "head" or "layer_NNN"), checked before anything opens it: hashed if it
        is still unhashed, and its data file too unless hash_data is False (the caller then checks it, `verify`, in
        the read that brings it into memory); the file says it is that graph, and every tensor it keeps outside it
        lies in the graph's own listed data file."""
        entry = self.graph_entry(name)
        self.verify([key for key in (entry["file"], entry["data"] if hash_data else None) if key in self.unhashed])
        path = self.path(entry["file"])
        metadata, locations = graph_facts(path)
        if metadata.get(GRAPH_KEY) != name:
            raise K2Error(f"{self.root}: {entry['file']} holds graph {metadata.get(GRAPH_KEY)!r}, the manifest lists "
                          f"it as {name!r}; the artifact was altered or made by an older k2deploy, re-export it")
        data = Path(entry["data"])
        stray = sorted(loc for loc in locations if data.parent != path.relative_to(self.root).parent or loc != data.name)
        if stray:
            raise K2Error(f"{self.root}: {entry['file']} reads tensors from {stray[0]!r}, not from its listed data "
                          f"file {entry['data']}; refusing to load it")
        return path

    def verify(self, names, hashes: bool = True) -> None:
        """Files `names` of the manifest's list: each a regular file inside the artifact, of its size and (with
        `hashes`) its digests; a K2Error for the first that is not. A pipeline stage verifies only its own files."""
        names = list(names)
        for relative in names:
            record = self.data["files"][relative]
            file = inside(self.root, relative, "file")
            if file.stat().st_size != record["bytes"]:
                raise K2Error(f"{self.root}: file {relative} has {file.stat().st_size} bytes, the manifest says "
                              f"{record['bytes']}; it was altered or truncated, re-export the artifact")
        if hashes:  # every file read on several threads (core/file_hashes.py); a checked file counts as hashed
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            found = files_matching([(self.root / name, self.data["files"][name]) for name in names], threads)
            for relative, matched in zip(names, found):
                if not matched:
                    raise K2Error(f"{self.root}: file {relative} does not match its digests in the manifest; it was "
                                  f"altered, re-export the artifact")
                self.unhashed.discard(relative)

    def graph_files(self, names=None) -> list[str]:
        """The files (graph and external data) of graphs `names` ("embed", "head", "layer_NNN"; None: all the artifact
        holds)."""
        entries = ([self.graphs["embed"], *self.graphs["layers"], self.graphs["head"]] if names is None
                   else [self.graph_entry(name) for name in names])
        return [entry[key] for entry in entries if entry is not None for key in ("file", "data")]

    @property
    def digest(self) -> str:
        """sha256 of manifest.json: names this exact artifact in benchmark results and engine records."""
        return sha256_file(self.root / MANIFEST_FILE)


HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")  # sha256's and BLAKE3's


def inside(root: Path, relative: object, what: str) -> Path:
    """`relative` as a regular file inside the artifact: a K2Error for anything else (an absolute path, `..`, a
    link out of the artifact, a device, a pipe), checked before the file is opened."""
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise K2Error(f"{root}: {what} {relative!r} is not a file name; re-export the artifact")
    if os.path.isabs(relative) or ".." in Path(relative).parts:
        raise K2Error(f"{root}: {what} {relative!r} points outside the artifact; refusing to read it")
    path = root / relative
    try:
        resolved = path.resolve(strict=True)
    except (FileNotFoundError, RuntimeError):
        raise K2Error(f"{root}: file {relative} listed in the manifest is missing; re-export the artifact") from None
    if not resolved.is_relative_to(root.resolve()):
        raise K2Error(f"{root}: {what} {relative!r} links outside the artifact; refusing to read it")
    if not stat.S_ISREG(resolved.stat().st_mode):
        raise K2Error(f"{root}: {what} {relative!r} is not a regular file; refusing to read it")
    return path


def _check_shape(root: Path, data: dict) -> None:
    """The manifest's structure, before any of it is used: one-line K2Errors naming what is malformed."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise K2Error(f"{root / MANIFEST_FILE}: malformed manifest ({what}); re-export the artifact")

    files = data.get("files")
    need(isinstance(files, dict), "'files' must be an object of path -> {bytes, and a sha256 or chunk digests}")
    for name, record in files.items():
        need(isinstance(record, dict) and isinstance(record.get("bytes"), int) and not isinstance(record["bytes"], bool)
             and record["bytes"] >= 0, f"files[{name!r}] must hold a byte count")
        key = chunk_key(record)
        need(key is not None or (isinstance(record.get("sha256"), str) and HEX_DIGEST.match(record["sha256"])),
             f"files[{name!r}] must hold a sha256 or chunk digests")
        need(key != "chunk_blake3" or not ({"sha256", "chunk_sha256"} & set(record)),  # it would go unchecked
             f"files[{name!r}] must hold BLAKE3 chunk digests alone, not a sha256 beside them")
        need(key != "chunk_blake3" or data.get("format_version") != 4,
             f"files[{name!r}] holds BLAKE3 chunk digests, which format version 4 does not have")
        if key is not None:
            step, chunks = record.get("chunk_bytes"), record[key]
            need(isinstance(step, int) and not isinstance(step, bool) and step >= SMALLEST_CHUNK and isinstance(chunks, list)
                 and len(chunks) == chunk_count(record["bytes"], step)
                 and all(isinstance(c, str) and HEX_DIGEST.match(c) for c in chunks),
                 f"files[{name!r}] must hold a digest for each of its chunk_bytes chunks")
    need(isinstance(data.get("model_config"), dict), "'model_config' must be an object")
    kv = data.get("kv_cache")
    need(isinstance(kv, dict) and all(k in kv for k in ("format", "latent_dim", "rope_dim", "bytes_per_token_per_layer")),
         "'kv_cache' must be an object with format, latent_dim, rope_dim and bytes_per_token_per_layer")
    graphs = data.get("graphs")
    need(isinstance(graphs, dict) and isinstance(graphs.get("layers"), list) and "embed" in graphs and "head" in graphs
         and isinstance(graphs.get("layer_range"), list) and len(graphs["layer_range"]) == 2,
         "'graphs' must hold embed, layers, head and layer_range")
    entries = [g for g in (graphs["embed"], graphs["head"], *graphs["layers"]) if g is not None]
    for entry in entries:
        need(isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("data"), str)
             and isinstance(entry.get("inputs"), list) and isinstance(entry.get("outputs"), list),
             "every graph needs file, data, inputs and outputs")
        for key in ("file", "data"):
            need(entry[key] in files, f"graph file {entry[key]!r} is not listed in 'files', so it cannot be verified")


def load_manifest(root: str | Path, verify_hashes: bool = True, hash_graphs: bool = True) -> Manifest:
    """Reads and checks an artifact: format version, its structure, then every file's place (a regular file
    inside the artifact), presence, size and (by default) hash; hash_graphs False leaves the graphs' files to be
    hashed as each is opened (`graph_file`): a backend or stage hashes only what it loads, and may hash a data file
    in the same read that loads it."""
    root = Path(root)
    if not root.is_dir():
        raise K2Error(f"{root}: not an artifact directory (run `k2deploy export CKPT --out {root}` first)")
    path = root / MANIFEST_FILE
    if not path.exists():
        raise K2Error(f"{root}: no {MANIFEST_FILE}; the export is unfinished or this is not an artifact "
                      f"(re-run `k2deploy export` to resume it)")
    data = read_document(path, "missing", "format", FORMAT, "k2deploy manifest")
    check_version(data, "format_version", READ_VERSIONS, f"{path}: format",
                  "re-export the checkpoint with this version")
    _check_shape(root, data)
    manifest = Manifest(root, data)
    unhashed = set() if hash_graphs else set(manifest.graph_files())
    manifest.verify([name for name in data["files"] if name not in unhashed], verify_hashes)
    manifest.verify(unhashed, hashes=False)
    if verify_hashes:
        manifest.unhashed.update(unhashed)
    return manifest
