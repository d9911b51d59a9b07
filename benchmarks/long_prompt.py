"""Long prompts, measured: prefill time and peak resident memory of one prompt of 512 / 2K / 8K / 32K tokens, each
in a process of its own, against the bound 1.3 x (weight bytes + the prompt's cache bytes) + 300 MB.

    . .venv/bin/activate && python benchmarks/long_prompt.py ART [--lengths 512,2048,8192,32768] [--json]

(from the repository root; ART e.g. `k2deploy export CKPT --out ART --target cpu` of a `small` checkpoint). A
child loads the artifact and runs the prompt through the step loop, as `generate` does, with one token to
generate; its peak RSS is the kernel's (`os.wait4`, as `/usr/bin/time -v` reports it). The attention's
transient memory stays flat because the prefill chunk shrinks as the context grows (core/sizes.py
`prefill_chunk`): the table says the chunk each length ends with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from k2deploy.core.cache_format import PAGE_SIZE, CacheFormat
from k2deploy.core.manifest import load_manifest
from k2deploy.core.sizes import prefill_chunk

_CHILD = """
import json, sys, time
import numpy as np
from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.engine.sampling import SamplingParams
model = load_model(load_manifest(sys.argv[1]), threads=int(sys.argv[3]) or None)
prompt = np.random.default_rng(0).integers(3, model.config.vocab_size, int(sys.argv[2])).tolist()
started = time.perf_counter()
result = Generator(model).generate([prompt], SamplingParams(max_new_tokens=1))[0]
print(json.dumps({"seconds": time.perf_counter() - started, "threads": model.threads}))
"""


def run(artifact: str, length: int, threads: int) -> dict:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, artifact, str(length), str(threads)],
                             stdout=subprocess.PIPE, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        raise SystemExit(f"the {length}-token prompt failed (status {status})")
    return json.loads(out) | {"peak_rss_bytes": usage.ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--lengths", default="512,2048,8192,32768")
    parser.add_argument("--threads", type=int, default=0, help="the children's intra-op pool (default: the cores)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    manifest = load_manifest(args.artifact)
    config = manifest.config
    weights = sum(r["bytes"] for name, r in manifest.data["files"].items() if name.startswith("graphs/"))
    per_token = CacheFormat.from_manifest(manifest.kv_cache).bytes_per_token_per_layer * config.num_hidden_layers
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        cache = -(-(length + 1) // PAGE_SIZE) * PAGE_SIZE * per_token
        measured = run(args.artifact, length, args.threads)
        bound = 1.3 * (weights + cache) + 300e6
        rows.append({"prompt_tokens": length, "prefill_s": round(measured["seconds"], 2),
                     "prefill_tokens_per_s": round(length / measured["seconds"], 1),
                     "last_chunk": prefill_chunk(1, config.num_attention_heads, length),
                     "peak_rss_mb": round(measured["peak_rss_bytes"] / 1e6, 1), "bound_mb": round(bound / 1e6, 1),
                     "within": measured["peak_rss_bytes"] <= bound, "threads": measured["threads"]})
    doc = {"artifact": args.artifact, "weight_bytes": weights, "cache_bytes_per_token": per_token, "lengths": rows}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{args.artifact}: weights {weights / 1e6:.1f} MB, cache {per_token} bytes per token")
    print("prompt  prefill s  tokens/s  last chunk  peak RSS MB  bound MB  within")
    for r in rows:
        print(f"{r['prompt_tokens']:>6}  {r['prefill_s']:>9}  {r['prefill_tokens_per_s']:>8}  {r['last_chunk']:>10}  "
              f"{r['peak_rss_mb']:>11}  {r['bound_mb']:>8}  {r['within']}")


if __name__ == "__main__":
    main()
