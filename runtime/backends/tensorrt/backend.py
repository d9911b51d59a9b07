"""Runs an artifact's TensorRT engines behind the interface of `OrtModel`.

One execution context per engine, all enqueued on one CUDA stream. Activations and the FP8
latent cache live in device buffers: the hidden state goes from the embedding through every
layer to the end of the step without leaving the GPU, each layer's new cache entries are copied
into the cache on the device (cudaMemcpy2DAsync, one per row and array), and the host waits
once per step. Device memory and the stream come from cuda-python; no torch unless an engine
holds a just-in-time (Python) plugin.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict

import numpy as np

from ....core.errors import K2Error
from ....core.manifest import Manifest
from ....core.cache_format import PAGE_SIZE
from ....core.tensorrt.engine_record import check_record, find_engines, read_record
from ....core.tensorrt.environment import detect_gpu, require_tensorrt
from ...cache.slots import Cache, SlotView, pages_for
from ..interface import InProcess
from .cuda import CudaRuntime, stream_handle
from .device_cache import DeviceBuffer, DevicePages


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


TRT_TYPES = {"FLOAT": "float32", "INT64": "int64", "BOOL": "bool", "FLOAT16": "float16", "BFLOAT16": "bfloat16",
             "FLOAT8E4M3FN": "fp8", "UINT8": "uint8"}  # manifest dtype -> tensorrt's DataType attribute


def check_engine_io(trt, engine, stem: str, graph: dict, root) -> None:
    """The engine's inputs and outputs are the graph's, by name and type: the backend's buffers are laid
    out from the manifest, so an engine from another export must not be run over them."""
    have = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    want = {io["name"]: io["dtype"] for io in graph["inputs"] + graph["outputs"]}
    problems = [f"{name} missing" for name in sorted(set(want) - have)]
    problems += [f"{name} extra" for name in sorted(have - set(want))]
    problems += [f"{name} is {engine.get_tensor_dtype(name)}, expected {dtype}" for name, dtype in want.items()
                 if name in have and engine.get_tensor_dtype(name) != getattr(trt, TRT_TYPES[dtype])]
    if problems:
        raise K2Error(f"engine {stem} does not match the artifact's graph ({'; '.join(problems)}); rebuild with "
                      f"`k2deploy build-engines {root}`")


class TrtModel(InProcess):
    """The engines of one artifact for this GPU, ready to run; the interface of `OrtModel`."""

    def __init__(self, manifest: Manifest, provider: str | None = None, threads: int | None = None,
                 gpu_index: int = 0):
        if not manifest.data.get("complete"):
            start, stop = manifest.graphs["layer_range"]
            raise K2Error(f"{manifest.root} holds only layers {start}:{stop}; export the whole model to run it")
        trt = require_tensorrt()
        self.manifest, self.config, self.kv_cache = manifest, manifest.config, manifest.kv_cache
        self.threads = None  # the engines run on the GPU: no intra-op thread pool on the host
        gpu = detect_gpu(gpu_index)
        directory = find_engines(manifest.root, gpu)
        record = read_record(directory)
        check_record(record, gpu, trt.__version__, manifest.digest, manifest.root, directory)
        self.record = record
        if any(mode == "jit" for mode in record.get("plugins", {}).values()):
            missing = [m for m in ("torch", "triton") if not _importable(m)]
            if missing:
                raise K2Error(f"these engines were built with --no-aot: their plugins run Python kernels, which need "
                              f"{' and '.join(missing)} (torch with CUDA); install them, or rebuild without --no-aot: "
                              f"`k2deploy build-engines {manifest.root}`")
            from ....plugins.tensorrt.registration import register

            register(aot=False)  # just-in-time plugins run Python: their definitions must be registered
        self.cuda = CudaRuntime()
        self.cuda.set_device(gpu.index)
        self.stream = self.cuda.stream()
        self.max_batch, self.max_seq = record["settings"]["max_batch"], record["settings"]["max_seq"]
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._trt_runtime = runtime

        def load(stem: str, graph: dict):
            engine = runtime.deserialize_cuda_engine((directory / record["engines"][stem]["engine"]).read_bytes())
            if engine is None:
                raise K2Error(f"TensorRT could not load {directory / record['engines'][stem]['engine']}; rebuild with "
                              f"`k2deploy build-engines {manifest.root}`")
            check_engine_io(trt, engine, stem, graph, manifest.root)
            context = engine.create_execution_context()
            if context is None:
                raise K2Error(f"TensorRT could not create an execution context for {stem} (out of GPU memory?)")
            return engine, context

        graphs = manifest.graphs
        self.embed = load("embed", graphs["embed"])
        self.layers = [load(f"layer_{entry['layer']:03d}", entry) for entry in graphs["layers"]]
        self.head = load("head", graphs["head"])
        self._profile: dict[int, int] = {}
        m = self.config.hidden_size
        tokens = self.max_batch * self.max_seq
        self.hidden = [DeviceBuffer(self.cuda, tokens * m * 4) for _ in range(2)]
        self.ids = DeviceBuffer(self.cuda, tokens * 8)
        self.positions = DeviceBuffer(self.cuda, tokens * 8)
        self.logits_buffer = DeviceBuffer(self.cuda)
        self.head_input = DeviceBuffer(self.cuda)
        self.stage_seconds: dict[str, float] = defaultdict(float)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, batch: int, max_len: int, pages: int | None = None, prefix_cache: bool = True) -> Cache:
        pages = pages or batch * pages_for(max_len)
        most = self.max_batch * pages_for(self.max_seq)  # the engines' profile bounds the pool they take
        if batch > self.max_batch or max_len > self.max_seq or pages > most:
            need_batch = max(batch, self.max_batch)
            need_seq = max(max_len, self.max_seq, -(-pages // need_batch) * PAGE_SIZE)
            raise K2Error(f"batch {batch} x {max_len} positions over {pages} cache pages exceeds the engines' profile "
                          f"({self.max_batch} x {self.max_seq}, {most} pages); rebuild with `k2deploy build-engines "
                          f"{self.manifest.root} --max-batch {need_batch} --max-seq {need_seq}`")
        store = DevicePages(self.kv_cache, self.num_layers, pages, self.cuda, self.stream)
        return Cache(batch, max_len, pages, store, prefix_cache, self.manifest.digest.encode())

    def _run(self, pair, inputs: dict[str, tuple[tuple, int]], outputs: dict[str, int], profile: int) -> None:
        engine, context = pair
        if self._profile.get(id(context)) != profile:
            context.set_optimization_profile_async(profile, stream_handle(self.stream))
            self._profile[id(context)] = profile
        for name, (shape, address) in inputs.items():
            if not context.set_input_shape(name, shape):
                raise K2Error(f"TensorRT refused input {name} of shape {tuple(shape)}: outside the engines' profile "
                              f"(batch {self.max_batch}, {self.max_seq} positions); rebuild with `k2deploy "
                              f"build-engines {self.manifest.root}` and larger --max-batch / --max-seq")
            context.set_tensor_address(name, address)
        for name, address in outputs.items():
            context.set_tensor_address(name, address)
        if not context.execute_async_v3(stream_handle(self.stream)):
            raise K2Error("TensorRT failed to enqueue an engine (see its log above)")

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray, view: SlotView) -> np.ndarray:
        """As OrtModel.forward: token_ids, positions, valid [b, s] -> hidden [b, s, m]; the view's slots gain the
        valid entries. Device-side from the embedding to the last layer; the host waits once, at the end."""
        b, s = token_ids.shape
        if b != len(view.slots) or s > self.max_seq:
            raise K2Error(f"batch {b} x {s} new positions does not fit the cache view ({len(view.slots)} rows) or "
                          f"the engines' profile (up to {self.max_seq} positions)")
        entries = view.entries()
        started = time.perf_counter()
        profile = 1 if s == 1 else 0
        m = self.config.hidden_size
        self.cuda.to_device(self.ids.pointer, token_ids.astype(np.int64), self.stream)
        self.cuda.to_device(self.positions.pointer, positions.astype(np.int64), self.stream)
        current, other = self.hidden
        self._run(self.embed, {"token_ids": ((b, s), self.ids.pointer)}, {"hidden": current.pointer}, profile)
        new_entries = entries.new_entries(positions)
        for layer, pair in enumerate(self.layers):
            inputs = {"hidden": ((b, s, m), current.pointer), "positions": ((b, s), self.positions.pointer),
                      **entries.past_inputs(layer)}
            self._run(pair, inputs, {"hidden_out": other.pointer, **new_entries}, profile)
            entries.store(layer, positions, valid)
            current, other = other, current
        hidden = np.empty((b, s, m), dtype=np.float32)
        self.cuda.to_host(hidden, current.pointer, self.stream)
        self.cuda.synchronize(self.stream)
        self.stage_seconds["layers"] += time.perf_counter() - started
        return hidden

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [b, s, m] -> logits [b, s, vocab] float32."""
        started = time.perf_counter()
        b, s, m = hidden.shape
        vocab = self.config.vocab_size
        self.head_input.ensure(hidden.nbytes)
        self.cuda.to_device(self.head_input.pointer, hidden.astype(np.float32), self.stream)
        logits = np.empty((b, s, vocab), dtype=np.float32)
        self.logits_buffer.ensure(logits.nbytes)
        self._run(self.head, {"hidden": ((b, s, m), self.head_input.pointer)}, {"logits": self.logits_buffer.pointer},
                  1 if s == 1 else 0)
        self.cuda.to_host(logits, self.logits_buffer.pointer, self.stream)
        self.cuda.synchronize(self.stream)
        self.stage_seconds["head"] += time.perf_counter() - started
        return logits


__all__ = ["TrtModel"]
