"""The engine record: ART/engines/<gpu>/engines.json, written with the engines and checked before loading them.

A TensorRT engine runs only on the GPU architecture and the TensorRT version it was built with,
and only with the artifact whose graphs it was built from. The record names all three (GPU name
and compute capability, TensorRT version, the manifest's sha256) with every engine file's size
and hash; `check_record` turns any mismatch into one line that says how to rebuild.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import K2Error
from ..json_files import check_version, read_document, write_json_atomically
from ..manifest import sha256_file
from .environment import GpuInfo

ENGINES_DIR = "engines"
RECORD_FILE = "engines.json"
RECORD_FORMAT = "k2deploy-tensorrt-engines"
RECORD_VERSION = 1


def engines_dir(artifact: Path, gpu: GpuInfo) -> Path:
    return Path(artifact) / ENGINES_DIR / gpu.slug


def rebuild_command(artifact: Path, gpu: GpuInfo | None = None) -> str:
    device = "" if gpu is None or gpu.index == 0 else f" --gpu {gpu.index}"
    return f"k2deploy build-engines {artifact}{device}"


def make_record(gpu: GpuInfo, tensorrt_version: str, manifest_digest: str, engines: dict, settings: dict,
                plugins: dict, directory: Path) -> dict:
    """engines: {stem: {"engine": file name in directory, "onnx": path relative to the artifact, ...}}."""
    for entry in engines.values():
        path = Path(directory) / entry["engine"]
        entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    return {"format": RECORD_FORMAT, "format_version": RECORD_VERSION, "gpu": gpu.to_dict(),
            "tensorrt": tensorrt_version, "manifest_sha256": manifest_digest, "settings": settings,
            "plugins": plugins, "engines": engines}


def write_record(directory: Path, record: dict) -> None:
    write_json_atomically(Path(directory) / RECORD_FILE, record)


def read_record(directory: Path) -> dict:
    path = Path(directory) / RECORD_FILE
    return read_document(path, "missing: the engines there are unfinished or were not built by k2deploy", "format",
                         RECORD_FORMAT, "k2deploy engine record")


def check_record(record: dict, gpu: GpuInfo, tensorrt_version: str, manifest_digest: str, artifact: Path,
                 directory: Path | None = None) -> None:
    """Raises K2Error, with the command that rebuilds, unless these engines fit this GPU, TensorRT and artifact."""
    rebuild = f"rebuild them with `{rebuild_command(artifact, gpu)}`"
    check_version(record, "format_version", RECORD_VERSION, "engine record", rebuild)
    built_gpu = record.get("gpu") or {}
    if (built_gpu.get("name"), built_gpu.get("compute_capability")) != (gpu.name, gpu.compute_capability):
        raise K2Error(f"these engines were built for {built_gpu.get('name')} (compute capability "
                      f"{built_gpu.get('compute_capability')}), this GPU is {gpu.name} (compute capability "
                      f"{gpu.compute_capability}); TensorRT engines only run on the GPU they were built for: {rebuild}")
    if record.get("tensorrt") != tensorrt_version:
        raise K2Error(f"these engines were built with TensorRT {record.get('tensorrt')}, this is TensorRT "
                      f"{tensorrt_version}; engines do not load across TensorRT versions: {rebuild}")
    if record.get("manifest_sha256") != manifest_digest:
        raise K2Error(f"these engines were built from another export of {artifact} (manifest sha256 "
                      f"{str(record.get('manifest_sha256'))[:12]}..., now {manifest_digest[:12]}...): {rebuild}")
    if directory is not None:
        for stem, entry in (record.get("engines") or {}).items():
            path = Path(directory) / entry["engine"]
            if not path.exists() or path.stat().st_size != entry.get("bytes"):
                raise K2Error(f"engine {path} is missing or altered: {rebuild}")


def find_engines(artifact: Path, gpu: GpuInfo) -> Path:
    """This GPU's engine folder of an artifact, or a K2Error naming the folders there are and the command."""
    directory = engines_dir(artifact, gpu)
    if (directory / RECORD_FILE).exists():
        return directory
    root = Path(artifact) / ENGINES_DIR
    others = sorted(p.name for p in root.iterdir() if (p / RECORD_FILE).exists()) if root.is_dir() else []
    built = f" (there are engines for {', '.join(others)})" if others else ""
    raise K2Error(f"{artifact} has no TensorRT engines for this GPU, {gpu.name}{built}; build them with "
                  f"`{rebuild_command(artifact, gpu)}`")
