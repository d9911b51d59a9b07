"""The options every command that runs an artifact shares (generate, score, bench, serve): which backend and
ONNX Runtime provider run it, where its stages go, and the size of the process's thread pool. Their choices come
from `core/targets.py`."""

from __future__ import annotations

import argparse

from ..core.targets import BACKENDS, PROVIDERS
from ..runtime.backends.native.decoder import DECODE_KERNELS
from ..runtime.engine.speculation import MODES


def add_runtime_options(parser: argparse.ArgumentParser, threads_help: str = "") -> None:
    """Adds --backend, --placement, --ray, --provider, --threads and --decode to a command that runs an artifact."""
    parser.add_argument("--backend", choices=BACKENDS, default="onnxruntime",
                        help="onnxruntime (default; --provider applies) or tensorrt (the engines of "
                             "`k2deploy build-engines` for this GPU)")
    parser.add_argument("--placement", metavar="auto|RANGES",
                        help="run the layers as pipeline stages: auto (one stage per visible GPU, or one cpu stage), "
                             "or ranges such as 0:31@cuda:0,31:61@cuda:1 (cpu too; hN/ names host N, on Ray); each "
                             "stage is checked against its device's memory")
    parser.add_argument("--ray", metavar="auto|ADDRESS",
                        help="run the stages on Ray actors: auto joins (or starts) the cluster of this host, "
                             "ADDRESS joins HOST:PORT; --placement defaults to auto")
    parser.add_argument("--provider", choices=PROVIDERS, default="cpu",
                        help="ONNX Runtime execution provider (default: cpu)")
    parser.add_argument("--threads", type=int, help="the process's one intra-op thread pool, shared by every graph"
                                                    f"{threads_help} (default: this host's physical cores)")
    parser.add_argument("--decode", choices=DECODE_KERNELS, default="auto",
                        help="how a decode step runs on the cpu provider: native (the C decode step of "
                             "runtime/backends/native, built once with the system's compiler), onnx (the graphs), "
                             "auto (default: native where the artifact and host allow it and it measured no slower, "
                             "else the graphs)")


def add_speculative_option(parser: argparse.ArgumentParser) -> None:
    """Adds --speculative to a command that generates (generate, bench, serve)."""
    parser.add_argument("--speculative", choices=MODES, default="auto",
                        help="auto (default): tokens the request's own prompt and output suggest are drafted and "
                             "checked several a forward where the measured acceptance says it pays, giving exactly "
                             "the tokens and logprobs of off (only where the backend's forward of several positions "
                             "is exact: the native step); off: one token a forward")
