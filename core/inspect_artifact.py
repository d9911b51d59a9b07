"""`k2deploy inspect` on an exported artifact: its graphs, cache format and sizes, from the manifest."""

from __future__ import annotations

from .manifest import Manifest
from .targets import artifact_target


def describe_artifact(manifest: Manifest, verified: bool = False) -> dict:
    """verified: every file was hashed and matched the manifest's digests (else only their sizes were checked)."""
    data, config = manifest.data, manifest.config
    graphs = data["graphs"]
    layers = graphs["layers"]
    kv = data["kv_cache"]
    return {
        "kind": "artifact",
        "path": str(manifest.root),
        "format_version": data["format_version"],
        "complete": data["complete"],
        "model_type": config.model_type,
        "layers": graphs["layer_range"],
        "graphs": {
            "embed": graphs["embed"] and graphs["embed"]["file"],
            "layers": [{"layer": g["layer"], "structure": g["structure"], "file": g["file"]} for g in layers],
            "head": graphs["head"] and graphs["head"]["file"],
            "layer_inputs": layers[0]["inputs"] if layers else [],
            "layer_outputs": layers[0]["outputs"] if layers else [],
        },
        "target": artifact_target(data).name,
        "weights": data.get("weights"),
        "weight_layout": data.get("weight_layout", "rows"),
        "weight_formats": _weight_formats(data.get("weight_formats")),
        "kv_cache": kv,
        "kv_cache_bytes_per_token_per_layer": kv["bytes_per_token_per_layer"],
        "kv_cache_bytes_per_token": kv["bytes_per_token_per_layer"] * len(layers),
        "bytes": sum(record["bytes"] for record in data["files"].values()),
        "files": len(data["files"]),
        "custom_ops": data["custom_ops"],
        "opset": data["opset"],
        "versions": data["versions"],
        "manifest_sha256": manifest.digest,
        "digests_verified": verified,
    }


def format_artifact(info: dict) -> str:
    kv = info["kv_cache"]
    structures = {}
    for graph in info["graphs"]["layers"]:
        structures[graph["structure"]] = structures.get(graph["structure"], 0) + 1
    layer_inputs = ", ".join(f"{i['name']} {i['dtype']}{i['shape']}" for i in info["graphs"]["layer_inputs"])
    return "\n".join([
        f"artifact    {info['path']}  (format {info['format_version']}, {info['model_type']}"
        f"{'' if info['complete'] else ', partial'})",
        f"layers      {info['layers'][0]}:{info['layers'][1]}  "
        + ", ".join(f"{n} {kind}" for kind, n in structures.items())
        + ("" if info["complete"] else "  (no embedding or head: cannot run alone)"),
        f"target      {info['target']}" + (f": {info['weights']}" if info["weights"] else "")
        + ("; held in the native step's tiles" if info["weight_layout"] == "native_tiles" else ""),
        *(f"  {group:<22}{entry['format']}: {entry['bytes']:,} bytes"
          for group, entry in (info["weight_formats"] or {}).items()),
        f"kv cache    {kv['format']}: {kv['bytes_per_token_per_layer']} bytes per token per layer, "
        f"{info['kv_cache_bytes_per_token']:,} per token ({kv['layout']})",
        f"layer in    {layer_inputs}",
        f"custom ops  {info['custom_ops']['domain']} v{info['custom_ops']['version']}: {', '.join(info['custom_ops']['ops'])}",
        f"files       {info['files']}, {info['bytes']:,} bytes; opset {info['opset']}; "
        f"torch {info['versions'].get('torch')}, onnx {info['versions'].get('onnx')}",
        "checked     every file's size and digest" if info["digests_verified"]
        else "checked     every file's size; digests not checked (--verify hashes every file)",
    ])


def _weight_formats(entry) -> dict | None:
    """The manifest's `weight_formats` ({group: {format, bytes}}) when well formed; None for older artifacts (or a
    damaged entry: inspect only reports it)."""
    if not isinstance(entry, dict) or len(entry) > 16:
        return None
    well_formed = all(isinstance(g, str) and isinstance(v, dict) and isinstance(v.get("format"), str)
                      and isinstance(v.get("bytes"), int) and v["bytes"] >= 0 for g, v in entry.items())
    return {g: {"format": v["format"][:200], "bytes": v["bytes"]} for g, v in entry.items()} if well_formed else None
