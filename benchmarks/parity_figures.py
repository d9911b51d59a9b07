"""The parity figures of docs/artifact.md: each artifact against the float32 eager reference of the same synthetic checkpoint,
and a text's logits run two ways (score, one prefill, against a prefill then decode steps).

    . .venv/bin/activate && python benchmarks/parity_figures.py OUT [--presets tiny,small] [--json]

(from the repository root; OUT a scratch folder for the checkpoints and artifacts). On tiny: the bf16 and fp8 caches
(target cuda) and the cpu target; on other presets the cpu target and the fp8 cache. Per artifact: the prompt
logits' max |d| (the three prompts of tests/test_runtime_parity.py on tiny, the first elsewhere), greedy tokens
identical to the reference's (32, bf16 and fp8 on tiny), teacher-forced argmax agreement and mean |dlogit| (32
steps per prompt on tiny, and 256 after the first prompt as tests/test_cpu_lowering.py runs them), and the most
a position's logits differ between score and prefill + 20 decode steps. One thread, as the tests run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from k2deploy.core.checkpoint.presets import SHARD_BYTES, preset_config
from k2deploy.core.checkpoint.reader import Checkpoint
from k2deploy.core.checkpoint.synthetic import write_checkpoint
from k2deploy.core.manifest import load_manifest
from k2deploy.bench import parity
from k2deploy.export import reference
from k2deploy.export.exporter import ExportOptions, export_artifact
from k2deploy.export.weights import load_transformer
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.backends.onnx.thread_pool import process_threads

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77, 3, 640, 12, 12, 401], [1, 2, 3],
           [700, 650, 20, 20, 20, 999, 4, 80, 81, 82, 83, 84, 85, 86, 87, 88, 500, 1]]


def chunking_difference(generator: Generator, prompt: list[int], continuation: list[int]) -> float:
    """max |d| between score's logits of prompt + continuation and a prefill of the prompt then decode steps."""
    whole = generator.score(prompt + continuation)[len(prompt) - 1 : -1]
    cache = generator.model.new_cache(1, len(prompt) + len(continuation))
    got = [generator.prefill([prompt], cache)[0]]
    for token in continuation[:-1]:
        got.append(generator.decode(np.array([token]), np.array([True]), cache)[0])
    return float(np.abs(np.stack(got) - whole).max())


@torch.no_grad()
def figures(model, generator: Generator, tiny: bool, cache: str) -> dict:
    prompts = PROMPTS if tiny else PROMPTS[:1]
    result = {"score_max_abs": max(parity.score_difference(model, generator, p) for p in prompts)}
    if tiny and cache != "cpu":
        result["greedy_identical"] = [parity.greedy_agreement(model, generator, p, 32)[0] for p in PROMPTS]
        forced = [parity.teacher_forced(model, generator, p, 32) for p in PROMPTS]
        result["forced32_agreement_mean"] = float(np.mean([f["argmax_agreement"] for f in forced]))
        result["forced32_mean_abs_max"] = max(f["mean_abs_logit_error"] for f in forced)
    if cache != "bf16":
        result["forced256"] = parity.teacher_forced(model, generator, PROMPTS[0], 256)
    continuation = reference.greedy(model, PROMPTS[0], 20)
    result["score_vs_prefill_decode_max_abs"] = chunking_difference(generator, PROMPTS[0], continuation)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    process_threads(1)
    results = {}
    for preset in args.presets.split(","):
        checkpoint = write_checkpoint(args.out / preset / "checkpoint", preset_config(preset), seed=0,
                                      shard_bytes=SHARD_BYTES[preset], force=True)
        model = load_transformer(Checkpoint.open(checkpoint))
        cases = [("bf16", "cuda"), ("fp8", "cuda"), ("cpu", "cpu")] if preset == "tiny" else [("cpu", "cpu"), ("fp8", "cuda")]
        for cache, target in cases:
            started = time.perf_counter()
            artifact = args.out / preset / cache
            export_artifact(ExportOptions(str(checkpoint), kv_cache=None if cache == "cpu" else cache, target=target),
                            artifact, force=True)
            row = figures(model, Generator(load_model(load_manifest(artifact))), preset == "tiny", cache)
            results[f"{preset}/{cache}"] = {**row, "seconds": round(time.perf_counter() - started, 1)}
            if not args.json:
                print(f"{preset}/{cache}", json.dumps(results[f"{preset}/{cache}"]), flush=True)
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
