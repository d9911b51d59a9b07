"""The artifact manifest: the one contract between the exporter and the runtime.

`ART/manifest.json` names every file with its size and sha256, every graph with its inputs
and outputs, the model config, the KV-cache format and the versions that made it. It is
written last and atomically, so an artifact without one is unfinished and never loads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .config import ModelConfig
from .errors import K2Error
from .json_files import check_version, read_document

FORMAT = "k2deploy-artifact"
FORMAT_VERSION = 1
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
        return self.root / relative

    @property
    def digest(self) -> str:
        """sha256 of manifest.json: names this exact artifact in benchmark results and engine records."""
        return sha256_file(self.root / MANIFEST_FILE)


def load_manifest(root: str | Path, verify_hashes: bool = True) -> Manifest:
    """Reads and checks an artifact: format version, then every file's presence, size and (by default) hash."""
    root = Path(root)
    if not root.is_dir():
        raise K2Error(f"{root}: not an artifact directory (run `k2deploy export CKPT --out {root}` first)")
    path = root / MANIFEST_FILE
    if not path.exists():
        raise K2Error(f"{root}: no {MANIFEST_FILE}; the export is unfinished or this is not an artifact "
                      f"(re-run `k2deploy export` to resume it)")
    data = read_document(path, "missing", "format", FORMAT, "k2deploy manifest")
    check_version(data, "format_version", FORMAT_VERSION, f"{path}: format",
                  "re-export the checkpoint with this version")
    for relative, record in data["files"].items():
        file = root / relative
        if not file.exists():
            raise K2Error(f"{root}: file {relative} listed in the manifest is missing; re-export the artifact")
        if file.stat().st_size != record["bytes"]:
            raise K2Error(f"{root}: file {relative} has {file.stat().st_size} bytes, the manifest says "
                          f"{record['bytes']}; it was altered or truncated, re-export the artifact")
        if verify_hashes and sha256_file(file) != record["sha256"]:
            raise K2Error(f"{root}: file {relative} does not match its sha256 in the manifest; it was altered, "
                          f"re-export the artifact")
    return Manifest(root, data)
