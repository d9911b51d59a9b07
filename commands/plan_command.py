"""`k2deploy plan`: the command over k2deploy.core.plan, for an artifact, a checkpoint or a preset."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..core.cache_format import NAMES
from ..core.config import ModelConfig
from ..core.errors import K2Error
from ..core.placement import DEVICES, USABLE_FRACTION
from ..core.plan import format_plan, plan

DESCRIPTION = """\
Place the decoder layers on pipeline stages, one contiguous range per device, and report what each
device holds (weights as the checkpoint stores them, its slice of the latent cache at --batch x
--context, an activation estimate) against its memory, and the memory-bandwidth bound of decode.
Only the hidden state crosses between stages; the embedding lives with the first stage, the final
norm and lm_head with the last. By formula from the config: no weights are read."""


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `k2deploy plan` on the main parser's subcommands."""
    parser = subparsers.add_parser("plan", help="place the layers on devices; memory per device and the decode bound",
                                   description=DESCRIPTION)
    parser.add_argument("source", nargs="?", metavar="ART | CKPT",
                        help="artifact directory (manifest.json) or checkpoint directory (config.json); or --preset")
    parser.add_argument("--preset", choices=["k2", "small", "tiny"],
                        help="a known config instead of a directory: k2 is Kimi-K2-Instruct's")
    parser.add_argument("--devices", required=True, metavar="COUNTxKIND",
                        help=f"the devices, e.g. 16xH200; KIND is {', '.join(DEVICES)} or "
                             f"MEMORY@BANDWIDTH such as 512GB@0.2TB/s; a plan fills {USABLE_FRACTION:g} of each "
                             f"one's memory")
    parser.add_argument("--hosts", type=int, default=1,
                        help="hosts the devices are split over evenly, cuda:0.. on each (default: 1)")
    parser.add_argument("--context", type=int,
                        help="cache length per sequence in tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    parser.add_argument("--kv-cache", choices=list(NAMES),
                        help="latent cache format (default: the artifact's, else fp8)")
    parser.add_argument("--placement", metavar="TEXT",
                        help="layer ranges per device instead of the balanced one, e.g. 0:31@cuda:0,31:61@cuda:1; "
                             "hN/cuda:M puts a device on host N; every device is one of --devices (for cpu give its "
                             "memory and bandwidth: --devices 1x512GB@0.2TB/s --placement 0:61@cpu)")
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
    info = plan(config, args.devices, hosts=args.hosts, context=args.context, batch=args.batch,
                cache_format=cache_format, placement=args.placement)
    print(json.dumps(info, indent=2) if args.json else format_plan(info))
