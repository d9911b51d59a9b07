"""What constrained decoding costs per decoded token: the grammar engine's mask, applied to the logits, and the
sampled token read back, for every row of a step, against the step's own time without a grammar.

    . .venv/bin/activate && python benchmarks/constrained_decoding.py ART [--batch 1,8] [--tokens 64] [--json]

(from the repository root; ART: an artifact with a tokenizer, e.g. the `small` preset exported with --target cpu).
For each batch size: the time per output token of `--tokens` greedy tokens without a grammar (the step loop, as
`generate` runs it), then the same number of steps of masking alone: every row holds a matcher of a JSON schema
answer (runtime/text/constrained.py) and samples its next token from the model's vocabulary under the mask (random
logits: the mask's cost depends on the grammar's state, not on the values). The mask cost is per row, in turn,
on the step loop's thread: at batch B a step pays it B times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from k2deploy.bench.device import cpu_model
from k2deploy.core.manifest import load_manifest
from k2deploy.core.tokenizer_files import load_tokenizer
from k2deploy.runtime.text.constrained import Grammars, json_grammar
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.engine.sampling import SamplingParams, sample

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]},
    "forecast": {"type": "array", "items": {"type": "object", "properties": {
        "day": {"type": "integer", "minimum": 1, "maximum": 14}, "summary": {"type": "string", "maxLength": 60}},
        "required": ["day", "summary"], "additionalProperties": False}}},
    "required": ["city", "unit", "forecast"], "additionalProperties": False}


def mask_ms_per_step(grammars: Grammars, batch: int, steps: int, vocab: int, seed: int = 0) -> float:
    """Median ms of one step's masking and matcher updates over `batch` rows (the sampling between them is not
    counted: a step pays it with or without a grammar)."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=1.0)
    rows = [grammars.constraint(json_grammar(SCHEMA)) for _ in range(batch)]
    times = []
    for _ in range(steps):
        logits = rng.normal(size=(batch, vocab)).astype(np.float32) * 4
        spent = 0.0
        for i, constraint in enumerate(rows):
            started = time.perf_counter()
            allowed = constraint.allowed(logits[i])
            spent += time.perf_counter() - started
            token = sample(allowed, params, rng)  # sampling is paid with or without a grammar: not counted
            if token in grammars.tokenizer.stop_ids:  # the answer is complete: a new one in its place
                rows[i] = grammars.constraint(json_grammar(SCHEMA))
                continue
            started = time.perf_counter()
            constraint.consume(token)
            spent += time.perf_counter() - started
        times.append(spent * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated (default: 1,8)")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per measurement (default: 64)")
    parser.add_argument("--threads", type=int, help="ONNX Runtime threads (default: the physical cores)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    manifest = load_manifest(args.artifact)
    tokenizer = load_tokenizer(Path(args.artifact) / "tokenizer", manifest.config.vocab_size)
    if tokenizer is None:
        sys.exit(f"{args.artifact} has no tokenizer: a grammar needs the vocabulary's text")
    model = load_model(manifest, threads=args.threads)
    generator, vocab = Generator(model), manifest.config.vocab_size
    grammars = Grammars(tokenizer, vocab)
    started = time.perf_counter()
    grammars.constraint(json_grammar(SCHEMA))
    first_ms = (time.perf_counter() - started) * 1e3  # the vocabulary's conversion, once per server
    prompt = tokenizer.encode("Give the week's weather for the harbour town as JSON.")
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        params = SamplingParams(max_new_tokens=args.tokens)
        generator.generate([prompt] * batch, params)  # warm-up
        tpot = statistics.median(g.tpot_ms for g in generator.generate([prompt] * batch, params))
        mask = mask_ms_per_step(grammars, batch, args.tokens, vocab)
        rows.append({"batch": batch, "tpot_ms": round(tpot, 3), "mask_ms_per_step": round(mask, 3),
                     "mask_ms_per_row": round(mask / batch, 3), "mask_share_of_tpot": round(mask / tpot, 4)})
    result = {"artifact": str(args.artifact), "cpu": cpu_model(), "threads": model.threads, "vocab": vocab,
              "first_grammar_ms": round(first_ms, 1), "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{args.artifact}: vocab {vocab}, {model.threads} threads, {cpu_model()}; first grammar (vocabulary "
          f"conversion included) {first_ms:.0f} ms")
    print(f"{'batch':>5} {'TPOT ms':>8} {'mask ms/step':>13} {'per row':>8} {'% of TPOT':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['tpot_ms']:>8.2f} {r['mask_ms_per_step']:>13.3f} {r['mask_ms_per_row']:>8.3f} "
              f"{100 * r['mask_share_of_tpot']:>9.1f}%")


if __name__ == "__main__":
    main()
