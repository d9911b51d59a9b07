"""Which kernels run a model on ONNX Runtime's provider, the native step (runtime/backends/native/model.py) or the graphs
(runtime/backends/onnx/model.py): `--decode native` asks for the native step (an error where it cannot run), `--decode
onnx` for the graphs, and `--decode auto` (the default) takes the native step where the artifact, provider and
host allow it and it measured no slower than the graphs here; each model says which and why (`decode_kernels`).

At the first use of an artifact with a thread count on a host, the artifact's own first decoder layer runs a few
decode positions through its graph (`time_graph_layer`, the graph then let go) and through the native step
(`time_native_layer`), and the native step runs the model unless the graph measured faster by more than
NATIVE_MARGIN: closer than that the two are one speed to the measurement's precision (a real-size dense layer
measured 14.5 against 13.5 ms one start, 11.1 against 15.2 another, 13.1 against 9.2 a third), and the native step
holds each weight once where the graphs hold their prepacked copies too. Where the graphs would not fit the
available memory (`graphs_memory`: a real-size MoE layer's graph holds three copies of its weights while it loads,
where the native step maps one) nothing is timed and the native step runs the model. Where the graphs win, the native step's weights are let go before the graphs
load: the process never holds both. The figures are kept in the native
build's cache folder (`choices.json`, keyed by the library's build, the artifact's digest and the threads), so a
later start reads them instead; a file that does not parse, or holds anything but positive times, is measured
again and rewritten (written to a temporary name and renamed into place).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ....core.errors import K2Error
from ....core.host_memory import available_memory
from ....core.manifest import Manifest
from ...cache.slots import Cache, pages_for
from ..onnx.host_pages import LatentPages
from ..onnx.model import OrtModel, check_against_graphs
from ..onnx.thread_pool import process_threads, yield_to_native_decode
from .build import NativeUnavailable, cache_dir, library
from .decoder import DECODE_KERNELS, NativeDecoder
from .model import NativeModel

WARMUP, TIMED = 3, 8  # decode positions run untimed, then timed, through each path
NATIVE_MARGIN = 1.1  # the graphs run a model only where the native step measured over 10% slower
CHOICES = "choices.json"


def load_model(manifest: Manifest, provider: str = "cpu", threads: int | None = None,
               decode: str = "auto") -> OrtModel | NativeModel:
    """The whole model of an artifact on ONNX Runtime's `provider`, through the kernels `decode` asks for."""
    if decode not in DECODE_KERNELS:
        raise K2Error(f"unknown decode kernels {decode!r}; choose one of {', '.join(DECODE_KERNELS)}")
    if decode == "onnx":
        return OrtModel(manifest, provider, threads)
    try:
        if provider != "cpu":
            raise NativeUnavailable("it runs the whole model on the cpu provider")
        if not manifest.data.get("complete"):
            raise NativeUnavailable("it runs a whole model's artifact")
        NativeDecoder.check_target(manifest)  # before anything is loaded or timed
        check_against_graphs(manifest, [])  # the manifest's cache against its model, as the graphs' loading checks
        threads = process_threads(threads)
        key = f"{Path(library()._name).name}:{manifest.digest}:{threads}"
        kept = _figures(_read(cache_dir() / CHOICES).get(key)) if decode == "auto" else None
        need, available = graphs_memory(manifest), available_memory()
        unfit = None if available is None or need <= available else (
            f"the graphs would need about {need / 2**30:.1f} GiB to load and {available / 2**30:.1f} GiB is available")
        graphs_ms = None
        if decode == "auto" and kept is None and unfit is None:  # the graph timed and let go first: never both held
            graphs_ms = time_graph_layer(OrtModel(manifest, provider, threads, layers=range(1), embed=False))
        native = NativeDecoder(manifest, threads, manifest.config.max_position_embeddings)
    except NativeUnavailable as exc:
        if decode == "native":
            raise K2Error(f"the native decode step cannot run: {exc}; use --decode onnx") from None
        return OrtModel(manifest, provider, threads, decode_kernels=f"onnx (native: {exc})")
    why = "asked for"
    if decode == "auto" and unfit is not None:
        why = unfit  # nothing to time against
    elif decode == "auto":
        native_ms, graphs_ms = kept or (time_native_layer(native, manifest), graphs_ms)
        if kept is None:
            _keep(key, native_ms, graphs_ms)
        why = (f"layer 0 measured {native_ms:.3f} ms a position natively, {graphs_ms:.3f} ms through its graph"
               + (" (kept from an earlier run)" if kept else ""))
        if native_ms > graphs_ms * NATIVE_MARGIN:
            isa = native.isa
            del native  # its weights go before the graphs' load (a real-size artifact fits once, not twice)
            return OrtModel(manifest, provider, threads, decode_kernels=f"onnx (native {isa}: slower than "
                                                                        f"the graphs here: {why})")
    yield_to_native_decode()
    return NativeModel(manifest, native, f"native ({native.isa}; {why})")


def load_stage(manifest: Manifest, layers: range, provider: str = "cpu", threads: int | None = None,
               device_id: int | None = None, host_share: int = 1, decode: str = "auto") -> OrtModel | NativeModel:
    """A pipeline stage's range of layers: through the native step where it runs on the cpu provider and `decode`
    (auto or native) allows (each stage maps only its own layers' files, once; `auto` does not time the two here,
    as a whole model's first start does: the native step measured faster on every host it was timed on), else
    through the graphs. threads None: the host's cores divided among the `host_share` stage processes on it."""
    if decode not in DECODE_KERNELS:
        raise K2Error(f"unknown decode kernels {decode!r}; choose one of {', '.join(DECODE_KERNELS)}")
    why = "asked for"
    if decode != "onnx":
        try:
            if provider != "cpu":
                raise NativeUnavailable("it runs stages on the cpu provider")
            NativeDecoder.check_target(manifest)
            check_against_graphs(manifest, [])
            native = NativeDecoder(manifest, process_threads(threads, host_share),
                                   manifest.config.max_position_embeddings, layers)
            yield_to_native_decode()
            return NativeModel(manifest, native, f"native ({native.isa}; {'asked for' if decode == 'native' else 'auto'})")
        except NativeUnavailable as exc:
            if decode == "native":
                raise K2Error(f"the native decode step cannot run stage {layers.start}:{layers.stop}: {exc}; use "
                              f"--decode onnx") from None
            why = f"native: {exc}"
    return OrtModel(manifest, provider, threads, layers=layers, device_id=device_id, host_share=host_share,
                    decode_kernels=f"onnx ({why})")


def graphs_memory(manifest: Manifest) -> int:
    """Bytes the graphs of the whole model take to load, about: every graph's weights, and while the largest loads
    two more copies of it (ONNX Runtime reads its initializers, folds the tiles back into rows and prepacks)."""
    sizes = [manifest.data["files"][name]["bytes"] for name in manifest.graph_files()]
    return sum(sizes) + 2 * max(sizes, default=0)


def _timed(manifest: Manifest, run) -> float:
    """The median ms of run(view, position) over decode positions 0, 1, 2, ... of one sequence in a fresh cache of
    one layer (WARMUP untimed first), each position's page reserved as decode reserves it."""
    pages = pages_for(WARMUP + TIMED)
    cache = Cache(1, WARMUP + TIMED, pages, LatentPages(manifest.kv_cache, 1, pages), False, b"")
    times = []
    for position in range(WARMUP + TIMED):
        cache.reserve([0], [position + 1])
        view = cache.view([0]).entries()
        started = time.perf_counter()
        run(view, position)
        if position >= WARMUP:
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _hidden(manifest: Manifest) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((1, 1, manifest.config.hidden_size)).astype(np.float32)


def time_graph_layer(model: OrtModel) -> float:
    """The median ms of one decode position through layer 0's graph (`model` runs at least layer 0)."""
    hidden = _hidden(model.manifest)

    def through_graph(view, position):
        positions = np.array([[position]], np.int64)
        model.run_layer(0, hidden, positions, view, view.new_entries(positions))

    return _timed(model.manifest, through_graph)


def time_native_layer(native: NativeDecoder, manifest: Manifest) -> float:
    """The median ms of one decode position through the native step's layer 0."""
    hidden = _hidden(manifest)

    def through_native(view, position):
        pools = {name: array[0] for name, array in view.pages.arrays.items()}
        native.layer_step(0, hidden, position, view.page_table[0], pools)

    return _timed(manifest, through_native)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _figures(entry) -> tuple[float, float] | None:
    if not isinstance(entry, dict):
        return None
    figures = entry.get("native_ms"), entry.get("graphs_ms")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in figures):
        return float(figures[0]), float(figures[1])
    return None


def _keep(key: str, native_ms: float, graphs_ms: float) -> None:
    """The figures into the cache folder's CHOICES under `key` (the file rewritten whole, renamed into place)."""
    path = cache_dir() / CHOICES
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = {"native_ms": round(native_ms, 4), "graphs_ms": round(graphs_ms, 4)}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".partial") as handle:
            json.dump(data, handle, indent=1)
        os.replace(handle.name, path)
    except OSError:
        pass  # an unwritable cache folder: measured again at the next start
