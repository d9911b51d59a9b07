"""What the plan tests share: checkpoint bytes by the safetensors dtypes, and `k2deploy plan` through its parser."""

import argparse

from k2deploy.commands.plan_command import add_plan_parser

ITEMSIZE = {"F8_E4M3": 1, "BF16": 2, "F32": 4}


def nbytes(specs) -> int:
    return sum(s.numel * ITEMSIZE[s.dtype] for s in specs)


def run_plan(*argv: str) -> None:
    """`k2deploy plan ARGV` through the parser the main CLI registers."""
    parser = argparse.ArgumentParser(prog="k2deploy")
    add_plan_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", *argv])
    args.func(args)
