"""`k2deploy plan`: the command over k2deploy.core.plan, for an artifact, a checkpoint or a preset."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..core.cache_format import NAMES
from ..core.config import ModelConfig
from ..core.errors import K2Error
from ..core.expert_parallel import INTER_HOST_BYTES_PER_S, expert_parallel, format_expert_parallel
from ..core.held_weights import WEIGHTS, ModelBytes
from ..core.placement import DEVICES, USABLE_FRACTION, format_bytes, parse_bandwidth, parse_devices
from ..core.plan import format_plan, plan
from ..core.plan_compare import by_weights, format_by_weights, format_pp_vs_ep, pp_vs_ep

DESCRIPTION = """\
Place the model on devices and report what each device holds (weights in the --weights format,
its share of the latent cache at --batch x --context, an activation estimate) against its memory,
and the memory-bandwidth bound of decode, for each --weights format side by side. --parallel pp
(the default) puts contiguous ranges of decoder layers on pipeline stages: only the hidden state
crosses between stages; the embedding lives with the first stage, the final norm and lm_head with
the last. --parallel ep shards the routed experts of every MoE layer over all devices and keeps
the rest on each (attention data-parallel), with the all-to-all per MoE layer, and prints it beside
the pipeline plan of the same devices. By formula from the config: no weights are read; the
figures are bounds, not measurements."""


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `k2deploy plan` on the main parser's subcommands."""
    parser = subparsers.add_parser("plan", help="place the layers on devices; memory per device and the decode bound",
                                   description=DESCRIPTION)
    parser.add_argument("source", nargs="?", metavar="ART | CKPT",
                        help="artifact directory (manifest.json) or checkpoint directory (config.json); or --preset")
    parser.add_argument("--preset", choices=["k2", "small", "tiny"],
                        help="a known config instead of a directory: k2 is Kimi-K2-Instruct's")
    parser.add_argument("--devices", required=True, metavar="COUNTxKIND",
                        help=f"the devices, e.g. 16xH200; KIND is {', '.join(DEVICES)}, MEMORY@BANDWIDTH such as "
                             f"512GB@0.2TB/s, or a CPU host CPU:MEMORY@BANDWIDTH such as CPU:768GB@0.3TB/s (its RAM "
                             f"and memory bandwidth, both required: plan measures nothing); a plan fills "
                             f"{USABLE_FRACTION:g} of each one's memory")
    parser.add_argument("--hosts", type=int, default=1,
                        help="hosts the devices are split over evenly, cuda:0.. on each (default: 1)")
    parser.add_argument("--context", type=int,
                        help="cache length per sequence in tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    parser.add_argument("--kv-cache", choices=list(NAMES),
                        help="latent cache format (default: the artifact's, else fp8)")
    parser.add_argument("--placement", metavar="TEXT",
                        help="layer ranges per device instead of the balanced one, e.g. 0:31@cuda:0,31:61@cuda:1; "
                             "hN/cuda:M puts a device on host N; every device is one of --devices (a CPU host "
                             "places on cpu by itself: --devices 1xCPU:512GB@0.2TB/s; hN/cpu for host N)")
    parser.add_argument("--parallel", choices=["pp", "ep"], default="pp",
                        help="pp: layer ranges on pipeline stages (default); ep: routed experts sharded over all "
                             "devices, everything else on each, printed beside pp")
    parser.add_argument("--weights", choices=list(WEIGHTS),
                        help="how the projections are held: stored (as the checkpoint: FP8 with 128x128 block "
                             "scales), int8 (the cpu target's int8 blocks, 1 byte per value + a float32 scale per "
                             "block of up to 128), int4 (routed experts as 4-bit codes with a BF16 scale per 32, "
                             "0.5625 bytes per value; the rest int8); default: int8 on CPU hosts, else stored")
    parser.add_argument("--link", metavar="BANDWIDTH",
                        help="--parallel ep: one device to another within a host, one direction, e.g. 450GB/s "
                             "(default: the kind's own, e.g. NVLink 900 GB/s both ways for H200: 450GB/s)")
    parser.add_argument("--inter-host", metavar="BANDWIDTH", default=f"{INTER_HOST_BYTES_PER_S // 10**9}GB/s",
                        help="--parallel ep: one device's network link to other hosts, one direction (default: "
                             "%(default)s, a 400 Gb/s NIC per device: an assumption)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=cmd_plan)
    return parser


def _load_config(args: argparse.Namespace) -> tuple[ModelConfig, str]:
    """(config, cache format) from --preset, an artifact or a checkpoint."""
    if (args.source is None) == (args.preset is None):
        raise K2Error("give an artifact or checkpoint directory, or --preset k2|small|tiny (one of them)")
    if args.preset is not None:
        from ..core.checkpoint.presets import preset_config

        return preset_config(args.preset), args.kv_cache or "fp8"
    from ..core.manifest import MANIFEST_FILE, load_manifest

    path = Path(args.source)
    if (path / MANIFEST_FILE).exists():
        manifest = load_manifest(path, verify_hashes=False)
        exported = manifest.kv_cache["format"]
        if args.kv_cache not in (None, exported):
            raise K2Error(f"{path} reads and writes the {exported} cache; drop --kv-cache or re-export with "
                          f"--kv-cache {args.kv_cache}")
        return manifest.config, exported
    if (path / "config.json").exists():
        return ModelConfig.from_file(path / "config.json"), args.kv_cache or "fp8"
    raise K2Error(f"{path}: neither an artifact (no {MANIFEST_FILE}) nor a checkpoint (no config.json)")


def cmd_plan(args: argparse.Namespace) -> None:
    config, cache_format = _load_config(args)
    weights = args.weights or parse_devices(args.devices)[0].default_weights
    workload = dict(hosts=args.hosts, context=args.context, batch=args.batch, cache_format=cache_format)

    def run_pp(held: str) -> dict:
        return plan(config, args.devices, placement=args.placement, weights=held, **workload)

    def run_ep(held: str) -> dict:
        return expert_parallel(config, args.devices, weights=held, inter_host=parse_bandwidth(args.inter_host,
                               "--inter-host"), link=args.link and parse_bandwidth(args.link, "--link"), **workload)

    if args.parallel == "ep" and args.placement is not None:
        raise K2Error("--placement places layer ranges for --parallel pp; --parallel ep places the experts itself")
    run = run_ep if args.parallel == "ep" else run_pp
    info = by_weights(run, weights, lambda held: ModelBytes.of(config, held, cache_format).total)
    if args.parallel == "ep":
        info["pp_vs_ep"] = pp_vs_ep(lambda: plan(config, args.devices, weights=weights, **workload), info)
    if args.json:
        print(json.dumps(info, indent=2))
        return
    lines = [format_expert_parallel(info) if args.parallel == "ep" else format_plan(info), ""]
    lines += format_by_weights(info["weights_compared"])
    if args.parallel == "ep":
        lines += ["", *format_pp_vs_ep(info["pp_vs_ep"], info["batch"])]
    print("\n".join(lines))
