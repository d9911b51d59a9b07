"""The `build-engines` command, for `k2deploy.commands.cli` to register."""

from __future__ import annotations

import argparse
import json
import sys
import time



def add_build_engines_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `k2deploy build-engines` to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "build-engines", help="build a TensorRT engine per graph of an artifact (needs an NVIDIA GPU and TensorRT)",
        description="Rewrite every graph of an exported artifact into its TensorRT copy (custom ops as plugins, FP8 "
                    "through explicit Q/DQ), parse it into a strongly typed network with prefill and decode "
                    "optimisation profiles, and build one engine per graph into ART/engines/<gpu>/ with a record "
                    "of the GPU, TensorRT version and manifest hash. Kept engines that still fit are reused.")
    parser.add_argument("artifact", help="artifact directory written by `k2deploy export`")
    parser.add_argument("--gpu", default="auto", help="CUDA device to build on: auto (device 0) or an index")
    parser.add_argument("--max-batch", type=int, default=8, help="largest batch the profiles cover (default: 8)")
    parser.add_argument("--max-seq", type=int, default=4096,
                        help="largest prompt and cache length the profiles cover (default: 4096)")
    parser.add_argument("--workspace", type=float, metavar="GB", help="builder workspace limit in GB "
                        "(default: TensorRT's, the GPU's memory)")
    parser.add_argument("--no-aot", action="store_true",
                        help="use the Python (just-in-time) plugin kernels only: no triton needed at build time, "
                             "but the engines need the Python plugins at run time")
    parser.add_argument("--verbose", action="store_true", help="show TensorRT's builder log")
    parser.add_argument("--json", action="store_true", help="print the engine record as JSON")
    parser.set_defaults(func=cmd_build_engines)
    return parser


def cmd_build_engines(args: argparse.Namespace) -> None:
    from ..export.tensorrt_engines import build_engines

    started = time.perf_counter()
    record = build_engines(args.artifact, gpu=args.gpu, max_batch=args.max_batch, max_seq=args.max_seq,
                           workspace_gb=args.workspace, aot=not args.no_aot, verbose=args.verbose,
                           on_graph=lambda stem, what: None if args.json else print(f"{stem:<12} {what}",
                                                                                     file=sys.stderr))
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(f"built {len(record['engines'])} engines for {record['gpu']['name']} with TensorRT {record['tensorrt']} "
              f"into {record['directory']} in {time.perf_counter() - started:.1f} s")
