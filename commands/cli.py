"""The `k2deploy` command line: one subcommand per job, errors as one line and a non-zero exit."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..core.cache_format import NAMES as CACHE_FORMATS
from ..core.checkpoint.presets import WEIGHT_FORMATS
from ..core.targets import TARGETS
from .command import run_command, sigterm_as_interrupt
from ..core.errors import K2Error
from ..core.json_files import loads, read_small_text
from .bench_command import add_bench_parser
from .plan_command import add_plan_parser
from .serve_command import add_serve_parser
from .engines_command import add_build_engines_parser
from .output_paths import check_output_file, check_output_folder, write_output_file
from .runtime_options import add_runtime_options, add_speculative_option


def _print_json(obj: dict) -> None:
    print(json.dumps(obj, indent=2))


def cmd_make_checkpoint(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from ..core.checkpoint.presets import SHARD_BYTES, preset_config
    from ..core.checkpoint.synthetic import checkpoint_bytes, write_checkpoint

    config = preset_config(args.preset, layers=args.layers, overrides=args.set or [], weights=args.format)
    check_output_folder(args.out)
    total = checkpoint_bytes(config)
    started = time.perf_counter()
    with sigterm_as_interrupt(), tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {args.preset}",
                                      disable=args.json or None, file=sys.stderr) as bar:
        out = write_checkpoint(Path(args.out), config, seed=args.seed, shard_bytes=SHARD_BYTES[args.preset],
                               force=args.force, on_bytes=bar.update)
    result = {"path": str(out), "preset": args.preset, "format": args.format, "bytes": total,
              "layers": config.num_hidden_layers, "seconds": round(time.perf_counter() - started, 2)}
    if args.json:
        _print_json(result)
    else:
        print(f"wrote {out} ({total / 1e6:.1f} MB, {config.num_hidden_layers} layers, {args.format}) in "
              f"{result['seconds']} s")


def cmd_inspect(args: argparse.Namespace) -> None:
    from ..core.manifest import MANIFEST_FILE

    if (Path(args.path) / ".export-journal.json").exists() and not (Path(args.path) / MANIFEST_FILE).exists():
        raise K2Error(f"{args.path}: unfinished export, rerun export to resume")
    if (Path(args.path) / MANIFEST_FILE).exists():
        from ..core.inspect_artifact import describe_artifact, format_artifact
        from ..core.manifest import load_manifest

        info = describe_artifact(load_manifest(args.path, verify_hashes=args.verify), verified=args.verify)
        text = format_artifact
    else:
        if args.verify:
            raise K2Error(f"{args.path}: --verify checks an exported artifact's files against the digests its "
                          "manifest records; a checkpoint records none (pass an artifact folder)")
        from ..core.checkpoint.reader import Checkpoint
        from ..core.inspect_checkpoint import describe_checkpoint, format_checkpoint

        with Checkpoint.open(args.path) as checkpoint:
            info = describe_checkpoint(checkpoint)
        text = format_checkpoint
    print(json.dumps(info, indent=2) if args.json else text(info))


def _layer_range(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    start, sep, stop = text.partition(":")
    try:
        return int(start), int(stop)
    except ValueError:
        raise K2Error(f"--layers {text!r}: expected START:STOP, e.g. 0:4") from None


def _export_side():
    """The exporter, or a K2Error naming the extra to install (a serving host has no torch)."""
    try:
        from ..export import exporter
    except ImportError as exc:
        raise K2Error(f"exporting needs torch and onnx ({exc}): pip install 'k2deploy[export]'") from None
    return exporter


def _time_left(done: int, total: int | None, seconds: float) -> str:
    """"; 40% of the checkpoint read at 210 MB/s, about 3 min left" from the bytes read so far, or ""."""
    if not total or done <= 0 or seconds <= 0:
        return ""
    left = seconds * (total - done) / done
    when = f"{left / 60:.0f} min" if left >= 90 else f"{left:.0f} s"
    rate = done / seconds / 1e6
    return (f"; {min(done / total, 1):.0%} of the checkpoint read at {rate:.{0 if rate >= 10 else 2}f} MB/s, about "
            f"{when} left")


def cmd_export(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    exporter = _export_side()
    if not args.checkpoint.strip():  # Path("") is the working folder
        raise K2Error("the checkpoint path is empty; give the checkpoint's folder")
    check_output_folder(args.out, "--out")
    from ..core.targets import default_target

    target = args.target or default_target()
    options = exporter.ExportOptions(args.checkpoint, kv_cache=args.kv_cache, layers=_layer_range(args.layers),
                                     opset=args.opset, target=target, weights=args.weights)
    started = time.perf_counter()
    terminal = sys.stderr.isatty()
    with sigterm_as_interrupt(), tqdm(unit="B", unit_scale=True, desc="export", disable=args.json or not terminal,
                                      file=sys.stderr) as bar:
        shown = [""]

        def progress(nbytes: int, label: str) -> None:
            if shown[0] != label:
                shown[0] = label
                bar.set_description(label)
            bar.update(max(0, min(nbytes, (bar.total or 0) - bar.n)))  # never past the total

        def graph(event: dict) -> None:
            if "reused" in event:
                if not args.json:
                    print(f"export: {event['tokenizer']}", file=sys.stderr, flush=True)
                    for note in event["notes"]:
                        print(f"export: note: {note}", file=sys.stderr, flush=True)
                if event["discarded"] and not args.json:
                    print(f"export: the unfinished export in {args.out} is not kept: {event['discarded']}; writing "
                          f"every graph again", file=sys.stderr)
                if event["reused"] and not args.json:
                    print(f"export: resuming: {event['reused']} graphs kept from the unfinished export, "
                          f"{event['to_write']} to write", file=sys.stderr)
            elif terminal:
                bar.n = event["done_bytes"]  # the bar counts checkpoint bytes; the int8 lowering writes others
                bar.refresh()
            elif not args.json:  # a log, not a terminal: one line per graph, with the time left
                print(f"export: {event['stem']} written ({event['bytes'] / 1e6:.1f} MB in {event['seconds']:.1f} s)"
                      f"{_time_left(event['done_bytes'], bar.total, time.perf_counter() - started)}",
                      file=sys.stderr, flush=True)

        manifest = exporter.export_artifact(options, Path(args.out), force=args.force, on_progress=progress,
                                            on_total=lambda total: setattr(bar, "total", total), on_graph=graph)
        bar.n = bar.total or bar.n
        bar.refresh()
    summary = {"artifact": args.out, "graphs": len(manifest["graphs"]["layers"]) + 2 * manifest["complete"],
               "bytes": sum(r["bytes"] for r in manifest["files"].values()), "kv_cache": manifest["kv_cache"]["format"],
               "target": manifest["target"], "complete": manifest["complete"], "seconds": round(time.perf_counter() - started, 1)}
    if args.json:
        _print_json(summary)
    else:
        print(f"exported {summary['graphs']} graphs ({summary['bytes'] / 1e6:.1f} MB, {summary['kv_cache']} cache, "
              f"target {summary['target']}) to {args.out} in {summary['seconds']} s")


def _load_generator(args: argparse.Namespace, positions: int, manifest=None):
    """The artifact's model on the chosen backend (or placed stages) for one sequence of `positions`."""
    from ..core.manifest import load_manifest
    from ..runtime.engine.config import resolve_engine_config
    from ..runtime.engine.generator import Generator
    from ..runtime.loading import load_backend

    manifest = manifest or load_manifest(args.artifact, hash_graphs=False)  # each graph hashed as it is opened
    config = resolve_engine_config(manifest, args, cache_tokens=positions)
    return Generator(load_backend(manifest, config), config.speculative)


def _prompt_ids(text: str) -> list[int]:
    try:  # one trailing comma is forgiven; an empty id between two is not (1,,2)
        return [int(t) for t in text.strip().removesuffix(",").split(",")]
    except ValueError:
        raise K2Error(f"--prompt-ids {text!r}: expected comma-separated integers, e.g. 1,2,3") from None


def _logit_bias(items: list[str], vocab: int) -> tuple[tuple[int, float], ...]:
    """--logit-bias ID=BIAS items -> ((id, bias), ...), each id inside the vocabulary."""
    pairs = []
    for item in items:
        token, _, bias = item.partition("=")
        try:
            pair = int(token), float(bias)
        except ValueError:
            raise K2Error(f"--logit-bias {item!r}: expected TOKEN_ID=BIAS, e.g. 42=-100") from None
        if not 0 <= pair[0] < vocab:
            raise K2Error(f"--logit-bias {item!r}: token {pair[0]} is outside the vocabulary [0, {vocab})")
        pairs.append(pair)
    return tuple(pairs)


TOOLS_FILE_BYTES = 4 << 20  # a --tools file, at most (the server's request body limit)


def _read_tools(path: str) -> list[dict]:
    from ..runtime.text.chat_tools import check_tools

    try:
        tools = loads(read_small_text(path, TOOLS_FILE_BYTES, "--tools"))
    except json.JSONDecodeError as exc:
        raise K2Error(f"--tools {path}: not valid JSON ({exc})") from None
    try:
        return check_tools(tools, where=f"--tools {path}")
    except K2Error as exc:
        raise K2Error(f"{exc} (the file holds OpenAI's `tools` array)") from None


def cmd_generate(args: argparse.Namespace) -> None:
    from ..core.manifest import load_manifest
    from ..runtime.text.chat_tools import ToolSteering
    from ..runtime.text.answer import answer_stream
    from ..runtime.engine.sampling import SamplingParams
    from ..core.tokenizer_files import load_tokenizer

    if args.tools and not args.chat:
        raise K2Error("--tools needs --chat (tools are declared in the chat template)")
    manifest = load_manifest(args.artifact, hash_graphs=False)  # each graph hashed as it is opened
    tokenizer = load_tokenizer(Path(args.artifact) / "tokenizer", manifest.config.vocab_size)
    tools = _read_tools(args.tools) if args.tools else None
    steering = ToolSteering("", ())
    if args.prompt is not None:
        if tokenizer is None:
            raise K2Error(f"{args.artifact} carries no tokenizer; pass --prompt-ids instead of --prompt")
        if args.chat:
            steering = ToolSteering.plan(tokenizer, tools, "auto" if tools else "none")
            prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}], tools)
        else:
            prompt = tokenizer.encode(args.prompt)
    else:
        prompt = _prompt_ids(args.prompt_ids)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop_ids=tuple(tokenizer.stop_ids) if tokenizer else (),
                            banned_ids=steering.banned_ids, min_p=args.min_p, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                            logit_bias=_logit_bias(args.logit_bias, manifest.config.vocab_size))
    constraint = None
    if tools:  # the calls name declared functions and their arguments follow the schemas, as the server's do
        from ..runtime.text.constrained import GrammarError, Grammars, thinking_mode, tools_grammar

        try:
            constraint = Grammars(tokenizer, manifest.config.vocab_size).constraint(
                tools_grammar(tools, "auto", False, thinking_mode(tokenizer, prompt)))
        except GrammarError as exc:
            raise K2Error(f"--tools {args.tools}: {exc}") from None
    generator = _load_generator(args, len(prompt) + args.max_new_tokens, manifest)
    result = generator.generate([prompt], params, lambda ids: constraint,
                                lambda ids: answer_stream(tokenizer, ids, args.chat))[0]
    kernels = getattr(generator.model, "decode_kernels", None)  # the cpu provider's choice, and why
    if kernels:  # once it ran: a refused request's error stays the one line on stderr
        print(f"decode: {kernels}", file=sys.stderr)
    text, calls, finish_reason, reasoning = result.text, result.tool_calls, result.finish_reason, result.reasoning
    if args.json:
        _print_json({"prompt_ids": prompt, "token_ids": result.token_ids, "reasoning": reasoning or None,
                     "text": text, "tool_calls": calls, "finish_reason": finish_reason,
                     "ttft_ms": round(result.ttft_ms, 3), "tpot_ms": round(result.tpot_ms, 3),
                     "decode_kernels": kernels, "speculative": result.speculative})
    else:
        if reasoning:
            print(f"[reasoning] {reasoning}")
        print(text if text is not None else ",".join(map(str, result.token_ids)))
        for call in calls:
            print(f"tool call {call['id']}: {call['function']['name']}({call['function']['arguments']})")
        spec = result.speculative
        drafts = (f"; {spec['accepted_tokens']}/{spec['draft_tokens']} drafted tokens accepted, "
                  f"{spec['forward_steps']} forwards" if spec.get("draft_tokens") else "")
        print(f"[{len(result.token_ids)} tokens, {finish_reason}; ttft {result.ttft_ms:.1f} ms, "
              f"tpot {result.tpot_ms:.1f} ms{drafts}]", file=sys.stderr)


def cmd_score(args: argparse.Namespace) -> None:
    import numpy as np

    check_output_file(args.out, "--out")  # before the model runs
    prompt = _prompt_ids(args.prompt_ids)
    logits = _load_generator(args, len(prompt)).score(prompt)
    write_output_file(args.out, lambda out: np.save(out, logits), "--out")  # exactly the name given, no .npy added
    summary = {"out": args.out, "shape": list(logits.shape), "dtype": str(logits.dtype)}
    print(json.dumps(summary) if args.json else f"wrote {args.out}: float32 logits {list(logits.shape)}")


def cmd_quickstart(args: argparse.Namespace) -> None:
    from .quickstart import run_quickstart

    _export_side()
    check_output_folder(args.out, "--out")

    def show(row: dict) -> None:
        if not args.json:
            print(f"{row['step']:<24} {row['seconds']:>6.2f} s  {row['result']}")
            if "text" in row:
                print(f"{'':<33}text: {row['text']!r}")

    result = run_quickstart(Path(args.out), on_step=show)
    if args.json:
        _print_json(result)
    else:
        print(f"passed: parity holds; the cpu-lowered artifact is {result['artifact']}")


def _add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", help="artifact directory written by `k2deploy export`")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_runtime_options(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k2deploy",
        description="Export Kimi K2 (DeepSeek-V3 architecture) checkpoints to per-layer compiled graphs and run them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    make = sub.add_parser("make-checkpoint", help="write a synthetic checkpoint in the exact Kimi K2 layout",
                          description="Write a random checkpoint in the Kimi K2 Hugging Face layout: config.json, "
                                      "sharded safetensors (FP8 with block scales, or Kimi-K2-Thinking's INT4 "
                                      "experts), index, tokenizer.")
    make.add_argument("out", help="directory to create")
    make.add_argument("--preset", choices=["tiny", "small", "k2"], default="tiny",
                      help="tiny: tests in seconds; small: Kimi K2 attention dims, hidden 1024, for benchmarks; "
                           "k2: the real dimensions (default: tiny)")
    make.add_argument("--layers", type=int, help="number of decoder layers (default: the preset's)")
    make.add_argument("--format", choices=WEIGHT_FORMATS, default="fp8",
                      help="fp8: Kimi-K2-Instruct's FP8 e4m3 128x128 blocks; int4: Kimi-K2-Thinking's routed experts "
                           "as compressed-tensors pack-quantized INT4 (groups of 32), the rest BF16 (default: fp8)")
    make.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    make.add_argument("--set", action="append", metavar="KEY=VALUE",
                      help="override a config field, e.g. --set n_routed_experts=384 or --set rope_scaling.factor=16")
    make.add_argument("--force", action="store_true", help="replace OUT if it exists")
    make.add_argument("--json", action="store_true", help="print the result as JSON")
    make.set_defaults(func=cmd_make_checkpoint)

    inspect = sub.add_parser("inspect", help="summarise a checkpoint or an exported artifact",
                             description="For a checkpoint: config, parameter counts, bytes per layer and KV-cache "
                                         "bytes per token, from the tensor headers alone. For an artifact: its graphs, "
                                         "cache format and bytes per token, from its manifest; with --verify, "
                                         "every file hashed and checked against the manifest's digests.")
    inspect.add_argument("path", help="checkpoint or artifact directory")
    inspect.add_argument("--verify", action="store_true",
                         help="hash every file of an artifact and check it against the manifest's digests (reads the "
                              "whole artifact); without it only sizes are checked")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=cmd_inspect)

    export = sub.add_parser("export", help="export a checkpoint to per-layer ONNX graphs with an FP8 latent cache",
                            description="Trace the embedding, every decoder layer and the head with torch.export and "
                                        "write them as ONNX with the checkpoint's FP8 weights as external data. "
                                        "An interrupted export resumes where it stopped.")
    export.add_argument("checkpoint", help="Hugging Face checkpoint directory")
    export.add_argument("--out", required=True, help="artifact directory to write (e.g. artifacts/kimi-k2)")
    export.add_argument("--kv-cache", choices=CACHE_FORMATS,
                        help="latent cache format the graphs read and write: fp8 (e4m3 with a float32 scale per 128 "
                             "values, 656 bytes/token/layer on K2), int8 (codes with one float32 scale per token, "
                             "644 bytes; --target cpu) or bf16 (1152); default: the target's first, "
                             + ", ".join(f"{t.default_cache} for {t.name}" for t in TARGETS.values()))
    export.add_argument("--layers", metavar="A:B", help="export only decoder layers A..B-1 (a partial artifact)")
    export.add_argument("--opset", type=int, default=21, help="ONNX opset, 21 to 24 (default: 21)")
    export.add_argument("--target", choices=list(TARGETS),
                        help="what to lower the weights for: cpu (int8 blocks for ONNX Runtime's CPU kernels), cuda or "
                             "tensorrt (FP8 as in the checkpoint); default: tensorrt if installed, else cuda if ONNX "
                             "Runtime has its CUDA provider, else cpu")
    export.add_argument("--weights", choices=["checkpoint", "int4"], default="checkpoint",
                        help="checkpoint: the routed experts as the checkpoint stores them (an INT4 checkpoint's own "
                             "4-bit codes are always kept); int4: an FP8 checkpoint's routed experts re-quantised to "
                             "INT4 groups of 32 (about 0.6 bytes a weight instead of 1; lossy, see docs/artifact.md), for "
                             "hosts whose memory or bandwidth binds; not for tensorrt (default: checkpoint)")
    export.add_argument("--force", action="store_true", help="discard an existing artifact or unfinished export")
    export.add_argument("--json", action="store_true", help="print a summary as JSON")
    export.set_defaults(func=cmd_export)

    add_build_engines_parser(sub)

    generate = sub.add_parser("generate", help="generate tokens from an artifact (no torch needed)",
                              description="Prefill a prompt and decode with ONNX Runtime over the FP8 latent cache.")
    _add_runtime_arguments(generate)
    add_speculative_option(generate)
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (encoded with the artifact's tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    generate.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template as a user turn")
    generate.add_argument("--tools", metavar="FILE", help="with --chat: a JSON file holding OpenAI's `tools` array; "
                                                           "the model may call them and the parsed calls are printed")
    generate.add_argument("--max-new-tokens", type=int, default=32, help="default: 32")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    generate.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest, 0 for all (default: 0)")
    generate.add_argument("--min-p", type=float, default=0.0,
                          help="drop tokens less likely than this times the likeliest one (default: 0)")
    generate.add_argument("--presence-penalty", type=float, default=0.0,
                          help="OpenAI's: subtracted from a token's logit once it is in the output, -2 to 2 (default: 0)")
    generate.add_argument("--frequency-penalty", type=float, default=0.0,
                          help="OpenAI's: subtracted per time a token is in the output, -2 to 2 (default: 0)")
    generate.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="transformers': logits of tokens in the prompt or output divided (positive) or "
                               "multiplied (negative) by this (default: 1, none)")
    generate.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                          help="add BIAS (-100 to 100) to token ID's logit; repeat for several")
    generate.add_argument("--seed", type=int, help="random seed for sampling")
    generate.set_defaults(func=cmd_generate)

    score = sub.add_parser("score", help="write the logits of every prompt position",
                           description="Run one prefill and save float32 logits [prompt_len, vocab] as .npy.")
    _add_runtime_arguments(score)
    score.add_argument("--prompt-ids", required=True, help="prompt token ids, comma-separated")
    score.add_argument("--out", required=True, help="output .npy file")
    score.set_defaults(func=cmd_score)

    quickstart = sub.add_parser("quickstart", help="make the tiny checkpoint, export, check parity, generate",
                                description="The main job on the embedded default: a tiny synthetic Kimi K2 "
                                            "checkpoint, exported with FP8 and BF16 caches, checked against the eager "
                                            "reference, then used to generate.")
    quickstart.add_argument("--out", default="artifacts/quickstart", help="working directory (default: artifacts/quickstart)")
    quickstart.add_argument("--json", action="store_true", help="print the result as JSON")
    quickstart.set_defaults(func=cmd_quickstart)

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(args.command, lambda: args.func(args))
