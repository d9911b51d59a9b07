"""The `k2deploy` command line: one subcommand per job, errors as one line and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .errors import K2Error


def _print_json(obj: dict) -> None:
    print(json.dumps(obj, indent=2))


def cmd_make_checkpoint(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from .checkpoint.presets import SHARD_BYTES, preset_config
    from .checkpoint.synthetic import checkpoint_bytes, write_checkpoint

    config = preset_config(args.preset, layers=args.layers, overrides=args.set or [])
    total = checkpoint_bytes(config)
    started = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {args.preset}", disable=args.json or None,
              file=sys.stderr) as bar:
        out = write_checkpoint(Path(args.out), config, seed=args.seed, shard_bytes=SHARD_BYTES[args.preset],
                               force=args.force, on_bytes=bar.update)
    result = {"path": str(out), "preset": args.preset, "bytes": total,
              "layers": config.num_hidden_layers, "seconds": round(time.perf_counter() - started, 2)}
    if args.json:
        _print_json(result)
    else:
        print(f"wrote {out} ({total / 1e6:.1f} MB, {config.num_hidden_layers} layers) in {result['seconds']} s")


def cmd_inspect(args: argparse.Namespace) -> None:
    from .checkpoint.reader import Checkpoint
    from .inspect_checkpoint import describe_checkpoint, format_checkpoint

    with Checkpoint.open(args.path) as checkpoint:
        info = describe_checkpoint(checkpoint)
    if args.json:
        _print_json(info)
    else:
        print(format_checkpoint(info))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k2deploy",
        description="Export Kimi K2 (DeepSeek-V3 architecture) checkpoints to per-layer compiled graphs and run them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    make = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the exact Kimi K2 layout",
                          description="Write a random checkpoint in the Kimi K2 Hugging Face layout: config.json, "
                                      "sharded FP8 safetensors with block scales, index, tokenizer.")
    make.add_argument("out", help="directory to create")
    make.add_argument("--preset", choices=["tiny", "small", "k2"], default="tiny",
                      help="tiny: tests in seconds; small: Kimi K2 attention dims, hidden 1024, for benchmarks; "
                           "k2: the real dimensions (default: tiny)")
    make.add_argument("--layers", type=int, help="number of decoder layers (default: the preset's)")
    make.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    make.add_argument("--set", action="append", metavar="KEY=VALUE",
                      help="override a config field, e.g. --set n_routed_experts=384 or --set rope_scaling.factor=16")
    make.add_argument("--force", action="store_true", help="replace OUT if it exists")
    make.add_argument("--json", action="store_true", help="print the result as JSON")
    make.set_defaults(func=cmd_make_checkpoint)

    inspect = sub.add_parser("inspect", help="summarise a checkpoint: config, parameters, bytes, KV-cache sizes",
                             description="Read a checkpoint's config and tensor headers (no weights) and report "
                                         "parameter counts, bytes per layer and KV-cache bytes per token.")
    inspect.add_argument("path", help="checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except K2Error as exc:
        print(f"k2deploy {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"k2deploy {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0
