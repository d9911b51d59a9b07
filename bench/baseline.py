"""The baseline `k2deploy bench` runs beside the artifact: the eager PyTorch reference, or
transformers' DeepseekV3ForCausalLM, on the checkpoint the artifact was exported from.

It runs in a child process (`python -m k2deploy.bench.baseline`) that the benchmark drives one
run at a time over a pipe (JSON lines), interleaved with its own runs. So the benchmark's side
never imports torch, the two share no thread pools, the child sits idle (blocked on its pipe)
while ours runs, and each side's peak RSS is its own.

One run of the baseline is what one run of ours is: `batch` random prompts of `prompt_len`
tokens (the same ids: same seed, same generator), prefill into an empty cache and the first
greedy token (time to first token), then `gen_len - 1` decode steps of one token per row, each
timed with its argmax.

- eager: k2deploy.export's float32 reference (dequantised weights, naive MLA, MoE computing
  every expert for every token); its cache grows by concatenation. At prefill the head runs on
  the last position only, as ours does (reference.forward would project every position).
- hf: k2deploy.export.hf_deepseek's build_hf_model (float32, eager attention and experts), its
  DynamicCache, logits_to_keep=1. Needs transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..core.errors import K2Error
from ..core.host_memory import proc_kib

KINDS = ("eager", "hf")


def prompts(seed: int, batch: int, prompt_len: int, vocab: int) -> np.ndarray:
    """The prompt ids of one cell, [batch, prompt_len] int64: identical on both sides."""
    return np.random.default_rng([seed, batch, prompt_len]).integers(0, vocab, size=(batch, prompt_len), dtype=np.int64)


def peak_rss_bytes() -> int | None:
    """VmHWM of this process (Linux), else ru_maxrss."""
    peak = proc_kib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak
    try:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    except ImportError:
        return None


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int | None:
    return proc_kib("/proc/self/status", "VmRSS")


# -- the child process ----------------------------------------------------------------------------------


class _Eager:
    def __init__(self, checkpoint: str):
        import torch

        from ..core.checkpoint.reader import Checkpoint
        from ..export import reference
        from ..export.weights import load_transformer

        self.torch, self.reference = torch, reference
        with Checkpoint.open(checkpoint) as ckpt:
            self.model = load_transformer(ckpt)
        self.config = self.model.config

    def prefill(self, tokens):
        """reference.forward with the head on the last position only -> (logits [b, vocab], cache)."""
        torch, model = self.torch, self.model
        b, s = tokens.shape
        cache = self.reference.LatentCache(model, b)
        positions = torch.arange(s).expand(b, s)
        mask = (torch.arange(s)[None, :] <= positions[0][:, None]).expand(b, s, s)
        x = model.embed_tokens(tokens)
        for i, block in enumerate(model.layers):
            # the cache starts empty: the prompt's entries are all it holds
            x, cache.latent[i], cache.rope[i] = block(x, positions, (cache.latent[i], cache.rope[i]), mask)
        return model.lm_head(model.norm(x[:, -1])), cache

    def decode(self, tokens, cache):
        return self.reference.forward(self.model, tokens[:, None], cache)[:, -1]


class _HF:
    def __init__(self, checkpoint: str):
        import torch
        from transformers import DynamicCache

        from ..core.checkpoint.reader import Checkpoint
        from ..export.hf_deepseek import build_hf_model

        self.torch, self.DynamicCache = torch, DynamicCache
        with Checkpoint.open(checkpoint) as ckpt:
            self.model = build_hf_model(ckpt)
            self.config = ckpt.config

    def prefill(self, tokens):
        cache = self.DynamicCache(config=self.model.config)
        out = self.model(tokens, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], cache

    def decode(self, tokens, cache):
        return self.model(tokens[:, None], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def _serve(kind: str, checkpoint: str, threads: int, protocol) -> None:
    import torch

    torch.set_num_threads(threads)
    started = time.perf_counter()
    backend = (_Eager if kind == "eager" else _HF)(checkpoint)
    versions = {"torch": torch.__version__}
    if kind == "hf":
        import transformers

        versions["transformers"] = transformers.__version__
    reply = {"ready": True, "load_seconds": time.perf_counter() - started, "rss_bytes": current_rss_bytes(),
             "versions": versions, "threads": torch.get_num_threads()}
    protocol.write(json.dumps(reply) + "\n")
    protocol.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            break
        batch, prompt_len, gen_len = request["batch"], request["prompt_len"], request["gen_len"]
        tokens = torch.from_numpy(prompts(request["seed"], batch, prompt_len, backend.config.vocab_size))
        reset_peak_rss()
        steps = []
        with torch.inference_mode():
            started = time.perf_counter()
            logits, cache = backend.prefill(tokens)
            next_tokens = logits.argmax(-1)
            ttft = time.perf_counter() - started
            for _ in range(gen_len - 1):
                started = time.perf_counter()
                next_tokens = backend.decode(next_tokens, cache).argmax(-1)
                steps.append(time.perf_counter() - started)
        del cache
        protocol.write(json.dumps({"ttft_s": ttft, "step_s": steps, "peak_rss_bytes": peak_rss_bytes()}) + "\n")
        protocol.flush()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m k2deploy.bench.baseline",
                                     description="The benchmark's baseline worker: JSON requests on stdin, replies on stdout.")
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("checkpoint")
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args(argv)
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # anything a library prints goes to stderr, never into the protocol
    os.dup2(sys.stderr.fileno(), 1)
    _serve(args.kind, args.checkpoint, args.threads, protocol)
    return 0


# -- the benchmark's side ---------------------------------------------------------------------------------


def unavailable(kind: str) -> str | None:
    """Why this baseline cannot run here (a missing package or helper), or None."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install 'k2deploy[export]')"
    if kind == "hf":
        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed (pip install 'transformers>=4.51')"
    return None


class BaselineProcess:
    """The baseline worker, started now; `wait_ready()` blocks until its model is loaded."""

    def __init__(self, kind: str, checkpoint: str | Path, threads: int):
        self.kind = kind
        self.log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "k2deploy.bench.baseline", kind, str(checkpoint), "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.info: dict = {}

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=30)
            self.log.seek(0)
            tail = [l for l in self.log.read().strip().splitlines() if l.strip()][-1:] or ["no output"]
            raise K2Error(f"the {self.kind} baseline stopped (exit {self.process.returncode}): {tail[0]}")
        return json.loads(line)

    def wait_ready(self) -> dict:
        self.info = self._reply()
        return self.info

    def run(self, batch: int, prompt_len: int, gen_len: int, seed: int) -> dict:
        request = {"op": "run", "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "seed": seed}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # _reply reports why it stopped
        return self._reply()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


if __name__ == "__main__":
    sys.exit(main())
