"""How much whitespace a weak model pads a constrained JSON answer with: answers sampled from random logits (the
worst case of a model that has learned nothing) under the JSON grammar, for each whitespace rule given, and the
tokens and whitespace characters they take.

    . .venv/bin/activate && python benchmarks/json_padding.py ART [--answers 30] [--pattern REGEX ...] [--json]

(from the repository root; ART: an artifact with a tokenizer, e.g. the tiny preset exported). Each answer follows
a three-field schema (a string of at most 12 characters, an enum, an optional integer); at each step the next token
is drawn from softmax(random normal logits) under the grammar's mask, and the answer ends, once the JSON is
complete, with probability one half a step. Patterns: "compact" (no whitespace at all), the runtime's
(runtime/text/constrained.py WHITESPACE) and any given with --pattern.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from k2deploy.core.manifest import load_manifest
from k2deploy.core.tokenizer_files import load_tokenizer
from k2deploy.runtime.text import constrained

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "unit": {"enum": ["celsius", "fahrenheit"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "unit"], "additionalProperties": False}
MAX_TOKENS = 2000


def answers(tokenizer, vocab: int, pattern: str, count: int) -> dict:
    """`count` answers under the whitespace rule `pattern` -> their token and whitespace counts."""
    constrained.JSON_OPTIONS = ({"whitespace_flexible": False} if pattern == "compact" else
                                {"whitespace_flexible": True, "whitespace_pattern": pattern})
    grammars = constrained.Grammars(tokenizer, vocab)
    tokens, blanks = [], []
    for seed in range(count):
        rng = np.random.default_rng(seed)
        constraint = grammars.constraint(constrained.json_grammar(SCHEMA))
        out = []
        while len(out) < MAX_TOKENS and not (constraint.matcher.is_accepting() and rng.random() < 0.5):
            allowed = constraint.allowed(rng.standard_normal(vocab).astype(np.float32))
            weights = np.exp(allowed - allowed.max())
            token = int(rng.choice(vocab, p=weights / weights.sum()))
            constraint.consume(token)
            out.append(token)
        text = tokenizer.decode(out)
        tokens.append(len(out))
        blanks.append(sum(ch in " \t\r\n" for ch in text))
    return {"pattern": pattern, "answers": count, "tokens_mean": statistics.mean(tokens), "tokens_max": max(tokens),
            "whitespace_mean": statistics.mean(blanks), "whitespace_max": max(blanks)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="an artifact with a tokenizer")
    parser.add_argument("--answers", type=int, default=30, help="answers per pattern (default 30)")
    parser.add_argument("--pattern", action="append", default=[], help="another whitespace rule to measure")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.answers < 1:
        parser.error("--answers: at least 1")
    if not (args.artifact / "manifest.json").is_file():
        parser.error(f"{args.artifact}: not an artifact directory (no manifest.json)")
    vocab = load_manifest(args.artifact, verify_hashes=False).config.vocab_size
    tokenizer = load_tokenizer(args.artifact / "tokenizer", vocab)
    if tokenizer is None:
        parser.error(f"{args.artifact}: the artifact has no tokenizer")
    results = [answers(tokenizer, vocab, p, args.answers) for p in ["compact", constrained.WHITESPACE, *args.pattern]]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        print(f"{r['pattern']!r}: tokens mean {r['tokens_mean']:.0f}, max {r['tokens_max']}; whitespace characters "
              f"mean {r['whitespace_mean']:.0f}, max {r['whitespace_max']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
