"""Runs an artifact's graphs with ONNX Runtime: one session per graph, stitched here.

No torch: the custom nodes run as the model-local ONNX functions the artifact carries.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

from ..core.cache_format import PAGE_SIZE, CacheFormat
from ..core.errors import K2Error
from ..core.manifest import Manifest
from ..core.targets import artifact_target
from .cache import Cache, CacheView, SlotView, pages_for
from .kv_cache import LatentPages, LatentPagesView
from .decode_choice import choose
from .native_build import NativeUnavailable
from .native_decode import DECODE_KERNELS, NativeDecoder
from .thread_pool import process_threads, session_options, yield_to_native_decode

# ONNX Runtime folds a Transpose feeding a MatMul into a FusedMatMul with transposed batches: measured 5-10%
# slower per layer than the plain MatMul after the transpose (benchmarks/decode_latency.py, small preset)
DISABLED_OPTIMIZERS = ["MatmulTransposeFusion"]
LOAD_ERRORS = (ort_state.Fail, ort_state.InvalidArgument, ort_state.InvalidGraph, ort_state.InvalidProtobuf,
               ort_state.NoSuchFile, ort_state.NotImplemented, ort_state.RuntimeException)
NATIVE_BATCH = 128  # tokens a native step takes at most (a prompt's in turn): bounds its scratch
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
    if kv["latent_dim"] != config.kv_lora_rank or kv["rope_dim"] != config.qk_rope_head_dim:
        raise K2Error(f"{manifest.root}: manifest.json's kv_cache dims ({kv['latent_dim']}, {kv['rope_dim']}) are not its "
                      f"model's ({config.kv_lora_rank}, {config.qk_rope_head_dim}); re-export the artifact")
    latent = CacheFormat.from_manifest(kv).arrays[0]
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


class OrtModel:
    """The embedding, decoder layers and head of one artifact, ready to run; or, as a pipeline stage, a range of
    its decoder layers (with the embedding when it starts at layer 0, the head when it ends at the last)."""

    def __init__(self, manifest: Manifest, provider: str = "cpu", threads: int | None = None,
                 layers: range | None = None, device_id: int | None = None, host_share: int = 1,
                 decode: str = "auto"):
        """threads: the process's intra-op pool (None: the pool there is, else this host's physical cores divided
        by host_share, the number of processes running stages on it). decode: how a decode step (one token for each
        sequence of a batch) runs: "native" through runtime/native_decode.py (an error where it cannot), "onnx"
        through the graphs, "auto" natively where the artifact, provider and host allow it and the native step is
        not the slower here (runtime/decode_choice.py), else through the graphs (`decode_kernels` says which, and
        why)."""
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
        self.embed_session = self.head_session = None
        self.layer_sessions: list[ort.InferenceSession | None] = [None] * len(self.layers)
        self.stage_seconds: dict[str, float] = defaultdict(float)  # cumulative time per stage, for benchmarks
        self.salt = manifest.digest.encode()  # keys the cache's prefix hashes to this artifact
        self.native, self.decode_kernels = self._native_decoder(decode, provider)
        if self.native is None:  # the graphs run the model: every session loaded, and checked, now
            self._load_graphs()

    def _session(self, name: str) -> ort.InferenceSession:
        """The graph `name` loaded into a session, its inputs and outputs checked against the manifest."""
        path = self.manifest.graph_file(name)
        try:
            session = ort.InferenceSession(str(path), self.options, providers=self.providers,
                                           disabled_optimizers=DISABLED_OPTIMIZERS)
        except LOAD_ERRORS as exc:
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise K2Error(f"{path}: ONNX Runtime cannot load this graph ({reason}); re-export the artifact") from None
        entry = (self.manifest.graphs[name] if name in ("embed", "head")
                 else self.manifest.graphs["layers"][int(name.removeprefix("layer_")) - self.manifest.graphs["layer_range"][0]])
        check_against_graphs(self.manifest, [(entry, session)])
        return session

    def _layer_session(self, layer: int) -> ort.InferenceSession:
        """Layer `layer` of this model's range as a session, loaded at its first use."""
        if self.layer_sessions[layer] is None:
            self.layer_sessions[layer] = self._session(f"layer_{self.manifest.graphs['layer_range'][0] + self.layers[layer]:03d}")
        return self.layer_sessions[layer]

    def _load_graphs(self) -> None:
        if self.first and self.embed_session is None:
            self.embed_session = self._session("embed")
        for layer in range(len(self.layers)):
            self._layer_session(layer)
        if self.last and self.head_session is None:
            self.head_session = self._session("head")

    def _native_decoder(self, decode: str, provider: str) -> tuple[NativeDecoder | None, str]:
        if decode not in DECODE_KERNELS:
            raise K2Error(f"unknown decode kernels {decode!r}; choose one of {', '.join(DECODE_KERNELS)}")
        if decode == "onnx":
            return None, "onnx"
        try:
            if provider != "cpu" or not (self.first and self.last):
                raise NativeUnavailable("it runs the whole model on the cpu provider")
            native = NativeDecoder(self.manifest, self.threads, self.config.max_position_embeddings)
            why = "asked for"
            if decode == "auto":
                chosen, why = choose(self, native, self.threads)
                if not chosen:
                    return None, f"onnx (native {native.isa}: {why})"
                self.layer_sessions[0] = None  # loaded only to be timed: the native step runs the model
            yield_to_native_decode()
            return native, f"native ({native.isa}; {why})"
        except NativeUnavailable as exc:
            if decode == "native":
                raise K2Error(f"the native decode step cannot run: {exc}; use --decode onnx") from None
            return None, f"onnx (native: {exc})"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, batch: int, max_len: int, pages: int | None = None, prefix_cache: bool = True) -> Cache:
        """`batch` sequences of up to `max_len` positions over `pages` pages (default: enough for every sequence at
        its longest)."""
        pages = pages or batch * pages_for(max_len)
        return Cache(batch, max_len, pages, self.new_store(pages), prefix_cache, self.salt)

    def new_store(self, pages: int) -> LatentPages:
        """The entries of `pages` pages for this model's layers, in host memory."""
        return LatentPages(self.kv_cache, self.num_layers, pages)

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView) -> np.ndarray:
        """token_ids, positions, valid [b, s] (rows right-padded) -> hidden [b, s, m]; the view's rows gain the
        valid entries (each row holds exactly positions[i, 0] tokens; its pages are reserved for the new ones)."""
        return self.run(token_ids, positions, valid, view.entries())

    def run(self, inputs: np.ndarray, positions: np.ndarray, valid: np.ndarray, entries: CacheView) -> np.ndarray:
        """As forward, through the entries' view. A stage that does not start at layer 0 takes the previous
        stage's hidden [b, s, m] in place of token ids."""
        if self.native is not None and isinstance(entries, LatentPagesView):
            return self._run_native(inputs, positions, valid, entries)
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

    def _run_native(self, inputs: np.ndarray, positions: np.ndarray, valid: np.ndarray,
                    entries: LatentPagesView) -> np.ndarray:
        """run() through the native step: every valid token (decode's one a row, or a prompt's) one entry of a batch
        of native steps, NATIVE_BATCH at a time, each with its row's pages (every entry of a layer is stored before
        its attention, which reads positions up to its own: a prompt's tokens see each other causally). Each
        token's result is the one it gets alone, whatever else is in the batch and however a prompt is chunked.
        Masked tokens leave their pages alone (their hidden rows are zeros)."""
        started = time.perf_counter()
        rows, cols = np.nonzero(valid)
        hidden = np.zeros((*inputs.shape, self.config.hidden_size), np.float32)
        for at in range(0, len(rows), NATIVE_BATCH):
            r, c = rows[at:at + NATIVE_BATCH], cols[at:at + NATIVE_BATCH]
            hidden[r, c] = self.native.steps(inputs[r, c], positions[r, c], entries.page_table[r], entries.pages.arrays)
        self._timed("native_step" if inputs.shape[1] == 1 else "native_prefill", started)
        return hidden

    def run_layer(self, layer: int, hidden: np.ndarray, positions: np.ndarray, entries: CacheView,
                  new_entries: dict) -> np.ndarray:
        """One layer graph (of this model's range) -> hidden_out [b, s, m]; its new cache entries land in
        new_entries (`entries.new_entries`), not yet in their pages."""
        session = self._layer_session(layer)
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
        if self.native is not None:
            logits = self.native.logits(hidden)
        else:
            logits = self.head_session.run(None, {"hidden": hidden})[0]
        self._timed("head", started)
        return logits

    def _timed(self, stage: str, started: float) -> None:
        self.stage_seconds[stage] += time.perf_counter() - started
