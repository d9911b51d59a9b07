"""`k2deploy export`: a checkpoint in, an artifact directory out.

ART/
  graphs/embed.onnx + .data, graphs/layer_000.onnx + .data, ..., graphs/head.onnx + .data
                        (and the files the target's passes derive from each graph, such as the TensorRT
                        copies graphs/<stem>.tensorrt.onnx: export/passes.py)
  tokenizer/            the checkpoint's tokenizer files, unchanged
  manifest.json         written last, atomically: without it the artifact does not load

Each graph is renamed into place only when complete and then recorded in a journal, so an
interrupted export resumes with its finished graphs kept. Decoder layers of one structure
(dense or MoE) share one trace; every layer keeps its own weights in its own .data file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..core.cache_format import NAMES as CACHE_NAMES
from ..core.cache_format import PAGE_SIZE, CacheFormat
from ..core.checkpoint import layout
from ..core.checkpoint.identity import changed, checkpoint_identity
from ..core.checkpoint.reader import Checkpoint
from ..core.config import ModelConfig
from ..core.errors import K2Error
from ..core.placement import format_bytes
from ..core.json_files import loads, write_json_atomically
from ..core.manifest import FORMAT, FORMAT_VERSION, MANIFEST_FILE, file_record
from ..core.targets import default_target, get_target
from ..core.tokenizer_files import TOKENIZER_FILES, describe_tokenizer, load_tokenizer, tokenizer_kind
from .. import plugins
from . import graph_modules as gm
from .passes import WEIGHT_CHOICES, Lowering, Pieces, weight_layout
from .weight_formats import weight_formats
from .onnx_graph import TracingError, io_spec, trace, write_graph

GRAPH_DIR = "graphs"
TOKENIZER_DIR = "tokenizer"
JOURNAL_FILE = ".export-journal.json"
DEFAULT_OPSET = 21  # FP8 Reshape/Transpose and blocked quantisation need 21
SUPPORTED_OPSETS = range(21, 25)  # each exported and run end to end in tests/test_export_refusals.py


@dataclass(frozen=True)
class ExportOptions:
    checkpoint: str
    kv_cache: str | None = None  # fp8, int8 or bf16; None: the target's default (int8 on cpu, else fp8)
    layers: tuple[int, int] | None = None  # [start, stop) of decoder layers; None: the whole model
    opset: int = DEFAULT_OPSET
    target: str = field(default_factory=default_target)  # cpu, cuda or tensorrt: see core/targets.py
    weights: str = "checkpoint"  # checkpoint: the experts as stored; int4: FP8 experts re-quantised to INT4 (passes.py)


@dataclass(frozen=True)
class GraphJob:
    stem: str  # file name without extension, under graphs/
    kind: str  # embed, dense, moe, head
    layer: int | None = None


def plan(config: ModelConfig, layers: tuple[int, int] | None) -> list[GraphJob]:
    """The graphs to write: the given decoder layers, with embedding and head when that is every layer."""
    start, stop = layers or (0, config.num_hidden_layers)
    jobs = [GraphJob(f"layer_{i:03d}", "moe" if config.is_moe_layer(i) else "dense", i) for i in range(start, stop)]
    if (start, stop) == (0, config.num_hidden_layers):
        jobs = [GraphJob("embed", "embed"), *jobs, GraphJob("head", "head")]
    return jobs


def _meta(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def trace_kind(config: ModelConfig, kind: str, cache_format: str, opset: int, target: str,
               weights: str = "checkpoint"):
    """Traces one graph structure on the meta device: -> (ir.Model, derived initializers)."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("seq", min=1, max=config.max_position_embeddings)
    table = torch.export.Dim("table", min=0, max=-(-config.max_position_embeddings // PAGE_SIZE))
    pages = torch.export.Dim("pages", min=1, max=1 << 40)
    b, s, n, pages_example = 2, 3, 5, 7  # distinct example sizes, so that no dimension is specialised
    with torch.device("meta"):
        if kind == "embed":
            module = gm.ExportEmbedding(config)
            traced = trace(module, (_meta((b, s), torch.int64),), {"token_ids": {0: batch, 1: seq}},
                           ["token_ids"], ["hidden"], opset)
            return traced, {}
        if kind == "head":
            module = gm.ExportHead(config, target)
            traced = trace(module, (_meta((b, s, config.hidden_size)),), {"hidden": {0: batch, 1: seq}},
                           ["hidden"], ["logits"], opset)
            return traced, {}
        layer = config.first_k_dense_replace if kind == "moe" else 0
        module = gm.ExportLayer(config, layer, cache_format, target, weights).eval()
    fmt = CacheFormat.for_config(config, cache_format)
    args = [_meta((b, s, config.hidden_size)), _meta((b, s), torch.int64), _meta((b, n), torch.int64)]
    names = ["hidden", "positions", "page_table"]
    outputs = ["hidden_out"]
    for array in fmt.arrays:
        args.append(_meta((pages_example, PAGE_SIZE, array.width), gm.pages_dtype(cache_format, array)))
        names.append(f"{array.name}_pages")
        outputs.append(f"new_{array.name}")
    dims = {"hidden": {0: batch, 1: seq}, "positions": {0: batch, 1: seq}, "page_table": {0: batch, 1: table},
            **{f"{array.name}_pages": {0: pages} for array in fmt.arrays}}
    traced = trace(module, tuple(args), {n: dims[n] for n in names}, names, outputs, opset)
    return traced, module.derived_initializers()


class Journal:
    """Finished graphs of an export in progress, with the options and the checkpoint files (their identity:
    core/checkpoint/identity.py) they were made from; graphs of other options or other files are not kept
    (`discarded` says why)."""

    def __init__(self, out: Path, options: ExportOptions, source: dict):
        self.path = out / JOURNAL_FILE
        self.options, self.source, self.discarded = asdict(options), source, None
        try:
            data = loads(self.path.read_text()) if self.path.exists() else {}
            if not isinstance(data, dict) or not isinstance(data.get("done", {}), dict):
                raise ValueError("not an object of finished graphs")
        except (ValueError, UnicodeDecodeError) as exc:
            raise K2Error(f"{self.path}: the export journal is corrupt ({exc}); rerun export with --force to "
                          f"start over") from None
        self.done: dict = data.get("done", {}) if data.get("options") == json.loads(json.dumps(self.options)) else {}
        moved = changed(data.get("checkpoint") if isinstance(data.get("checkpoint"), dict) else {}, source)
        if self.done and moved:
            self.done, self.discarded = {}, f"the checkpoint's files changed since ({moved})"

    def finished(self, job: GraphJob, out: Path) -> bool:
        records = self.done.get(job.stem)
        return bool(records) and all((out / f).exists() and (out / f).stat().st_size == r["bytes"] for f, r in records.items())

    def record(self, job: GraphJob, records: dict) -> None:
        self.done[job.stem] = records
        self.save()

    def save(self) -> None:
        """Written before the export writes anything else: the folder is this export's from then on (a rerun
        resumes it, where a folder of other files is refused)."""
        write_json_atomically(self.path, {"options": self.options, "checkpoint": self.source, "done": self.done})


def export_artifact(options: ExportOptions, out: Path, force: bool = False,
                    on_progress: Callable[[int, str], None] = lambda n, what: None,
                    on_total: Callable[[int], None] = lambda n: None,
                    on_graph: Callable[[dict], None] = lambda event: None) -> dict:
    """Runs the whole export; returns the manifest. on_progress(bytes, what) reports streamed weight bytes;
    on_graph gets {"reused", "to_write", "tokenizer" (one line: what was found)} once, then {"stem", "bytes", "seconds", "done_bytes"} per graph written,
    where done_bytes counts the checkpoint bytes of the graphs finished so far (the unit of on_total)."""
    target = get_target(options.target)
    if options.opset not in SUPPORTED_OPSETS:
        raise K2Error(f"--opset {options.opset} is not supported; choose {SUPPORTED_OPSETS.start} to "
                      f"{SUPPORTED_OPSETS.stop - 1} (default {DEFAULT_OPSET})")
    _refuse_out_in_checkpoint(Path(options.checkpoint), out)
    if options.kv_cache is None:
        options = replace(options, kv_cache=target.default_cache)
    if options.kv_cache not in CACHE_NAMES:
        raise K2Error(f"--kv-cache must be one of {', '.join(CACHE_NAMES)}, got {options.kv_cache!r}")
    target.check_cache(options.kv_cache)
    checkpoint = Checkpoint.open(options.checkpoint)
    config = checkpoint.config
    tokenizer = _check_tokenizer(Path(options.checkpoint), config.vocab_size)
    _check_weight_format(config, options)
    if options.layers is not None:
        start, stop = options.layers
        if start >= stop:
            raise K2Error(f"--layers {start}:{stop} is empty; give START below STOP, e.g. {start}:{start + 1}")
        if not 0 <= start < stop <= config.num_hidden_layers:
            raise K2Error(f"--layers {start}:{stop} is outside the model's layers 0:{config.num_hidden_layers}")
    _prepare(out, force)
    source = checkpoint_identity(Path(options.checkpoint), ["config.json", *(p.name for p in checkpoint.shards())])
    journal = Journal(out, options, source)
    journal.save()
    graphs_dir = out / GRAPH_DIR
    graphs_dir.mkdir(parents=True, exist_ok=True)
    jobs = plan(config, options.layers)
    _check_scales(checkpoint, jobs)
    remaining = sum(_job_bytes(checkpoint, job) for job in jobs if not journal.finished(job, out))
    free = shutil.disk_usage(out).free
    if free < remaining * 1.05:  # the int8 lowering writes about the checkpoint's bytes too
        raise K2Error(f"{out}: {format_bytes(free)} free, the export needs about {format_bytes(remaining)} more; "
                      f"free some space and rerun (finished graphs are kept)")
    on_total(remaining)
    reused = sum(journal.finished(job, out) for job in jobs)
    on_graph({"reused": reused, "to_write": len(jobs) - reused, "tokenizer": tokenizer,
              "notes": _weight_notes(config, options), "discarded": journal.discarded})

    lowering = Lowering(options.target, options.weights)
    traces: dict[str, tuple] = {}
    done_bytes = 0
    for job in jobs:
        if journal.finished(job, out):
            continue
        started = time.perf_counter()
        if job.kind not in traces:
            try:
                traces[job.kind] = trace_kind(config, job.kind, options.kv_cache, options.opset, options.target,
                                              options.weights)
            except TracingError as error:
                raise K2Error(f"export stopped, nothing written for {job.stem}: {error}") from None
        model, derived = traces[job.kind]
        traced = _traced_pieces(config, checkpoint, job, derived)
        pieces = lowering.pieces(config, checkpoint, job.kind, job.layer, traced)  # the target's passes in turn
        label = job.stem if job.layer is None else f"layer {job.layer + 1}/{config.num_hidden_layers}"
        records = write_graph(model, plugins.onnx_functions(config), graphs_dir, job.stem, pieces,
                              on_bytes=lambda n, label=label: on_progress(n, label))
        records.update(lowering.graph_files(graphs_dir, job.stem))
        journal.record(job, {f"{GRAPH_DIR}/{name}": record for name, record in records.items()})
        done_bytes += _job_bytes(checkpoint, job)
        on_graph({"stem": job.stem, "bytes": sum(r["bytes"] for r in records.values()),
                  "seconds": time.perf_counter() - started, "done_bytes": done_bytes})

    tokenizer_files = _copy_tokenizer(Path(options.checkpoint), out)
    manifest = _manifest(options, config, jobs, traces, journal, tokenizer_files, out)
    write_json_atomically(out / MANIFEST_FILE, manifest)
    journal.path.unlink()
    return manifest


def _traced_pieces(config: ModelConfig, checkpoint: Checkpoint, job: GraphJob,
                   derived: dict[str, np.ndarray]) -> Pieces:
    """An initializer's bytes as the traced modules hold it, before the target's passes: a derived table, a weight
    every target computes (export/graph_modules.py `computed_pieces`), else a copy of checkpoint tensors."""
    def pieces(name: str):
        if name in derived:
            return [derived[name]]
        computed = gm.computed_pieces(config, checkpoint, job.layer, name) if job.layer is not None else None
        if computed is not None:
            return computed
        return (chunk for source in gm.initializer_sources(config, job.kind, job.layer, name)
                for chunk in checkpoint.stream(source))
    return pieces


def _check_weight_format(config: ModelConfig, options: ExportOptions) -> None:
    """FP8 checkpoints export for every target; INT4 ones (routed experts INT4, the rest BF16) where ONNX Runtime's
    4-bit QMoE runs their experts."""
    if config.fp8_block is None and config.int4 is None:
        raise K2Error(f"{options.checkpoint}: export needs FP8 or INT4 weights (a quantization_config); this "
                      f"checkpoint is BF16")
    if options.weights not in WEIGHT_CHOICES:
        raise K2Error(f"--weights must be one of {', '.join(WEIGHT_CHOICES)}, got {options.weights!r}")
    if options.weights == "int4" and config.int4 is None and options.target == "tensorrt":
        raise K2Error("--weights int4: INT4 experts have no TensorRT plugin in this version; export with --target "
                      "cuda or cpu")
    if config.int4 is None:
        return
    quantised = [s.name for s in layout.all_tensors(config) if s.role == "int4" and not layout.is_routed_expert(s.name)]
    if quantised:
        raise K2Error(f"{options.checkpoint}: {quantised[0].removesuffix('.weight_packed')} is INT4; this export "
                      f"lowers INT4 routed experts only (the rest must be BF16, as in Kimi-K2-Thinking)")
    if options.target == "tensorrt":
        raise K2Error("INT4 experts have no TensorRT plugin in this version (TensorRT's INT4 weight-only kernels "
                      "take fixed weights, not routed experts); export this checkpoint with --target cuda (ONNX "
                      "Runtime's 4-bit QMoE) or --target cpu")


def _weight_notes(config: ModelConfig, options: ExportOptions) -> list[str]:
    """What the user should know of how the chosen target runs 4-bit experts."""
    if options.target != "cuda" or (config.int4 is None and options.weights != "int4"):
        return []
    return ["the 4-bit experts run as a float32 QMoE node, which ONNX Runtime's CUDA provider has no kernel for "
            "(its QMoE takes float16 activations and CUTLASS-prepacked weights, which this version does not write): "
            "ONNX Runtime places that node on its CPU provider, exact but not on the GPU"]


def _check_scales(checkpoint: Checkpoint, jobs: list[GraphJob]) -> None:
    """Every FP8 block scale the export will copy is finite: a NaN or inf scale turns its whole block into NaN."""
    for job in jobs:
        if job.layer is None:
            continue
        try:
            checkpoint.check_quantised(checkpoint.layer_names(job.layer))
        except K2Error as error:
            raise K2Error(f"{error}; nothing was exported") from None


def _refuse_out_in_checkpoint(checkpoint: Path, out: Path) -> None:
    source, target = checkpoint.resolve(), out.resolve()
    if target == source or target.is_relative_to(source):
        raise K2Error(f"--out {out} is the checkpoint folder or inside it; write the artifact elsewhere")


def _check_tokenizer(checkpoint: Path, vocab_size: int) -> str:
    """A tokenizer the runtime will load is loaded now (where its library is installed), so that a broken one
    fails the export, not generate; returns one line saying what was and was not found."""
    kind = tokenizer_kind(checkpoint)
    if kind is not None and importlib.util.find_spec(kind) is not None:  # the kind is its library's name
        load_tokenizer(checkpoint, vocab_size)  # a K2Error naming the file when it is broken
    return describe_tokenizer(checkpoint)


def _prepare(out: Path, force: bool) -> None:
    """`out` made ready: new or empty, an unfinished export's (resumed), or with --force an artifact's, whose own
    files (those its manifest lists, then the manifest) are removed; a folder holding anything else is refused, so
    that no file the export did not write is replaced or removed."""
    if out.exists() and not out.is_dir():
        raise K2Error(f"{out} exists and is not a directory")
    listed = _artifact_files(out)
    if listed is not None:
        if not force:
            raise K2Error(f"{out} already holds an exported artifact; pass --force to export again")
        (out / MANIFEST_FILE).unlink()  # from here on the old artifact no longer loads
        for name in listed:  # files and links only: a folder the manifest names is not removed
            if (out / name).is_symlink() or (out / name).is_file():
                (out / name).unlink()
        (out / JOURNAL_FILE).unlink(missing_ok=True)
    elif out.is_dir() and not (out / JOURNAL_FILE).is_file():
        foreign = next(iter(sorted(out.iterdir())), None)
        if foreign is not None:
            raise K2Error(f"{out} is not empty and holds no artifact ({foreign.name} is in it); export into a new or "
                          f"empty folder (--force replaces only an artifact)")
    out.mkdir(parents=True, exist_ok=True)


def _artifact_files(out: Path) -> list[str] | None:
    """The files an artifact's manifest in `out` lists (its own names, inside `out`), or None where `out` holds no
    manifest of an artifact (a manifest.json that is not one is not taken for one)."""
    try:
        data = loads((out / MANIFEST_FILE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("files"), dict)):
        return None
    inside = out.resolve()
    return [name for name in data["files"] if isinstance(name, str) and (out / name).resolve().is_relative_to(inside)
            and (out / name).resolve() != inside]


def _job_bytes(checkpoint: Checkpoint, job: GraphJob) -> int:
    if job.kind == "embed":
        return checkpoint.entries["model.embed_tokens.weight"].nbytes
    if job.kind == "head":
        return checkpoint.entries["model.norm.weight"].nbytes + checkpoint.entries["lm_head.weight"].nbytes
    return checkpoint.layer_bytes(job.layer)


def _copy_tokenizer(checkpoint: Path, out: Path) -> list[str]:
    target = out / TOKENIZER_DIR
    target.mkdir(exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (checkpoint / name).exists():
            shutil.copyfile(checkpoint / name, target / f".{name}.partial")
            (target / f".{name}.partial").replace(target / name)
            copied.append(f"{TOKENIZER_DIR}/{name}")
    return copied


def _versions() -> dict:
    versions = {"python": platform.python_version()}
    for package in ("k2deploy", "torch", "onnx", "onnxscript", "onnx-ir", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _manifest(options: ExportOptions, config: ModelConfig, jobs: list[GraphJob], traces: dict,
              journal: Journal, tokenizer_files: list[str], out: Path) -> dict:
    files = {f: r for records in journal.done.values() for f, r in records.items()}
    files.update({f: file_record(out, f) for f in tokenizer_files})

    def describe(job: GraphJob) -> dict:
        model = traces[job.kind][0] if job.kind in traces else None
        entry = {"file": f"{GRAPH_DIR}/{job.stem}.onnx", "data": f"{GRAPH_DIR}/{job.stem}.data"}
        if job.layer is not None:
            entry.update(layer=job.layer, structure=job.kind)
        if model is not None:
            entry.update(inputs=io_spec(model.graph.inputs), outputs=io_spec(model.graph.outputs))
        return entry

    described = {job.stem: describe(job) for job in jobs}
    missing_io = [stem for stem, entry in described.items() if "inputs" not in entry]
    for stem in missing_io:  # resumed graphs: their structure's signature is the same as a traced one's
        kind = next(j.kind for j in jobs if j.stem == stem)
        model = trace_kind(config, kind, options.kv_cache, options.opset, options.target, options.weights)[0]
        described[stem].update(inputs=io_spec(model.graph.inputs), outputs=io_spec(model.graph.outputs))
    start, stop = options.layers or (0, config.num_hidden_layers)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "complete": "embed" in described,
        "model_config": config.to_dict(),
        "checkpoint": {"path": str(Path(options.checkpoint).resolve()), "index_sha256": _index_digest(Path(options.checkpoint)),
                       "files": {name: {k: v for k, v in record.items() if k in ("bytes", "sampled_blake3")}
                                 for name, record in journal.source.items()}},
        "kv_cache": CacheFormat.for_config(config, options.kv_cache).description(),
        "target": options.target,
        "weights": get_target(options.target).weights,
        "weight_layout": weight_layout(options.target),
        "weight_formats": weight_formats([out / GRAPH_DIR / f"{job.stem}.onnx" for job in jobs], config,
                                         options.target, options.weights),
        "opset": options.opset,
        "custom_ops": {"domain": plugins.DOMAIN, "version": plugins.VERSION,
                       "ops": [f.name for f in plugins.onnx_functions(config)],
                       "implementation": "model-local ONNX functions in every graph that uses them"},
        "graphs": {
            "embed": described.get("embed"),
            "layers": [described[j.stem] for j in jobs if j.layer is not None],
            "head": described.get("head"),
            "layer_range": [start, stop],
            "shared_traces": "decoder layers of one structure (dense, moe) share one traced graph; "
                             "each layer's .onnx carries its own weights in its own .data file",
        },
        "tokenizer": ({"dir": TOKENIZER_DIR, "kind": tokenizer_kind(Path(options.checkpoint)), "files": tokenizer_files}
                      if tokenizer_files else None),
        "files": dict(sorted(files.items())),
        "versions": _versions(),
    }


def _index_digest(checkpoint: Path) -> str | None:
    index = checkpoint / "model.safetensors.index.json"
    return hashlib.sha256(index.read_bytes()).hexdigest() if index.exists() else None
