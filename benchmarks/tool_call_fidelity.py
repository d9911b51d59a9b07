"""Tool-call fidelity as Moonshot's K2-Vendor-Verifier scores a deployment, on requests of the shapes agent clients
send (benchmarks/agent_requests.json), through the official `openai` client against the server run in this process:

    . .venv/bin/activate && python benchmarks/tool_call_fidelity.py ART [--requests FILE] [--temperature T]
        [--seed S] [--decode auto|native|onnx] [--json]

(from the repository root; ART: an artifact with a tokenizer that has Kimi K2's tool-call tokens, e.g. the tiny or
small preset exported with --target cpu). Every request is sent twice, non-streamed and streamed, in two runs:

  model     the artifact's own answers (temperature T, seed S): requests answered (HTTP 200); the schema accuracy,
            every returned call's name declared and its arguments parsed (json.loads) and valid against its tool's
            `parameters` (jsonschema), which must be 100%; and between the streamed and the non-streamed answer
            (the same seed: the same answer) the finish_reason agreement and the F1 of finish_reason ==
            "tool_calls", the verifier's trigger similarity measured against ourselves
  scripted  the model's head made to write each request's intended answer (bench/scripted_head.py): the share of
            intended calls (id, name, arguments) and texts returned byte for byte, streamed and not, and their
            schema accuracy, both of which must be 100%: no grammar, parser or renaming bent an answer that was
            already right

Exit status 1 where a must-be-100% figure is not.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

import jsonschema
import openai
from starlette.testclient import TestClient

from k2deploy.bench.scripted_head import ScriptedHead
from k2deploy.core.manifest import load_manifest
from k2deploy.core.tokenizer_files import load_tokenizer
from k2deploy.runtime.text.chat_tools import ToolSteering, calls_made
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.backends.native.decoder import DECODE_KERNELS
from k2deploy.runtime.engine.config import resolve_engine_config
from k2deploy.runtime.serve.app import build_app
from k2deploy.runtime.serve.engine_thread import Engine
from k2deploy.runtime.serve.metrics import ServerMetrics
from k2deploy.runtime.text.tool_calls import KIMI_K2_MARKERS

MODEL = "k2deploy"
REQUESTS = Path(__file__).with_name("agent_requests.json")
END = "<|im_end|>"


@contextmanager
def served(model, config, tokenizer):
    """The OpenAI-compatible server over `model` as `config` sizes it, in this process -> an `openai` client of it."""
    metrics = ServerMetrics()
    engine = Engine(model, config, metrics)
    with TestClient(build_app(engine, tokenizer, MODEL, metrics)) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def body(record: dict, tools: dict, **extra) -> dict:
    """One recorded request as the client sends it."""
    sent = {"model": MODEL, "messages": record["messages"], "tools": [tools[name] for name in record["tools"]],
            "max_tokens": record.get("max_tokens", 96), **extra}
    for key in ("tool_choice", "parallel_tool_calls", "user"):
        if key in record:
            sent[key] = record[key]
    return sent


def ask(client, sent: dict, stream: bool, stream_options: dict | None) -> dict:
    """The answer's text, calls [(id, name, arguments)] and finish_reason, assembled from the stream where
    `stream`; {"error": ...} where the server refused or failed it."""
    try:
        if not stream:
            choice = client.chat.completions.create(**sent).choices[0]
            calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            return {"text": choice.message.content or "", "calls": calls, "finish": choice.finish_reason}
        text, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(**sent, stream=True, stream_options=stream_options):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, [delta.id, delta.function.name, ""])
                    call[2] += delta.function.arguments or ""
                finish = choice.finish_reason or finish
        return {"text": text, "calls": [tuple(calls[i]) for i in sorted(calls)], "finish": finish}
    except openai.APIError as exc:
        return {"error": str(exc)[:200]}


def schema_checks(answer: dict, record: dict, tools: dict) -> list[bool]:
    """Per call of an answer that ended with its calls (finish_reason "tool_calls"; calls cut by max_tokens are
    counted apart, as the verifier does): its name declared and its arguments JSON that validates against its
    parameters."""
    checks = []
    for _, name, arguments in answer.get("calls", []) if answer.get("finish") == "tool_calls" else []:
        ok = name in record["tools"]
        if ok:
            try:
                jsonschema.validate(json.loads(arguments), tools[name]["function"].get("parameters", {}))
            except (ValueError, jsonschema.ValidationError):
                ok = False
        checks.append(ok)
    return checks


def f1(pairs: list[tuple[bool, bool]]) -> float | None:
    """F1 of the second against the first of each pair (None without a positive on either side)."""
    tp = sum(a and b for a, b in pairs)
    fp, fn = sum(b and not a for a, b in pairs), sum(a and not b for a, b in pairs)
    return None if tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)


def model_run(client, requests: list[dict], tools: dict, temperature: float, seed: int) -> dict:
    answered, checks, cut, finishes = 0, [], 0, []
    for record in requests:
        sent = body(record, tools, temperature=temperature, seed=seed)
        whole, streamed = ask(client, sent, False, None), ask(client, sent, True, record.get("stream_options"))
        for answer in (whole, streamed):
            answered += "error" not in answer
            checks += schema_checks(answer, record, tools)
            cut += len(answer.get("calls", [])) if answer.get("finish") == "length" else 0
        finishes.append((whole.get("finish"), streamed.get("finish")))
    return {"requests": len(requests) * 2, "answered": answered, "calls": len(checks), "calls_cut_by_length": cut,
            "schema_accuracy": sum(checks) / len(checks) if checks else None,
            "finish_agreement": sum(a == b for a, b in finishes) / len(finishes),
            "trigger_f1": f1([(a == "tool_calls", b == "tool_calls") for a, b in finishes])}


def intended_text(record: dict) -> tuple[str, list[tuple[str, str, str]]]:
    """The answer a request intends as the model writes it, and the calls [(id, name, arguments)] it makes."""
    intended = record["intended"]
    if isinstance(intended, str):
        return intended + END, []
    m, first = KIMI_K2_MARKERS, calls_made(record["messages"])
    calls = [(f"functions.{c['name']}:{first + i}", c["name"], c["arguments"]) for i, c in enumerate(intended)]
    section = "".join(f"{m.call_begin}{call_id}{m.argument_begin}{arguments}{m.call_end}"
                      for call_id, _, arguments in calls)
    return f"{m.section_begin}{section}{m.section_end}{END}", calls


def scripted_run(client, head: ScriptedHead, tokenizer, requests: list[dict], tools: dict) -> dict:
    identical, total, misses, checks = 0, 0, [], []
    for record in requests:
        text, calls = intended_text(record)
        forced = ToolSteering.plan(tokenizer, [tools[n] for n in record["tools"]], record.get("tool_choice", "auto"),
                                   calls_made(record["messages"])).forced_text
        expected = {"text": "" if calls else record["intended"], "calls": calls}
        for stream in (False, True):
            head.script(tokenizer.encode(text[len(forced):], allow_special=True))
            answer = ask(client, body(record, tools, temperature=0, max_tokens=256), stream,
                         record.get("stream_options"))
            got = {"text": answer.get("text"), "calls": answer.get("calls")}
            checks += schema_checks(answer, record, tools)
            total += 1
            identical += got == expected
            if got != expected:
                misses.append({"request": record["name"], "stream": stream, "expected": expected, "got": answer})
    return {"answers": total, "identical": identical, "share": identical / total, "calls": len(checks),
            "schema_accuracy": sum(checks) / len(checks) if checks else None, "misses": misses}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="an artifact with a Kimi K2 tokenizer")
    parser.add_argument("--requests", type=Path, default=REQUESTS, help=f"recorded requests (default {REQUESTS.name})")
    parser.add_argument("--temperature", type=float, default=0.6, help="the model run's temperature (default 0.6, "
                                                                       "the verifier's for K2-0905)")
    parser.add_argument("--seed", type=int, default=1, help="the model run's seed (default 1)")
    parser.add_argument("--decode", choices=DECODE_KERNELS, default="auto",
                        help="the cpu provider's decode step: native, onnx or auto (default; as generate's --decode)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if not (args.artifact / "manifest.json").is_file():
        parser.error(f"{args.artifact}: not an artifact directory (no manifest.json)")
    try:
        recorded = json.loads(args.requests.read_text())
        requests, tools = recorded["requests"], recorded["tools"]
        for record in requests:
            missing = [name for name in record["tools"] if name not in tools]
            if missing or not isinstance(record["messages"], list) or "intended" not in record:
                raise ValueError(f"request {record.get('name')!r} names undeclared tools {missing} or lacks "
                                 f"messages or intended")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        parser.error(f"{args.requests}: not a recorded request set like {REQUESTS.name} ({exc})")
    manifest = load_manifest(args.artifact)
    tokenizer = load_tokenizer(args.artifact / "tokenizer", manifest.config.vocab_size)
    if tokenizer is None:
        parser.error(f"{args.artifact}: the artifact has no tokenizer")
    head = ScriptedHead(load_model(manifest, "cpu", decode=args.decode))
    config = resolve_engine_config(manifest, max_queue=4)  # one request at a time, over the model's whole context
    with served(head.model, config, tokenizer) as client:
        model = model_run(client, requests, tools, args.temperature, args.seed)
    with served(head, config, tokenizer) as client:
        scripted = scripted_run(client, head, tokenizer, requests, tools)
    result = {"artifact": str(args.artifact), "requests_file": str(args.requests), "model": model,
              "scripted": scripted}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        accuracy = "n/a (no calls)" if model["schema_accuracy"] is None else f"{model['schema_accuracy']:.0%}"
        trigger = "n/a" if model["trigger_f1"] is None else f"{model['trigger_f1']:.0%}"
        print(f"model: {model['answered']}/{model['requests']} answered, {model['calls']} calls ended "
              f"(+{model['calls_cut_by_length']} cut by max_tokens), schema accuracy "
              f"{accuracy}, finish_reason agreement streamed/not {model['finish_agreement']:.0%}, trigger F1 {trigger}")
        print(f"scripted: {scripted['identical']}/{scripted['answers']} intended answers returned byte for byte, "
              f"{scripted['calls']} calls, schema accuracy {scripted['schema_accuracy']:.0%}")
        for miss in scripted["misses"]:
            print(f"  differs: {miss['request']} ({'streamed' if miss['stream'] else 'whole'}): {miss['got']}")
    ok = (model["answered"] == model["requests"] and model["schema_accuracy"] in (None, 1.0)
          and scripted["share"] == 1.0 and scripted["schema_accuracy"] == 1.0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
