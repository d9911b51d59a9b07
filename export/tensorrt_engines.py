"""`k2deploy build-engines`: one TensorRT engine per graph of an exported artifact.

For every graph the TensorRT copy (ART/graphs/<stem>.tensorrt.onnx: the one a tensorrt target's export
wrote, else written now by `k2deploy.export.tensorrt_graph`) is parsed into a strongly typed network (FP8 stays FP8 through
its explicit Q/DQ), given two optimisation profiles (0: prefill, 1: decode) and built; the engines
and their record go to ART/engines/<gpu>/. Engines whose record still fits (same GPU, TensorRT,
manifest and settings, files intact) and whose TensorRT copy of the graph is unchanged are kept, so
an interrupted build resumes.

Needs TensorRT (and for the plugins torch with CUDA; for the AOT kernels triton); imports them lazily.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Callable

from ..core.cache_format import PAGE_SIZE
from ..core.errors import K2Error
from ..core.manifest import load_manifest, sha256_file
from ..core.tensorrt.engine_record import check_record, engines_dir, make_record, read_record, write_record
from ..core.tensorrt.environment import detect_gpu, parse_gpu_option, require_tensorrt

PROFILES = ("prefill", "decode")  # optimisation profile 0 and 1 of every engine


def profile_shapes(shape: list, profile: str, max_batch: int, max_seq: int) -> tuple[tuple, tuple, tuple]:
    """(min, opt, max) of one input whose manifest shape names its dynamic dims batch, seq, table (pages per row)
    and pages (the cache's pool: at most max_batch rows of max_seq positions)."""
    table = -(-max_seq // PAGE_SIZE)
    pages = (1, max_batch * table, max_batch * table)
    ranges = {
        "prefill": {"batch": (1, 1, max_batch), "seq": (1, min(128, max_seq), max_seq), "table": (0, 0, table),
                    "pages": pages},
        "decode": {"batch": (1, max_batch, max_batch), "seq": (1, 1, 1), "table": (0, table // 2, table),
                   "pages": pages},
    }[profile]
    dims = []
    for dim in shape:
        if isinstance(dim, int):
            dims.append((dim, dim, dim))
        elif dim in ranges:
            dims.append(ranges[dim])
        else:
            raise K2Error(f"input dimension {dim!r} has no optimisation-profile range (known: batch, seq, table, pages)")
    return tuple(tuple(d[i] for d in dims) for i in range(3))


def build_engines(artifact: str | Path, gpu: str = "auto", max_batch: int = 8, max_seq: int = 4096,
                  workspace_gb: float | None = None, aot: bool = True, verbose: bool = False,
                  on_graph: Callable[[str, str], None] = lambda stem, what: None) -> dict:
    """Builds (or keeps) every graph's engine; returns the engine record."""
    artifact = Path(artifact)
    if max_batch < 1 or max_seq < 1:
        raise K2Error("--max-batch and --max-seq must be at least 1")
    trt = require_tensorrt()
    manifest = load_manifest(artifact, verify_hashes=False)
    if not manifest.data.get("complete"):
        start, stop = manifest.graphs["layer_range"]
        raise K2Error(f"{artifact} holds only layers {start}:{stop}; export the whole model to build engines")
    if max_seq > manifest.config.max_position_embeddings:
        raise K2Error(f"--max-seq {max_seq} exceeds the model's {manifest.config.max_position_embeddings} positions")
    if aot and importlib.util.find_spec("triton") is None:
        raise K2Error("the ahead-of-time plugin kernels need triton: pip install triton, or pass --no-aot "
                      "(the engines then need the Python plugins at run time)")
    info = detect_gpu(parse_gpu_option(gpu))
    _set_device(info.index)

    from .tensorrt_graph import graph_entries, tensorrt_copies
    from ..plugins.tensorrt.registration import plugin_modes, register

    register(aot=aot)
    copies = tensorrt_copies(manifest, aot=aot)
    out = engines_dir(artifact, info)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"max_batch": max_batch, "max_seq": max_seq, "workspace_gb": workspace_gb, "aot": aot,
                "profiles": list(PROFILES), "strongly_typed": True}
    previous = _reusable(out, info, trt.__version__, manifest, settings)
    logger = trt.Logger(trt.Logger.INFO if verbose else trt.Logger.WARNING)
    engines = {}
    for entry in graph_entries(manifest):
        stem = Path(entry["file"]).stem
        onnx_path = artifact / copies[stem]["file"]
        engines[stem] = {"engine": f"{stem}.engine", "onnx": copies[stem]["file"],
                         "onnx_sha256": sha256_file(onnx_path),  # the graph its engine was built from
                         "inputs": [i["name"] for i in entry["inputs"]],
                         "outputs": [o["name"] for o in entry["outputs"]]}
        if previous.get(stem, {}).get("onnx_sha256") == engines[stem]["onnx_sha256"]:
            on_graph(stem, "kept")
            continue
        started = time.perf_counter()
        plan = _build_one(trt, logger, onnx_path, entry, settings)
        partial = out / f".{stem}.engine.partial"
        with open(partial, "wb") as f:
            f.write(plan)
        os.replace(partial, out / f"{stem}.engine")
        on_graph(stem, f"built in {time.perf_counter() - started:.1f} s")
    record = make_record(info, trt.__version__, manifest.digest, engines, settings, plugin_modes(aot), out)
    write_record(out, record)
    record["directory"] = str(out)
    return record


def _reusable(out: Path, info, version: str, manifest, settings: dict) -> dict:
    """The engines of an earlier build here that still fit (same GPU, TensorRT, export and settings; files
    intact), by stem; each is kept if its TensorRT copy of the graph is also unchanged."""
    try:
        old = read_record(out)
        check_record(old, info, version, manifest.digest, manifest.root, out)
    except K2Error:
        return {}
    return old.get("engines", {}) if old.get("settings") == settings else {}


def network_flags(trt, aot: bool) -> int:
    """Strongly typed (FP8 through explicit Q/DQ; TensorRT 11 is always so), and which implementation of a
    plugin with both (AOT and Python) the network takes, which TensorRT otherwise asks for."""
    flags = 0
    kinds = trt.NetworkDefinitionCreationFlag
    for name in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS" if aot else "PREFER_JIT_PYTHON_PLUGINS"):
        flag = getattr(kinds, name, None)
        if flag is not None:
            flags |= 1 << int(flag)
    return flags


def _build_one(trt, logger, onnx_path: Path, entry: dict, settings: dict) -> bytes:
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt, settings["aot"]))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        first = errors[0] if errors else "no reason given"
        raise K2Error(f"TensorRT's ONNX parser refused {onnx_path.name}: {first}{more}")
    config = builder.create_builder_config()
    if settings["workspace_gb"]:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(settings["workspace_gb"] * (1 << 30)))
    specs = {i["name"]: i for i in entry["inputs"]}
    for profile_name in PROFILES:
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            if name not in specs:
                raise K2Error(f"{onnx_path.name}: network input {name!r} is not in the manifest")
            profile.set_shape(name, *profile_shapes(specs[name]["shape"], profile_name, settings["max_batch"],
                                                    settings["max_seq"]))
        if config.add_optimization_profile(profile) != PROFILES.index(profile_name):
            raise K2Error(f"{onnx_path.name}: TensorRT refused the {profile_name} optimisation profile")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise K2Error(f"TensorRT could not build an engine from {onnx_path.name}; run with --verbose for its log")
    return bytes(plan)


def _set_device(index: int) -> None:
    try:
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            from cuda import cudart
    except ImportError:  # without cuda-python TensorRT uses the current device
        if index:
            raise K2Error("--gpu N needs cuda-python (pip install cuda-python)") from None
        return
    if int(cudart.cudaSetDevice(index)[0]) != 0:
        raise K2Error(f"cannot use CUDA device {index}: cudaSetDevice failed")
