"""Which kernels run a model on ONNX Runtime's provider, the native step (runtime/native_model.py) or the graphs
(runtime/ort_backend.py): `--decode native` asks for the native step (an error where it cannot run), `--decode
onnx` for the graphs, and `--decode auto` (the default) takes the native step where the artifact, provider and
host allow it and it measured no slower than the graphs here; each model says which and why (`decode_kernels`).

At the first use of an artifact with a thread count on a host, the artifact's own first decoder layer runs a few
decode positions through each (`time_first_layer`), and the faster one decodes. The figures are kept in the native
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

from ..core.errors import K2Error
from ..core.manifest import Manifest
from .native_build import NativeUnavailable, cache_dir
from .native_decode import DECODE_KERNELS, NativeDecoder
from .native_model import NativeModel
from .ort_backend import OrtModel
from .thread_pool import process_threads, yield_to_native_decode

WARMUP, TIMED = 3, 8  # decode positions run untimed, then timed, through each path
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
        native = NativeDecoder(manifest, process_threads(threads), manifest.config.max_position_embeddings)
    except NativeUnavailable as exc:
        if decode == "native":
            raise K2Error(f"the native decode step cannot run: {exc}; use --decode onnx") from None
        return OrtModel(manifest, provider, threads, decode_kernels=f"onnx (native: {exc})")
    why = "asked for"
    if decode == "auto":
        chosen, why = choose(OrtModel(manifest, provider, threads, layers=range(1)), native)
        if not chosen:
            return OrtModel(manifest, provider, threads, decode_kernels=f"onnx (native {native.isa}: {why})")
    yield_to_native_decode()
    return NativeModel(manifest, native, f"native ({native.isa}; {why})")


def time_first_layer(model: OrtModel, native: NativeDecoder) -> tuple[float, float]:
    """The median ms of one decode position of layer 0 through the native step and through its graph (`model` runs
    at least layer 0) -> (native, graphs); each from an empty cache of one page, positions 0, 1, 2, ... as decode
    would write them."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 1, model.config.hidden_size)).astype(np.float32)

    def timed(run) -> float:
        cache = model.new_cache(1, WARMUP + TIMED)
        times = []
        for position in range(WARMUP + TIMED):
            cache.reserve([0], [position + 1])
            view = cache.view([0]).entries()
            started = time.perf_counter()
            run(view, position)
            if position >= WARMUP:
                times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    def through_graph(view, position):
        positions = np.array([[position]], np.int64)
        model.run_layer(0, hidden, positions, view, view.new_entries(positions))

    def through_native(view, position):
        pools = {name: array[0] for name, array in view.pages.arrays.items()}
        native.layer_step(0, hidden, position, view.page_table[0], pools)

    return timed(through_native), timed(through_graph)


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


def measured(model: OrtModel, native: NativeDecoder, key: str) -> tuple[float, float, bool]:
    """(native ms, graphs ms, whether they were read from the cache) for `key`, measured and kept where the
    cache holds none."""
    path = cache_dir() / CHOICES
    kept = _figures(_read(path).get(key))
    if kept is not None:
        return (*kept, True)
    native_ms, graphs_ms = time_first_layer(model, native)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = {"native_ms": round(native_ms, 4), "graphs_ms": round(graphs_ms, 4)}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".partial") as handle:
            json.dump(data, handle, indent=1)
        os.replace(handle.name, path)
    except OSError:
        pass  # an unwritable cache folder: measured again at the next start
    return native_ms, graphs_ms, False


def choose(model: OrtModel, native: NativeDecoder) -> tuple[bool, str]:
    """Whether `native` runs the model rather than its graphs (`model`: at least its layer 0), and the reason in
    words."""
    key = f"{Path(native.lib._name).name}:{model.manifest.digest}:{native.threads}"
    native_ms, graphs_ms, kept = measured(model, native, key)
    figures = (f"layer 0 measured {native_ms:.3f} ms a position natively, {graphs_ms:.3f} ms through its graph"
               + (" (kept from an earlier run)" if kept else ""))
    if native_ms <= graphs_ms:
        return True, figures
    return False, f"slower than the graphs here: {figures}"
