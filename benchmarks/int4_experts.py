"""4-bit routed experts on the cpu target against the int8 lowering: artifact size, decode and prefill time, peak
resident memory, and what re-quantising costs in agreement with the eager reference.

    . .venv/bin/activate && python benchmarks/int4_experts.py [--preset small] [--json]

Three cpu artifacts (written under --work on the first run, reused later):
  int8             the FP8 checkpoint lowered as usual: experts as int8 blocks (1 byte a weight + scales)
  int4 (fp8 ckpt)  the same FP8 checkpoint with `export --weights int4`: experts re-quantised to INT4 groups of 32
  int4 checkpoint  a checkpoint in Kimi-K2-Thinking's INT4 layout (`make-checkpoint --format int4`, same seed:
                   other random weights of the same shapes) lowered with its own 4-bit codes
Each round runs `k2deploy generate ART --prompt-ids <prompt-len ids> --max-new-tokens <gen-len> --threads T --json`
once per artifact, in a rotating order, as a child process: its ttft_ms and tpot_ms, and its peak resident set
(ru_maxrss from wait4, what `/usr/bin/time -v` reports as "Maximum resident set size"). The table gives the median
over --rounds. Agreement: teacher-forced decoding of the reference's greedy continuation (bench/parity.py) for the
two artifacts of the FP8 checkpoint against its eager float32 reference (needs torch).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ARTIFACTS = ("int8", "int4 (fp8 ckpt)", "int4 checkpoint")


def _k2deploy(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "k2deploy", *args], check=True, stdout=subprocess.DEVNULL)


def prepare(work: Path, preset: str) -> dict[str, Path]:
    """The checkpoints and the three artifacts, made once."""
    fp8, int4 = work / f"{preset}-fp8", work / f"{preset}-int4"
    for path, fmt in ((fp8, "fp8"), (int4, "int4")):
        if not path.exists():
            _k2deploy("make-checkpoint", str(path), "--preset", preset, "--format", fmt)
    plans = {"int8": (fp8, "checkpoint"), "int4 (fp8 ckpt)": (fp8, "int4"), "int4 checkpoint": (int4, "checkpoint")}
    artifacts = {}
    for name, (checkpoint, weights) in plans.items():
        out = work / f"art-{preset}-{name.replace(' ', '-').replace('(', '').replace(')', '')}"
        if not (out / "manifest.json").exists():
            _k2deploy("export", str(checkpoint), "--out", str(out), "--target", "cpu", "--weights", weights, "--force")
        artifacts[name] = out
    return {"fp8_checkpoint": fp8, **artifacts}


def run_once(artifact: Path, prompt: list[int], gen_len: int, threads: int) -> dict:
    """One generate in a child process -> its ttft, tpot and peak RSS (bytes)."""
    child = subprocess.Popen([sys.executable, "-m", "k2deploy", "generate", str(artifact), "--prompt-ids",
                              ",".join(map(str, prompt)), "--max-new-tokens", str(gen_len), "--threads", str(threads),
                              "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        raise SystemExit(f"generate on {artifact} failed (status {status})")
    result = json.loads(out)
    return {"ttft_ms": result["ttft_ms"], "tpot_ms": result["tpot_ms"], "peak_rss": usage.ru_maxrss * 1024}


def weight_bytes(artifact: Path) -> dict:
    manifest = json.loads((artifact / "manifest.json").read_text())
    return {"total": sum(r["bytes"] for r in manifest["files"].values()),
            "experts": manifest["weight_formats"]["routed experts"]["bytes"],
            "data": sum(r["bytes"] for n, r in manifest["files"].items() if n.endswith(".data"))}


def agreement(checkpoint: Path, artifacts: dict[str, Path], steps: int) -> dict:
    import torch

    from k2deploy.core.checkpoint.reader import Checkpoint
    from k2deploy.core.manifest import load_manifest
    from k2deploy.bench import parity
    from k2deploy.export.weights import load_transformer
    from k2deploy.runtime.engine.generator import Generator
    from k2deploy.runtime.backends.native.choice import load_model

    reference = load_transformer(Checkpoint.open(checkpoint))
    prompt = list(range(5, 133))
    with torch.no_grad():
        return {name: parity.teacher_forced(reference, Generator(load_model(load_manifest(path))), prompt, steps)
                for name, path in artifacts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--work", default="/tmp/k2deploy-int4-bench", help="where checkpoints and artifacts live")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--agreement-steps", type=int, default=64, help="teacher-forced steps; 0 skips the check")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    paths = prepare(work, args.preset)
    prompt = [(7 * i + 11) % 30000 + 1 for i in range(args.prompt_len)]
    runs: dict[str, list[dict]] = {name: [] for name in ARTIFACTS}
    for round_number in range(args.rounds):
        order = ARTIFACTS[round_number % 3:] + ARTIFACTS[:round_number % 3]
        for name in order:
            runs[name].append(run_once(paths[name], prompt, args.gen_len, args.threads))
    results = {}
    for name in ARTIFACTS:
        sizes = weight_bytes(paths[name])
        results[name] = {
            "bytes": sizes, **{key: statistics.median(r[key] for r in runs[name])
                               for key in ("ttft_ms", "tpot_ms", "peak_rss")},
            "rss_over_weights": statistics.median(r["peak_rss"] for r in runs[name]) / sizes["data"]}
    if args.agreement_steps:
        measured = agreement(paths["fp8_checkpoint"], {n: paths[n] for n in ARTIFACTS[:2]}, args.agreement_steps)
        for name, value in measured.items():
            results[name]["agreement"] = value
    setup = {"preset": args.preset, "threads": args.threads, "rounds": args.rounds, "prompt_len": args.prompt_len,
             "gen_len": args.gen_len}
    if args.json:
        print(json.dumps({"setup": setup, "results": results}, indent=2))
        return
    base = results["int8"]
    print(f"{args.preset}, cpu target, batch 1, prompt {args.prompt_len}, {args.gen_len} new tokens, "
          f"{args.threads} thread(s), median of {args.rounds} interleaved rounds")
    print(f"{'artifact':<17}{'weights MB':>11}{'experts MB':>11}{'TTFT ms':>9}{'TPOT ms':>9}{'TPOT vs int8':>13}"
          f"{'peak RSS MB':>12}{'RSS/weights':>12}  agreement (argmax, mean |dlogit|)")
    for name, r in results.items():
        agree = r.get("agreement")
        said = f"{agree['argmax_agreement']:.3f}, {agree['mean_abs_logit_error']:.3f}" if agree else "-"
        print(f"{name:<17}{r['bytes']['data'] / 1e6:>11.1f}{r['bytes']['experts'] / 1e6:>11.1f}{r['ttft_ms']:>9.1f}"
              f"{r['tpot_ms']:>9.2f}{base['tpot_ms'] / r['tpot_ms']:>12.2f}x{r['peak_rss'] / 1e6:>12.1f}"
              f"{r['rss_over_weights']:>12.2f}  {said}")


if __name__ == "__main__":
    main()
