"""Runs an artifact's TensorRT engines behind the interface of `OrtModel`.

One execution context per engine, all enqueued on one CUDA stream. Activations and the FP8
latent cache live in device buffers: the hidden state goes from the embedding through every
layer to the end of the step without leaving the GPU, each layer's new cache entries are copied
into the cache on the device (cudaMemcpy2DAsync, one per row and array), and the host waits
once per step. Device memory and the stream come from cuda-python; no torch unless an engine
holds a just-in-time (Python) plugin.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from ...errors import K2Error
from ...manifest import Manifest
from .environment import detect_gpu, require_tensorrt
from .record import check_record, find_engines, read_record


class CudaRuntime:
    """The few CUDA runtime calls the backend makes, through cuda-python, with errors raised."""

    def __init__(self):
        try:
            try:
                from cuda.bindings import runtime as cudart
            except ImportError:
                from cuda import cudart
        except ImportError:
            raise K2Error("the TensorRT backend needs cuda-python: pip install cuda-python") from None
        self.rt = cudart
        kinds = cudart.cudaMemcpyKind
        self.h2d, self.d2h, self.d2d = (kinds.cudaMemcpyHostToDevice, kinds.cudaMemcpyDeviceToHost,
                                        kinds.cudaMemcpyDeviceToDevice)

    def call(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise K2Error(f"CUDA error {int(err)} ({self.rt.cudaGetErrorName(err)[1]})")
        return rest[0] if len(rest) == 1 else rest

    def malloc(self, nbytes: int) -> int:
        return int(self.call(self.rt.cudaMalloc(max(int(nbytes), 1))))

    def free(self, pointer: int) -> None:
        self.rt.cudaFree(pointer)

    def stream(self):
        return self.call(self.rt.cudaStreamCreate())

    def synchronize(self, stream) -> None:
        self.call(self.rt.cudaStreamSynchronize(stream))

    def memset(self, pointer: int, nbytes: int, stream) -> None:
        self.call(self.rt.cudaMemsetAsync(pointer, 0, nbytes, stream))

    def to_device(self, pointer: int, array: np.ndarray, stream) -> None:
        array = np.ascontiguousarray(array)
        self.call(self.rt.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, self.h2d, stream))

    def to_host(self, array: np.ndarray, pointer: int, stream) -> None:
        self.call(self.rt.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, self.d2h, stream))

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream) -> None:
        self.call(self.rt.cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, self.d2d, stream))


def _handle(stream) -> int:
    try:
        return int(stream)
    except TypeError:
        return int(stream.getPtr())


class DeviceBuffer:
    """A growable device allocation."""

    def __init__(self, cuda: CudaRuntime, nbytes: int = 0):
        self.cuda, self.nbytes, self.pointer = cuda, 0, 0
        self.ensure(nbytes)

    def ensure(self, nbytes: int) -> int:
        if nbytes > self.nbytes:
            if self.pointer:
                self.cuda.free(self.pointer)
            self.pointer, self.nbytes = self.cuda.malloc(nbytes), nbytes
        return self.pointer

    def __del__(self):
        if getattr(self, "pointer", 0):
            try:
                self.cuda.free(self.pointer)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


class DeviceLatentCache:
    """The latent cache of `kv_cache.LatentCache`, in device memory: arrays [layers, max_len, batch, ...]."""

    def __init__(self, kv_cache: dict, layers: int, batch: int, max_len: int, cuda: CudaRuntime, stream):
        self.format, self.max_len, self.batch, self.cuda, self.stream = kv_cache["format"], max_len, batch, cuda, stream
        c, r = kv_cache["latent_dim"], kv_cache["rope_dim"]
        widths = {"latent": c * (1 if self.format == "fp8" else 2), "rope": 2 * r}  # bytes per token and row
        if self.format == "fp8":
            widths["latent_scale"] = 4 * (c // kv_cache["latent_scale_group"])
        self.widths = widths
        self.layer_bytes = {name: max_len * batch * w for name, w in widths.items()}
        self.buffers = {name: DeviceBuffer(cuda, layers * size) for name, size in self.layer_bytes.items()}
        for name, buffer in self.buffers.items():
            cuda.memset(buffer.pointer, buffer.nbytes, stream)
        self.lengths = np.zeros(batch, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def past_address(self, name: str, layer: int) -> int:
        """Device address of a layer's first positions: [past, batch, ...] is one contiguous block there."""
        return self.buffers[name].pointer + layer * self.layer_bytes[name]

    def store(self, layer: int, positions: np.ndarray, valid: np.ndarray, entries: dict[str, int]) -> None:
        """Copies the valid new entries ([b, s, ...] device buffers) to their positions, on the device."""
        b, s = positions.shape
        if np.any(valid & (positions >= self.max_len)):
            raise K2Error(f"sequence reaches position {int(positions[valid].max())}, past the cache's "
                          f"{self.max_len} positions")
        for row in range(b):
            steps = np.flatnonzero(valid[row])
            if not steps.size:
                continue
            # runs of consecutive steps at consecutive positions: one 2-D copy each
            breaks = np.flatnonzero((np.diff(steps) != 1) | (np.diff(positions[row, steps]) != 1)) + 1
            for run in np.split(steps, breaks):
                first, count, slot = int(run[0]), len(run), int(positions[row, run[0]])
                for name, width in self.widths.items():
                    dst = self.past_address(name, layer) + (slot * self.batch + row) * width
                    src = entries[name] + (row * s + first) * width
                    self.cuda.copy_2d(dst, self.batch * width, src, width, width, count, self.stream)

    def release(self, row: int) -> None:
        self.lengths[row] = 0


class TrtModel:
    """The engines of one artifact for this GPU, ready to run; the interface of `OrtModel`."""

    def __init__(self, manifest: Manifest, provider: str | None = None, threads: int | None = None,
                 gpu_index: int = 0):
        if not manifest.data.get("complete"):
            start, stop = manifest.graphs["layer_range"]
            raise K2Error(f"{manifest.root} holds only layers {start}:{stop}; export the whole model to run it")
        trt = require_tensorrt()
        self.manifest, self.config, self.kv_cache = manifest, manifest.config, manifest.kv_cache
        gpu = detect_gpu(gpu_index)
        directory = find_engines(manifest.root, gpu)
        record = read_record(directory)
        check_record(record, gpu, trt.__version__, manifest.digest, manifest.root, directory)
        self.record = record
        if any(mode == "jit" for mode in record.get("plugins", {}).values()):
            from ...plugins.tensorrt.registration import register

            register(aot=False)  # just-in-time plugins run Python: their definitions must be registered
        self.cuda = CudaRuntime()
        self.stream = self.cuda.stream()
        self.max_batch, self.max_seq = record["settings"]["max_batch"], record["settings"]["max_seq"]
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._trt_runtime = runtime

        def load(stem: str):
            engine = runtime.deserialize_cuda_engine((directory / record["engines"][stem]["engine"]).read_bytes())
            if engine is None:
                raise K2Error(f"TensorRT could not load {directory / record['engines'][stem]['engine']}; rebuild with "
                              f"`k2deploy build-engines {manifest.root}`")
            return engine, engine.create_execution_context()

        graphs = manifest.graphs
        self.embed = load("embed")
        self.layers = [load(f"layer_{entry['layer']:03d}") for entry in graphs["layers"]]
        self.head = load("head")
        self._profile: dict[int, int] = {}
        m = self.config.hidden_size
        tokens = self.max_batch * self.max_seq
        c, r = self.kv_cache["latent_dim"], self.kv_cache["rope_dim"]
        self.hidden = [DeviceBuffer(self.cuda, tokens * m * 4) for _ in range(2)]
        self.ids = DeviceBuffer(self.cuda, tokens * 8)
        self.positions = DeviceBuffer(self.cuda, tokens * 8)
        widths = {"new_latent": c * (1 if self.kv_cache["format"] == "fp8" else 2), "new_rope": 2 * r}
        if self.kv_cache["format"] == "fp8":
            widths["new_latent_scale"] = 4 * (c // self.kv_cache["latent_scale_group"])
        self.entries = {name: DeviceBuffer(self.cuda, tokens * w) for name, w in widths.items()}
        self.cache_dims = {"latent": c, "rope": r}
        if self.kv_cache["format"] == "fp8":
            self.cache_dims["latent_scale"] = c // self.kv_cache["latent_scale_group"]
        self.logits_buffer = DeviceBuffer(self.cuda)
        self.head_input = DeviceBuffer(self.cuda)
        self.stage_seconds: dict[str, float] = defaultdict(float)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, batch: int, max_len: int) -> DeviceLatentCache:
        if batch > self.max_batch or max_len > self.max_seq:
            raise K2Error(f"batch {batch} x {max_len} positions exceeds the engines' profile ({self.max_batch} x "
                          f"{self.max_seq}); rebuild with `k2deploy build-engines {self.manifest.root} --max-batch "
                          f"{max(batch, self.max_batch)} --max-seq {max(max_len, self.max_seq)}`")
        return DeviceLatentCache(self.kv_cache, self.num_layers, batch, max_len, self.cuda, self.stream)

    def _run(self, pair, inputs: dict[str, tuple[tuple, int]], outputs: dict[str, int], profile: int) -> None:
        engine, context = pair
        if self._profile.get(id(context)) != profile:
            context.set_optimization_profile_async(profile, _handle(self.stream))
            self._profile[id(context)] = profile
        for name, (shape, address) in inputs.items():
            context.set_input_shape(name, shape)
            context.set_tensor_address(name, address)
        for name, address in outputs.items():
            context.set_tensor_address(name, address)
        if not context.execute_async_v3(_handle(self.stream)):
            raise K2Error("TensorRT failed to enqueue an engine (see its log above)")

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, valid: np.ndarray,
                cache: DeviceLatentCache) -> np.ndarray:
        """As OrtModel.forward: token_ids, positions, valid [b, s] -> hidden [b, s, m]; the cache gains the
        valid entries. Device-side from the embedding to the last layer; the host waits once, at the end."""
        b, s = token_ids.shape
        if b != cache.batch or s > self.max_seq:
            raise K2Error(f"batch {b} x {s} new positions does not fit the cache ({cache.batch} rows) or the "
                          f"engines' profile (up to {self.max_seq} positions)")
        started = time.perf_counter()
        profile = 1 if s == 1 else 0
        m = self.config.hidden_size
        self.cuda.to_device(self.ids.pointer, token_ids.astype(np.int64), self.stream)
        self.cuda.to_device(self.positions.pointer, positions.astype(np.int64), self.stream)
        current, other = self.hidden
        self._run(self.embed, {"token_ids": ((b, s), self.ids.pointer)}, {"hidden": current.pointer}, profile)
        past = int(positions[:, 0].max())
        names = ["past_latent", "past_rope"] + (["past_latent_scale"] if self.kv_cache["format"] == "fp8" else [])
        for layer, pair in enumerate(self.layers):
            inputs = {"hidden": ((b, s, m), current.pointer), "positions": ((b, s), self.positions.pointer)}
            for name in names:
                cache_name = name.removeprefix("past_")
                inputs[name] = ((past, b, self.cache_dims[cache_name]), cache.past_address(cache_name, layer))
            outputs = {"hidden_out": other.pointer, **{n: buf.pointer for n, buf in self.entries.items()}}
            self._run(pair, inputs, outputs, profile)
            cache.store(layer, positions, valid,
                        {n.removeprefix("new_"): buf.pointer for n, buf in self.entries.items()})
            current, other = other, current
        hidden = np.empty((b, s, m), dtype=np.float32)
        self.cuda.to_host(hidden, current.pointer, self.stream)
        self.cuda.synchronize(self.stream)
        cache.lengths = np.maximum(cache.lengths, np.where(valid, positions + 1, 0).max(axis=1))
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


__all__ = ["CudaRuntime", "DeviceLatentCache", "TrtModel"]
