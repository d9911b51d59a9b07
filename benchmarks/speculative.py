"""Speculative decoding (runtime/engine/speculation.py) against one token a forward, honest about acceptance.

    . .venv/bin/activate && python benchmarks/speculative.py [ART] [--threads 1] [--tokens 96] [--rounds 3] [--json]

(from the repository root; without ART, the `small` artifact that benchmarks/decode_latency.py writes under
/tmp/k2deploy-bench, made first if missing; any cpu-lowered artifact, such as the real-size 2-layer K2 one, works.)

Every run goes through the step loop `generate` and `serve` use, on the native step, greedy, with --speculative auto
and off interleaved (--rounds), and reports decode tokens a second (tokens after the first over the time after the
first token), the drafted and accepted tokens and the forwards:
  (a) free text on random weights: what lookup finds to draft in a model that copies nothing (acceptance near zero:
      `auto` must then cost nothing);
  (b) a json_schema answer and a tool call on random weights: the tokens the grammar forces (keys, punctuation, the
      call's markers and id) drafted, so fewer forwards than tokens;
  (c) a copy-heavy agent turn: a 'file' in the prompt re-emitted with one edit, the head scripted to that answer
      (bench/scripted_head.py: every forward real, its own head included, only the choice of token scripted),
      where acceptance is what an agent's edits give.
The speed-up is off's time over auto's, measured side by side on one host.

With --serve N: `k2deploy serve ART --decode native --speculative auto`, then `off` (each round in turn), each sent
the first N agent requests of benchmarks/agent_requests.json at once (chat completions with their tools, greedy,
--tokens at most): each request's time, auto's over off's, and the server's pages after the load (all back).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from k2deploy.bench.scripted_head import ScriptedHead
from k2deploy.core.manifest import load_manifest
from k2deploy.core.tokenizer import TRAINING_TEXT
from k2deploy.core.tokenizer_files import load_tokenizer
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.backends.native.build import host_levels
from k2deploy.runtime.engine.generator import Generator
from k2deploy.runtime.engine.sampling import SamplingParams
from k2deploy.runtime.text.constrained import Grammars, json_grammar, tools_grammar
from thread_pools import ensure_artifact

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                          "open": {"type": "boolean"}}, "required": ["city", "days", "open"]}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
    "required": ["path", "line"]}}}]


def _copy_turn(vocab: int, tokens: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """A prompt holding a 'file' (random ids, long enough for the answer) and the answer that re-emits it with one
    id changed a third of the way in."""
    rng = np.random.default_rng(seed)
    file = rng.integers(300, vocab - 300, tokens + 64).tolist()
    answer = list(file[:tokens])
    answer[tokens // 3] = (answer[tokens // 3] + 1) % (vocab - 300)
    return [*rng.integers(300, vocab - 300, 32).tolist(), *file, *rng.integers(300, vocab - 300, 16).tolist()], answer


def _run(generator: Generator, prompt: list[int], params: SamplingParams, constraint=None) -> dict:
    started = time.perf_counter()
    got = generator.generate([prompt], params, lambda ids: constraint() if constraint else None)[0]
    later = len(got.token_ids) - 1
    return {"tokens": len(got.token_ids), "decode_tokens_per_s": later / (got.tpot_ms * later / 1e3)
            if later > 0 and got.tpot_ms > 0 else None, "seconds": time.perf_counter() - started, **got.speculative}


def serve_rounds(artifact: Path, requests: int, tokens: int, rounds: int, threads: int) -> dict:
    """Each agent request's seconds per --speculative mode (a list per round) and the drafts auto made."""
    import asyncio

    import httpx

    from serve_load import Server

    agents = json.loads((Path(__file__).parent / "agent_requests.json").read_text())
    chosen = agents["requests"][:requests]
    seconds = {mode: [[] for _ in chosen] for mode in ("auto", "off")}
    drafted, pages_back = {"draft_tokens": 0, "accepted_tokens": 0}, True

    async def one(http, url, model, request) -> tuple[float, dict]:
        body = {"model": model, "messages": request["messages"], "tools": [agents["tools"][n] for n in request["tools"]],
                "temperature": 0, "max_tokens": tokens}
        started = time.perf_counter()
        response = await http.post(f"{url}/v1/chat/completions", json=body)
        response.raise_for_status()
        return time.perf_counter() - started, response.json()["usage"].get("speculative", {})

    async def load(url, model) -> list[tuple[float, dict]]:
        async with httpx.AsyncClient(timeout=None) as http:
            return await asyncio.gather(*(one(http, url, model, r) for r in chosen))

    for round_ in range(rounds):
        for mode in ("auto", "off") if round_ % 2 == 0 else ("off", "auto"):
            server = Server(artifact, Path(f"/tmp/k2deploy-speculative/{mode}"), len(chosen), threads,
                            ["--decode", "native", "--speculative", mode])
            try:
                asyncio.run(load(server.url, server.model))  # warm: the step loop's cost estimates, the caches
                for i, (took, usage) in enumerate(asyncio.run(load(server.url, server.model))):
                    seconds[mode][i].append(took)
                    if mode == "auto":
                        for key in drafted:
                            drafted[key] += usage.get(key, 0)
                metrics = httpx.get(f"{server.url}/metrics").text
                used = re.search(r"^k2deploy_cache_pages_used (\S+)$", metrics, re.MULTILINE)
                pages_back &= used is not None and float(used.group(1)) == 0
            finally:
                server.stop()
        print(f"serve round {round_ + 1}/{rounds} done", file=sys.stderr)
    ratios = [statistics.median(a) / statistics.median(o) for a, o in zip(seconds["auto"], seconds["off"])]
    return {"requests": len(chosen), "max_tokens": tokens, "auto_over_off": [round(r, 3) for r in ratios],
            "slowest_auto_over_off": round(max(ratios), 3), "pages_all_back": pages_back, **drafted}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", nargs="?", type=Path, help="a cpu-lowered artifact (default: decode_latency's small)")
    parser.add_argument("--threads", type=int, default=1, help="the native step's threads (default 1)")
    parser.add_argument("--tokens", type=int, default=96, help="tokens each answer generates (default 96)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of auto and off (default 3)")
    parser.add_argument("--serve", type=int, default=0, metavar="N",
                        help="also serve N agent requests at once with auto and with off (default 0: not)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.rounds < 1 or args.threads < 1:
        parser.error("--tokens: at least 2; --rounds and --threads: at least 1")
    artifact = ensure_artifact(args.artifact)
    manifest = load_manifest(artifact)
    model = ScriptedHead(load_model(manifest, threads=args.threads, decode="native"))
    vocab = model.config.vocab_size
    tokenizer = load_tokenizer(artifact / "tokenizer", vocab)
    grammars = Grammars(tokenizer, vocab) if tokenizer is not None else None
    greedy = SamplingParams(max_new_tokens=args.tokens)
    text = tokenizer.encode(TRAINING_TEXT[:1500]) if tokenizer is not None else list(range(300, 700))
    prompt, answer = _copy_turn(vocab, args.tokens)
    cases = {"free text, random weights": (text, None, None)}
    if grammars is not None:
        chat = tokenizer.encode_chat([{"role": "user", "content": "Which file?"}], TOOLS)
        cases["json_schema, random weights"] = (text, lambda: grammars.constraint(json_grammar(SCHEMA)), None)
        cases["tool call, random weights"] = (chat, lambda: grammars.constraint(tools_grammar(TOOLS, "required", False)),
                                              None)
    cases["copy-heavy turn, scripted head"] = (prompt, None, answer)
    runs = {(case, mode): [] for case in cases for mode in ("auto", "off")}
    for round_ in range(args.rounds):
        for case, (ids, constraint, scripted) in cases.items():
            for mode in ("off", "auto") if round_ % 2 else ("auto", "off"):
                if scripted is not None:
                    model.script_positions(scripted, len(ids))
                generator = Generator(model if scripted is not None else model.model, mode)
                runs[case, mode].append(_run(generator, ids, greedy, constraint))
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    rows = []
    for case in cases:
        auto, off = runs[case, "auto"], runs[case, "off"]
        speed = {mode: statistics.median(r["decode_tokens_per_s"] for r in runs[case, mode]) for mode in ("auto", "off")}
        last = auto[-1]
        rows.append({"case": case, "tokens": last["tokens"], "draft_tokens": last["draft_tokens"],
                     "accepted_tokens": last["accepted_tokens"], "forward_steps": last["forward_steps"],
                     "off_forward_steps": off[-1]["forward_steps"],
                     "auto_tokens_per_s": round(speed["auto"], 1), "off_tokens_per_s": round(speed["off"], 1),
                     "speedup": round(speed["auto"] / speed["off"], 3)})
    host = {"cpu": platform.processor() or platform.machine(), "levels": host_levels(), "threads": args.threads}
    served = serve_rounds(artifact, args.serve, args.tokens, args.rounds, args.threads) if args.serve else None
    if args.json:
        print(json.dumps({"artifact": str(artifact), "host": host, "rounds": args.rounds, "cases": rows,
                          "serve": served}, indent=1))
        return 0
    print(f"{artifact.name}, {args.threads} thread(s), {args.tokens} tokens an answer, median of {args.rounds} rounds")
    print(f"{'case':<32} {'tokens':>6} {'drafted':>8} {'accepted':>8} {'forwards':>8} {'auto tok/s':>10} "
          f"{'off tok/s':>10} {'speed-up':>8}")
    for r in rows:
        print(f"{r['case']:<32} {r['tokens']:>6} {r['draft_tokens']:>8} {r['accepted_tokens']:>8} "
              f"{r['forward_steps']:>8} {r['auto_tokens_per_s']:>10.1f} {r['off_tokens_per_s']:>10.1f} "
              f"{r['speedup']:>7.2f}x")
    if served:
        print(f"serve, {served['requests']} agent requests at once: each request's time auto over off "
              f"{', '.join(f'{r:.2f}' for r in served['auto_over_off'])} (slowest {served['slowest_auto_over_off']:.2f}); "
              f"{served['accepted_tokens']} of {served['draft_tokens']} drafted tokens accepted; pages all back: "
              f"{served['pages_all_back']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
