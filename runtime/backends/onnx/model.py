"""Runs an artifact's graphs with ONNX Runtime: one session per graph, stitched here.

No torch: the custom nodes run as the model-local ONNX functions the artifact carries.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from ....core.cache_format import PAGE_SIZE, CacheFormat
from ....core.errors import K2Error
from ....core.manifest import Manifest
from ....core.targets import artifact_target
from ...cache.slots import CacheView, SlotView
from ..interface import InProcess
from .host_pages import HostCache
from .thread_pool import process_threads, session_options

# ONNX Runtime folds a Transpose feeding a MatMul into a FusedMatMul with transposed batches: measured 5-10%
# slower per layer than the plain MatMul after the transpose (benchmarks/decode_latency.py, small preset)
DISABLED_OPTIMIZERS = ["MatmulTransposeFusion"]
LOAD_ERRORS = (ort_state.Fail, ort_state.InvalidArgument, ort_state.InvalidGraph, ort_state.InvalidProtobuf,
               ort_state.NoSuchFile, ort_state.NotImplemented, ort_state.RuntimeException)
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def resolve_provider(name: str, device_id: int | None = None) -> list:
    """ONNX Runtime's providers for `name`, on GPU `device_id` where one is given."""
    if name not in PROVIDERS:
        raise K2Error(f"unknown provider {name!r}; choose one of {', '.join(PROVIDERS)}")
    available = ort.get_available_providers()
    if PROVIDERS[name] not in available:
        raise K2Error(f"provider {name} is not available in this onnxruntime (it offers {', '.join(available)}); "
                      f"install onnxruntime-gpu for cuda and tensorrt")
    if name == "cpu":
        return [PROVIDERS[name]]
    chosen = (PROVIDERS[name], {"device_id": device_id}) if device_id is not None else PROVIDERS[name]
    return [chosen, "CPUExecutionProvider"]


ORT_TYPES = {"tensor(float)": "FLOAT", "tensor(float16)": "FLOAT16", "tensor(bfloat16)": "BFLOAT16",
             "tensor(float8e4m3fn)": "FLOAT8E4M3FN", "tensor(uint8)": "UINT8", "tensor(int8)": "INT8",
             "tensor(int64)": "INT64", "tensor(int32)": "INT32", "tensor(bool)": "BOOL"}


def check_against_graphs(manifest: Manifest, loaded: list) -> None:
    """The manifest's own content (graph inputs and outputs, model dims, cache format) against the hashed graphs it
    describes: an edited or mixed manifest is a one-line K2Error, not a wrong answer or a traceback later."""
    config, kv = manifest.config, manifest.kv_cache

    def refuse(entry: dict, what: str) -> None:
        raise K2Error(f"{manifest.root}: manifest.json does not describe {entry['file']}: {what}; the manifest was "
                      f"edited or mixes artifacts, re-export it")

    expected_dims = {"hidden": {-1: config.hidden_size}, "hidden_out": {-1: config.hidden_size},
                     "latent_pages": {1: PAGE_SIZE, -1: kv["latent_dim"]}, "new_latent": {-1: kv["latent_dim"]},
                     "rope_pages": {1: PAGE_SIZE, -1: kv["rope_dim"]}, "new_rope": {-1: kv["rope_dim"]},
                     "logits": {-1: config.vocab_size}}
    latent = CacheFormat.for_artifact(kv, config, manifest.root).arrays[0]
    latent_types = {"latent_pages": latent.pages_type, "new_latent": latent.onnx_type}
    for entry, session in loaded:
        declared = [(v["name"], v["dtype"]) for v in entry["inputs"]] + [(v["name"], v["dtype"]) for v in entry["outputs"]]
        actual = [(a.name, ORT_TYPES.get(a.type, a.type)) for a in (*session.get_inputs(), *session.get_outputs())]
        if declared != actual:
            refuse(entry, f"it takes and gives {actual}, the manifest says {declared}")
        for arg in (*session.get_inputs(), *session.get_outputs()):
            for axis, size in expected_dims.get(arg.name, {}).items():
                if arg.shape[axis] != size:
                    refuse(entry, f"{arg.name} has {arg.shape[axis]} at axis {axis}, the manifest's config says {size}")
            if arg.name in latent_types and ORT_TYPES.get(arg.type) != latent_types[arg.name]:
                refuse(entry, f"{arg.name} is {ORT_TYPES.get(arg.type, arg.type)}, the manifest's cache format "
                              f"{kv['format']!r} needs {latent_types[arg.name]}")


class OrtModel(HostCache, InProcess):
    """The embedding, decoder layers and head of one artifact, ready to run; or, as a pipeline stage, a range of
    its decoder layers (with the embedding when it starts at layer 0, the head when it ends at the last)."""

    def __init__(self, manifest: Manifest, provider: str = "cpu", threads: int | None = None,
                 layers: range | None = None, device_id: int | None = None, host_share: int = 1,
                 decode_kernels: str = "onnx", embed: bool = True):
        """threads: the process's intra-op pool (None: the pool there is, else this host's physical cores divided
        by host_share, the number of processes running stages on it). decode_kernels: why the graphs decode, as
        `generate`, `bench` and `serve` report it (runtime/backends/native/choice.py says where the native step runs
        instead). embed False: no embedding session even where the range starts at layer 0 (a layer run alone)."""
        if not manifest.data.get("complete"):
            start, stop = manifest.graphs["layer_range"]
            raise K2Error(f"{manifest.root} holds only layers {start}:{stop}; export the whole model to run it")
        self.manifest = manifest
        self.config = manifest.config
        self.kv_cache = manifest.kv_cache
        artifact_target(manifest.data).check_runnable("onnxruntime", provider)
        self.providers = resolve_provider(provider, device_id)
        self.options = session_options(threads, host_share)
        self.threads = process_threads()
        entries = manifest.graphs["layers"]
        self.layers = layers if layers is not None else range(len(entries))
        self.first, self.last = self.layers.start == 0, self.layers.stop == len(entries)
        first_layer = manifest.graphs["layer_range"][0]
        self.embed_session = self._session("embed") if self.first and embed else None
        self.layer_sessions = [self._session(f"layer_{first_layer + i:03d}") for i in self.layers]
        self.head_session = self._session("head") if self.last else None
        self.stage_seconds: dict[str, float] = defaultdict(float)  # cumulative time per stage, for benchmarks
        self.salt = manifest.digest.encode()  # keys the cache's prefix hashes to this artifact
        self.decode_kernels = decode_kernels

    def _session(self, name: str) -> ort.InferenceSession:
        """The graph `name` loaded into a session, its inputs and outputs checked against the manifest."""
        path = self.manifest.graph_file(name)
        try:
            session = ort.InferenceSession(str(path), self.options, providers=self.providers,
                                           disabled_optimizers=DISABLED_OPTIMIZERS)
        except LOAD_ERRORS as exc:
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise K2Error(f"{path}: ONNX Runtime cannot load this graph ({reason}); re-export the artifact") from None
        check_against_graphs(self.manifest, [(self.manifest.graph_entry(name), session)])
        return session

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView) -> np.ndarray:
        """token_ids, positions, valid [b, s] (rows right-padded) -> hidden [b, s, m]; the view's rows gain the
        valid entries (each row holds exactly positions[i, 0] tokens; its pages are reserved for the new ones)."""
        return self.run(token_ids, positions, valid, view.entries())

    def run(self, inputs: np.ndarray, positions: np.ndarray, valid: np.ndarray, entries: CacheView) -> np.ndarray:
        """As forward, through the entries' view. A stage that does not start at layer 0 takes the previous
        stage's hidden [b, s, m] in place of token ids."""
        if self.first:
            started = time.perf_counter()
            hidden = self.embed_session.run(None, {"token_ids": inputs})[0]
            self._timed("embed", started)
        else:
            hidden = np.ascontiguousarray(inputs, dtype=np.float32)
        new_entries = entries.new_entries(positions)
        for layer in range(self.num_layers):
            started = time.perf_counter()
            hidden = self.run_layer(layer, hidden, positions, entries, new_entries)
            entries.store(layer, positions, valid)
            self._timed(f"layer_{self.layers.start + layer:03d}", started)
        return hidden

    def run_layer(self, layer: int, hidden: np.ndarray, positions: np.ndarray, entries: CacheView,
                  new_entries: dict) -> np.ndarray:
        """One layer graph (of this model's range) -> hidden_out [b, s, m]; its new cache entries land in
        new_entries (`entries.new_entries`), not yet in their pages."""
        session = self.layer_sessions[layer]
        binding = session.io_binding()
        binding.bind_cpu_input("hidden", hidden)
        binding.bind_cpu_input("positions", positions)
        for name, value in entries.past_inputs(layer).items():
            binding.bind_ortvalue_input(name, value)
        out = np.empty_like(hidden)
        binding.bind_ortvalue_output("hidden_out", ort.OrtValue.ortvalue_from_numpy(out))
        for name, value in new_entries.items():
            binding.bind_ortvalue_output(name, value)
        session.run_with_iobinding(binding)
        return out

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [b, s, m] -> logits [b, s, vocab] float32 (on the stage that ends at the last layer)."""
        started = time.perf_counter()
        logits = self.head_session.run(None, {"hidden": hidden})[0]
        self._timed("head", started)
        return logits

    def _timed(self, stage: str, started: float) -> None:
        self.stage_seconds[stage] += time.perf_counter() - started
