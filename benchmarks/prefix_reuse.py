"""Prefix reuse, measured: chats that share a long system prompt, each of several turns that resend the history,
run through the server's step loop with the prefix cache on and off, side by side in one run.

    . .venv/bin/activate && python benchmarks/prefix_reuse.py ART [--system 1500] [--chats 2] [--turns 2] [--json]

(from the repository root; ART e.g. `k2deploy export CKPT --out ART --target cpu` of a `small` checkpoint).
Chats run one after another on one cache; each turn's prompt is the system prompt, the chat's earlier turns (user
message and the answer the model gave) and a new user message of --user tokens; the answer is --answer greedy
tokens. Rounds alternate the two settings, so the machine's noise falls on both; the table gives the median time
to first token per chat and turn, its ratio to the same request without reuse and to the first chat's first
turn, the prompt tokens served from the cache (`usage.prompt_tokens_details.cached_tokens` in the server), and
whether every run, with reuse and without, generated the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

from k2deploy.core.manifest import load_manifest
from k2deploy.runtime.backends.native.choice import load_model
from k2deploy.runtime.engine.requests import GenerationRequest
from k2deploy.runtime.engine.sampling import SamplingParams
from k2deploy.runtime.engine.step_loop import StepLoop


def chats(model, prefix_cache: bool, system: list[int], users: list[list[list[int]]], answer: int) -> list[dict]:
    """The chats on one fresh cache -> per chat and turn: ttft_ms, prompt tokens, cached tokens."""
    loop = StepLoop(model, 1, model.config.max_position_embeddings, max_queue=0, prefix_cache=prefix_cache)
    requests = []
    for chat, turns in enumerate(users):
        history = list(system)
        for turn, user in enumerate(turns):
            prompt = history + user
            request = GenerationRequest(prompt, SamplingParams(max_new_tokens=answer), lambda update: None)
            loop.submit(request)
            loop.run_until_done()
            requests.append({"chat": chat + 1, "turn": turn + 1, "prompt_tokens": len(prompt),
                             "cached_tokens": request.cached_prompt_tokens,
                             "ttft_ms": (request.first_token_at - request.arrived_at) * 1e3,
                             "tokens": list(request.generated)})
            history = prompt + request.generated
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--system", type=int, default=1500, help="system prompt tokens (default: 1500)")
    parser.add_argument("--user", type=int, default=40, help="tokens of each user message (default: 40)")
    parser.add_argument("--answer", type=int, default=16, help="tokens of each answer (default: 16)")
    parser.add_argument("--chats", type=int, default=2, help="chats sharing the system prompt (default: 2)")
    parser.add_argument("--turns", type=int, default=2, help="turns per chat (default: 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="the process's intra-op pool (default: its cores)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = load_model(load_manifest(args.artifact), threads=args.threads)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = rng.integers(3, vocab, args.system).tolist()
    users = [[rng.integers(3, vocab, args.user).tolist() for _ in range(args.turns)] for _ in range(args.chats)]
    runs = {True: [], False: []}
    chats(model, True, system[:64], [users[0][:1]], 2)  # warm the sessions
    for _ in range(args.rounds):
        for reuse in (False, True):
            runs[reuse].append(chats(model, reuse, system, users, args.answer))
    rows = []
    first = statistics.median(run[0]["ttft_ms"] for run in runs[True])
    for index, request in enumerate(runs[True][0]):
        ttft = {reuse: statistics.median(run[index]["ttft_ms"] for run in runs[reuse]) for reuse in runs}
        same = all(run[index]["tokens"] == runs[False][0][index]["tokens"] for reuse in runs for run in runs[reuse])
        rows.append({key: request[key] for key in ("chat", "turn", "prompt_tokens", "cached_tokens")}
                    | {"ttft_ms_reuse": round(ttft[True], 1), "ttft_ms_none": round(ttft[False], 1),
                       "reuse_to_none": round(ttft[True] / ttft[False], 3), "reuse_to_first": round(ttft[True] / first, 3),
                       "same_tokens": same})
    doc = {"artifact": args.artifact, "threads": model.threads, "system_tokens": args.system, "rounds": args.rounds,
           "requests": rows}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{args.artifact}: system prompt {args.system} tokens, {args.chats} chats of {args.turns} turns, "
          f"{model.threads} threads, median of {args.rounds} rounds")
    print("chat  turn  prompt  cached  ttft reuse ms  ttft none ms  reuse/none  reuse/first chat  same tokens")
    for r in rows:
        print(f"{r['chat']:>4}  {r['turn']:>4}  {r['prompt_tokens']:>6}  {r['cached_tokens']:>6}  "
              f"{r['ttft_ms_reuse']:>13}  {r['ttft_ms_none']:>12}  {r['reuse_to_none']:>10}  {r['reuse_to_first']:>16}  "
              f"{str(r['same_tokens']):>11}")

if __name__ == "__main__":
    main()
