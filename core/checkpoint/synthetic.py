"""Writes random checkpoints in the exact Kimi K2 Hugging Face layout.

Weights are streamed to disk in chunks of at most CHUNK_BYTES, so a real-size layer is
written without ever being held in memory. Every tensor draws from its own generator,
seeded by (seed, tensor name): the same seed gives the same bytes whatever the sharding.

Scales are chosen so that activations stay near unit size through every layer and the
head's logits have a spread of a few units (greedy decoding then has clear winners).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from pathlib import Path
from statistics import NormalDist
from typing import Callable, Iterable, Iterator

import ml_dtypes
import numpy as np

from .. import int4
from ..config import ModelConfig
from ..errors import K2Error
from ..placement import format_bytes
from . import layout
from .reader import INDEX_FILE
from .safetensors_io import NUMPY_DTYPES, header_bytes, write_array
from .layout import TensorSpec

CHUNK_BYTES = 64 << 20
OUTPUT_GAIN = 0.5  # o_proj and down_proj write into the residual stream: keep its growth slow
HEAD_GAIN = 3.0  # logits of std ~3


def _fp8_code_table() -> np.ndarray:
    """256 e4m3 byte codes at the quantiles of a normal law scaled to the format's range (+-448)."""
    quantiles = np.array([NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)])
    values = quantiles * (448.0 / quantiles.max())
    return values.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


FP8_CODES = _fp8_code_table()
FP8_STD = float(FP8_CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float32).std())
INT4_STD = 2.5  # INT4 codes drawn from a normal law of this spread, rounded and clipped to -8..7


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _weight_std(name: str, in_features: int) -> float:
    gain = OUTPUT_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
    return gain / math.sqrt(in_features)


def _rows_per_chunk(row_bytes: int, multiple: int = 1) -> int:
    rows = max(1, CHUNK_BYTES // max(row_bytes, 1))
    return max(multiple, rows // multiple * multiple)


def tensor_chunks(spec: TensorSpec, weight_shapes: dict[str, tuple[int, ...]], seed: int) -> Iterator[np.ndarray]:
    """The tensor's values, first rows first, in chunks of at most CHUNK_BYTES."""
    rng = _rng(seed, spec.name)
    dtype = NUMPY_DTYPES[spec.dtype]
    if spec.role == "proj" and spec.dtype == layout.FP8:
        rows, cols = spec.shape
        step = _rows_per_chunk(cols)
        for lo in range(0, rows, step):
            raw = np.frombuffer(rng.bytes(min(step, rows - lo) * cols), dtype=np.uint8)
            yield FP8_CODES[raw].view(dtype)
        return
    if spec.role in ("scale", "int4_scale"):
        weight = spec.name.removesuffix("_scale_inv").removesuffix("_scale")
        in_features = weight_shapes[weight][1]
        spread = rng.uniform(0.5, 1.5, size=spec.shape)  # per-block scales differ, as in a real checkpoint
        code_std = FP8_STD if spec.role == "scale" else INT4_STD
        yield (spread * _weight_std(weight, in_features) / code_std).astype(dtype)
        return
    if spec.role == "int4":
        rows, words = spec.shape
        step = _rows_per_chunk(words * 4)
        for lo in range(0, rows, step):
            codes = np.clip(np.rint(rng.standard_normal((min(step, rows - lo), words * 8)) * INT4_STD), -8, 7)
            yield int4.pack(codes.astype(np.int8))
        return
    if spec.role == "int4_shape":
        yield np.array(weight_shapes[spec.name.removesuffix("_shape")], dtype=dtype)
        return
    if spec.role == "norm":
        yield (1.0 + 0.1 * rng.standard_normal(spec.shape)).astype(dtype)
        return
    if spec.role == "bias":
        yield (0.2 * rng.standard_normal(spec.shape)).astype(dtype)
        return
    std = {
        "embedding": 1.0,
        "head": HEAD_GAIN / math.sqrt(spec.shape[-1]),
        "router": 1.0 / math.sqrt(spec.shape[-1]),
        "proj": _weight_std(spec.name, spec.shape[-1]),  # BF16 checkpoints
    }[spec.role]
    rows = spec.shape[0]
    step = _rows_per_chunk(math.prod(spec.shape[1:]) * 4)
    for lo in range(0, rows, step):
        chunk = rng.standard_normal((min(step, rows - lo), *spec.shape[1:]), dtype=np.float32)
        chunk *= std
        yield chunk.astype(dtype)


def weight_shapes_of(specs: list[TensorSpec]) -> dict[str, tuple[int, int]]:
    """Every projection's `*.weight` name -> its [out, in], INT4 ones from their packed words."""
    shapes = {s.name: s.shape for s in specs if s.role == "proj"}
    shapes.update({s.name.removesuffix("_packed"): (s.shape[0], s.shape[1] * 8) for s in specs if s.role == "int4"})
    return shapes


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * NUMPY_DTYPES[spec.dtype].itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _remove_stale_partials(folder: Path) -> None:
    """Removes the `.NAME.partial-PID` folders in `folder` that runs killed outright (SIGKILL, a power cut) left,
    whatever their output's name: those whose process is gone."""
    for partial in folder.glob(".*.partial-*"):
        pid = partial.name.rpartition("-")[2]
        if pid.isdigit() and partial.is_dir() and _gone(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _gone(pid: int) -> bool:
    """Whether no process has this id."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # another user's process; a number no process id can be
        return False
    return False


def _check_free_space(folder: Path, total: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < total * 1.02:
        raise K2Error(f"{folder}: {format_bytes(free)} free, the checkpoint needs {format_bytes(total)}; write it "
                      f"where there is room, or with fewer --layers")


def write_checkpoint(
    out: Path,
    config: ModelConfig,
    seed: int = 0,
    shard_bytes: int = 5 << 30,
    force: bool = False,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> Path:
    """Writes into a sibling temporary directory and renames it into place when complete; an exception, Ctrl-C
    included, removes that directory. The free space is checked first, from the config alone."""
    from ..tokenizer import write_tokenizer

    out = Path(out)
    if out.exists() and not force:
        raise K2Error(f"{out} already exists; pass --force to replace it")
    total = checkpoint_bytes(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_free_space(out.parent, total)
    _remove_stale_partials(out.parent)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        specs = layout.all_tensors(config)
        weight_shapes = weight_shapes_of(specs)
        shards = plan_shards(specs, shard_bytes)
        weight_map = {}
        for number, shard_specs in enumerate(shards, start=1):
            shard_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            header = header_bytes((s.name, s.dtype, s.shape) for s in shard_specs)
            with open(partial / shard_name, "wb") as f:
                f.write(header)
                for spec in shard_specs:
                    for chunk in tensor_chunks(spec, weight_shapes, seed):
                        write_array(f, chunk)
                        on_bytes(chunk.nbytes)
                    weight_map[spec.name] = shard_name
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (partial / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (partial / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": False}
        (partial / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if config.model_type == "deepseek_v3":  # DeepSeek-V3's own format: a tokenizer.json
            from ..hf_tokenizer import write_hf_tokenizer
            from ..tokenizer import TRAINING_TEXT

            write_hf_tokenizer(partial, config.vocab_size, TRAINING_TEXT, config.bos_token_id, config.eos_token_id)
        else:
            write_tokenizer(partial, config.vocab_size, thinking=config.int4 is not None)  # INT4: K2-Thinking's
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _specs_bytes(specs: Iterable[TensorSpec]) -> int:
    return sum(s.numel * NUMPY_DTYPES[s.dtype].itemsize for s in specs)


def checkpoint_bytes(config: ModelConfig) -> int:
    """The bytes of every tensor, without listing them all (3.6 million in 1,024 layers of `k2`): a layer's
    routed experts are stored alike, unless an INT4 ignore list tells them apart by name."""
    edges = _specs_bytes(layout.embedding_tensors(config) + layout.head_tensors(config))
    return edges + sum(_layer_bytes(config, layer) for layer in range(config.num_hidden_layers))


def _layer_bytes(config: ModelConfig, layer: int) -> int:
    rest = _specs_bytes(layout.layer_tensors(config, layer, routed=False))
    if not config.is_moe_layer(layer):
        return rest
    if config.int4 is None:
        return rest + config.n_routed_experts * _specs_bytes(layout.routed_expert(config, layer, 0))
    return rest + sum(_specs_bytes(layout.routed_expert(config, layer, e)) for e in range(config.n_routed_experts))
