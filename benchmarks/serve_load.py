"""Load on `k2deploy serve`: 1, 4 and 16 concurrent streaming clients against one server.

    . .venv/bin/activate && python benchmarks/serve_load.py [--artifact ART] [--json]

Without --artifact it makes the `small` preset's checkpoint and an artifact for this machine's
default target under --work (with `k2deploy make-checkpoint` and `k2deploy export`; reused when
present). It starts the server
(`python -m k2deploy serve ART --port 0 --max-batch 16`), warms it up, then for each
concurrency c (default 1, 4, 16) sends max(c, --requests) streaming completions, c at a time:
each client sends its share back to back. Every request has its own random prompt of
--prompt-tokens ids and asks for --max-tokens greedy tokens.

Per level: aggregate tokens/s (completion tokens over the level's wall time, first request sent
to last [DONE]), time to first token (request sent to its first streamed event) p50 and p99, and
the speed-up: tokens/s over the sequential level's (c = 1). p99 of a few samples is their maximum.
Completion token counts come from the stream's usage chunk (a random model may draw a stop id early).

Timings are wall clock on whatever else the machine is running: the load average is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from k2deploy.bench.device import cpu_model

REPO = Path(__file__).resolve().parent.parent
STARTUP_S = 600


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def k2deploy(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "k2deploy", *args], check=True, stdout=subprocess.DEVNULL)


def ensure_artifact(work: Path, preset: str) -> Path:
    checkpoint, artifact = work / "checkpoints" / preset, work / "artifacts" / f"{preset}-default-target"
    if not (artifact / "manifest.json").exists():
        if not (checkpoint / "config.json").exists():
            log(f"writing the {preset} checkpoint to {checkpoint}")
            k2deploy("make-checkpoint", str(checkpoint), "--preset", preset, "--force")
        log(f"exporting it to {artifact}")
        k2deploy("export", str(checkpoint), "--out", str(artifact), "--force")
    return artifact


class Server:
    """`python -m k2deploy serve` on a free port of 127.0.0.1, its output in files under `logs`."""

    def __init__(self, artifact: Path, logs: Path, max_batch: int, threads: int | None, extra: list[str]):
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout_path, self.stderr_path = logs / "serve.stdout", logs / "serve.stderr"
        command = [sys.executable, "-m", "k2deploy", "serve", str(artifact), "--port", "0", "--max-batch",
                   str(max_batch), "--max-queue", "256", "--log-level", "warning", *extra]
        if threads:
            command += ["--threads", str(threads)]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.process = subprocess.Popen(command, stdout=out, stderr=err)
        self.url, self.model = self._wait_until_up()

    def _wait_until_up(self) -> tuple[str, str]:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            match = re.search(r"serve: (\S+) on (http://\S+)/v1", self.stdout_path.read_text())
            if match:
                try:
                    if httpx.get(f"{match.group(2)}/health", timeout=5).status_code == 200:
                        return match.group(2), match.group(1)
                except httpx.TransportError:
                    pass
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited: {self.stderr_path.read_text()}")
            time.sleep(0.2)
        raise SystemExit(f"the server was not up after {STARTUP_S} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def stream_one(http: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = tokens = None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            first = first or time.perf_counter()
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"sent": sent, "ttft": first - sent, "tokens": tokens, "done": time.perf_counter()}


async def warm_up(url: str, model: str, prompt: list[int]) -> None:
    async with httpx.AsyncClient(timeout=None) as http:
        await stream_one(http, url, model, prompt, 2)


async def run_level(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    shares = [prompts[client::concurrency] for client in range(concurrency)]

    async def client(share: list[list[int]], http: httpx.AsyncClient) -> list[dict]:
        return [await stream_one(http, url, model, prompt, max_tokens) for prompt in share]

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as http:
        results = [r for share in await asyncio.gather(*(client(s, http) for s in shares)) for r in share]
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    ttft = np.array([r["ttft"] for r in results])
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "completion_tokens": tokens,
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 3),
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
            "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3)}


def main() -> None:
    summary, details = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(description=summary, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, help="an exported artifact to serve (default: make the preset's)")
    parser.add_argument("--preset", default="small", choices=["tiny", "small"], help="default: small")
    parser.add_argument("--work", type=Path, default=Path("/tmp/k2deploy-serve-load"),
                        help="where the checkpoint, artifact and server logs go (default: /tmp/k2deploy-serve-load)")
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default: 1,4,16)")
    parser.add_argument("--requests", type=int, default=4, help="requests per level at least (default: 4)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="default: 32")
    parser.add_argument("--max-tokens", type=int, default=16, help="default: 16")
    parser.add_argument("--threads", type=int, help="the server's intra-op threads (default: ONNX Runtime's)")
    parser.add_argument("--seed", type=int, default=0, help="for the random prompts (default: 0)")
    parser.add_argument("--serve-args", default="",
                        help="more `serve` options, e.g. \"--max-context 131072 --max-total-tokens 65536\" "
                             "(--max-batch is the largest concurrency unless given here)")
    parser.add_argument("--then-prompt-tokens", type=int, default=0,
                        help="after the levels, one request with a prompt of this many tokens (default: none)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    artifact = args.artifact or ensure_artifact(args.work, args.preset)
    vocab = json.loads((artifact / "manifest.json").read_text())["model_config"]["vocab_size"]
    rng = np.random.default_rng(args.seed)
    log(f"starting the server on {artifact}")
    batch_option = argparse.ArgumentParser(add_help=False)
    batch_option.add_argument("--max-batch", type=int)
    known, extra = batch_option.parse_known_args(args.serve_args.split())
    server = Server(artifact, args.work / "logs", max_batch=known.max_batch or max(levels), threads=args.threads,
                    extra=extra)
    long_prompt = None
    try:
        log(open(server.stdout_path).read().strip())
        asyncio.run(warm_up(server.url, server.model, rng.integers(0, vocab - 256, args.prompt_tokens).tolist()))
        results = []
        for concurrency in levels:
            prompts = rng.integers(0, vocab - 256, (max(concurrency, args.requests), args.prompt_tokens)).tolist()
            log(f"{concurrency} concurrent client(s), {len(prompts)} requests")
            results.append(asyncio.run(run_level(server.url, server.model, prompts, concurrency, args.max_tokens)))
        if args.then_prompt_tokens:
            log(f"then one prompt of {args.then_prompt_tokens} tokens")
            prompt = rng.integers(0, vocab - 256, (1, args.then_prompt_tokens)).tolist()
            long_prompt = asyncio.run(run_level(server.url, server.model, prompt, 1, args.max_tokens))
    finally:
        server.stop()
    sequential = next((r["tokens_per_s"] for r in results if r["concurrency"] == 1), None)
    for r in results:
        r["speedup_vs_sequential"] = round(r["tokens_per_s"] / sequential, 2) if sequential else None
    report = {"artifact": str(artifact), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "cpu": cpu_model(), "cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
              "serve_args": args.serve_args, "levels": results, "long_prompt": long_prompt}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{artifact} on {report['cpu']} x{report['cpus']} (load average {report['load_average']}); "
          f"prompts {args.prompt_tokens} tokens, {args.max_tokens} greedy tokens each")
    print(f"{'clients':>7} {'requests':>8} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'ttft p50':>8} {'ttft p99':>8} "
          f"{'speed-up':>8}")
    for r in results:
        print(f"{r['concurrency']:>7} {r['requests']:>8} {r['completion_tokens']:>6} {r['wall_s']:>7.1f} "
              f"{r['tokens_per_s']:>7.2f} {r['ttft_p50_s']:>7.2f}s {r['ttft_p99_s']:>7.2f}s "
              f"{r['speedup_vs_sequential'] or float('nan'):>7.2f}x")
    if long_prompt:
        print(f"then a prompt of {args.then_prompt_tokens} tokens: {long_prompt['completion_tokens']} tokens, time to "
              f"first token {long_prompt['ttft_p50_s']:.2f} s, done in {long_prompt['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
