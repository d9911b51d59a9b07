"""Speculative decoding (runtime/engine/speculation.py): drafted tokens checked several a forward give exactly the
tokens and logprobs of one token a forward, greedy or seeded, alone or in a batch, with a grammar too; a copied answer
takes fewer forwards; rejected drafts leave no page held and no prefix published."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from cli_runner import run_cli  # noqa: E402
from scripted import script, write_scripted_checkpoint  # noqa: E402

from k2deploy.core.manifest import load_manifest  # noqa: E402
from k2deploy.runtime.backends.native import build  # noqa: E402
from k2deploy.runtime.backends.native.choice import load_model  # noqa: E402
from k2deploy.runtime.backends.native.build import NativeUnavailable  # noqa: E402
from k2deploy.runtime.engine.requests import GenerationRequest  # noqa: E402
from k2deploy.runtime.engine.sampling import SamplingParams  # noqa: E402
from k2deploy.runtime.engine.speculation import PromptLookup, Speculation  # noqa: E402
from k2deploy.runtime.engine.step_loop import StepLoop  # noqa: E402

TEXT = list(range(300, 360))  # the scripted answer: each of these tokens is followed by the next
COPY_PROMPT = TEXT + TEXT[:5]  # ends with the text's start: the answer copies the rest of it


def _native(artifact):
    try:
        build.build()
    except NativeUnavailable as exc:
        pytest.skip(f"the native decode step cannot be built here: {exc}")
    return load_model(load_manifest(artifact), decode="native")


@pytest.fixture(scope="module")
def scripted_cpu_artifact(tmp_path_factory):
    from k2deploy.export.exporter import ExportOptions, export_artifact

    root = tmp_path_factory.mktemp("speculative")
    checkpoint = write_scripted_checkpoint(root / "checkpoint", script(TEXT))
    export_artifact(ExportOptions(str(checkpoint), target="cpu"), root / "artifact")
    return root / "artifact"


def _run(model, prompts, params, speculative="auto", loop_out=None, first_row=0):
    """The prompts as concurrent requests of one step loop (rows from first_row: each row seeds its own random
    stream) -> (each one's (token, logprob) pairs, its stats)."""
    loop = StepLoop(model, len(prompts), max(map(len, prompts)) + params.max_new_tokens, max_queue=0,
                    speculative=speculative)
    got = [[] for _ in prompts]
    requests = []
    for row, prompt in enumerate(prompts):
        def deliver(update, row=row):
            assert update.error is None, update.error
            got[row].extend(update.logprobs or [(t, None) for t in update.token_ids])
        requests.append(GenerationRequest(list(prompt), params, deliver, row=first_row + row))
        loop.submit(requests[-1])
    loop.run_until_done()
    if loop_out is not None:
        loop_out.append(loop)
    return got, [r.speculation for r in requests]


def test_prompt_lookup_drafts_what_followed_the_longest_earlier_match():
    lookup = PromptLookup([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    assert lookup.propose(4) == []  # (7, 8) and (8,) alone: no earlier 2-gram
    lookup.extend([1, 2, 3])
    assert lookup.propose(3) == [4, 5, 9]  # the longest match, (1, 2, 3), though (2, 3) came later, before 7
    lookup.extend([6, 2, 3])
    assert lookup.propose(2) == [6, 2]  # (2, 3) alone matches: its latest earlier place, before 6
    assert PromptLookup([5, 5, 5]).propose(4) == [5]  # the latest earlier (5, 5) is followed by the last 5 alone


def test_a_copied_answer_takes_fewer_forwards_and_gives_the_same_tokens(scripted_cpu_artifact):
    model = _native(scripted_cpu_artifact)
    params = SamplingParams(max_new_tokens=40, logprobs=2)
    loops = []
    on, stats = _run(model, [COPY_PROMPT], params, "auto", loops)
    off, off_stats = _run(model, [COPY_PROMPT], params, "off")
    assert [t.token for t in on[0]] == TEXT[5:45] and on == off
    assert stats[0].accepted_tokens >= 18 and stats[0].forward_steps <= 22, stats[0]  # a draft or more a step
    assert off_stats[0].draft_tokens == 0 and off_stats[0].forward_steps == 40
    pool = loops[0].cache.pool
    assert pool.available == pool.pages  # every page back (full ones findable by their prefix)


def test_rejected_drafts_leave_no_page_held_and_no_prefix_published(scripted_cpu_artifact):
    """A prompt whose text went on otherwise earlier: the drafts after its end are wrong past their first token."""
    model = _native(scripted_cpu_artifact)
    prompt = [900, 300, 301, 302, 303, 304, 950, 951] * 4 + TEXT[:3]  # the answer goes on 305 after 304, drafts 950
    loops = []
    on, stats = _run(model, [prompt], SamplingParams(max_new_tokens=20), "auto", loops)
    off, _ = _run(model, [prompt], SamplingParams(max_new_tokens=20), "off")
    assert on == off and [t for t, _ in on[0]] == TEXT[3:23]
    assert stats[0].draft_tokens > stats[0].accepted_tokens
    cache = loops[0].cache
    assert cache.pool.available == cache.pool.pages
    assert len(cache.pool.hash_of) == (len(prompt) + 19) // cache.page_size  # only pages of kept tokens


class _Oracle:
    """Drafts from a known answer, wrong at every third step's second draft: acceptances and rejections both."""

    def __init__(self, prompts, answers):
        self.next = {tuple(p): a for p, a in zip(prompts, answers)}
        self.steps = 0

    def draft(self, lookup, stats, room):
        self.steps += 1
        for prompt, answer in self.next.items():
            if tuple(lookup.tokens[:len(prompt)]) == prompt:
                made = len(lookup.tokens) - len(prompt)
                proposal = list(answer[made:made + min(4, room)])
                if self.steps % 3 == 0 and len(proposal) > 1:
                    proposal[1] = (proposal[1] + 1) % 1000
                return proposal
        return []


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=14, logprobs=3),
                                    SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_new_tokens=14, logprobs=3,
                                                   presence_penalty=0.5)],
                         ids=["greedy", "seeded sampling"])
def test_checked_drafts_give_the_tokens_and_logprobs_of_one_token_a_forward(tiny_cpu_artifact, monkeypatch, params):
    """Random weights, drafts that are mostly right and sometimes wrong, sixteen requests at once and each alone:
    every token and logprob is the one speculation off gives."""
    model = _native(tiny_cpu_artifact)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 1000, int(n)).tolist() for n in rng.integers(3, 60, 16)]
    off, _ = _run(model, prompts, params, "off")
    oracle = _Oracle(prompts, [[t.token for t in row] for row in off])
    monkeypatch.setattr(Speculation, "draft", lambda self, lookup, stats, room: oracle.draft(lookup, stats, room))
    together, stats = _run(model, prompts, params, "auto")
    assert together == off
    assert sum(s.accepted_tokens for s in stats) > 0 and sum(s.draft_tokens - s.accepted_tokens for s in stats) > 0
    for row in (0, 7):
        alone, _ = _run(model, [prompts[row]], params, "auto", first_row=row)
        assert alone[0] == off[row]


@pytest.mark.parametrize("answer", ["tool call", "json_schema"])
def test_drafts_under_a_grammar_give_its_tokens(tiny_cpu_artifact, monkeypatch, answer):
    """A tools grammar (a call's markers and JSON arguments) or a json_schema one, seeded sampling, with the grammar's
    forced tokens drafted, then drafts of an oracle: the same tokens as off."""
    from k2deploy.core.tokenizer_files import load_tokenizer
    from k2deploy.runtime.text.constrained import Grammars, json_grammar, tools_grammar

    model = _native(tiny_cpu_artifact)
    tokenizer = load_tokenizer(tiny_cpu_artifact / "tokenizer", model.config.vocab_size)
    tools = [{"type": "function", "function": {"name": "bakery", "parameters": {
        "type": "object", "properties": {"day": {"type": "string"}}, "required": ["day"]}}}]
    prompt = tokenizer.encode_chat([{"role": "user", "content": "When?"}], tools)
    grammars = Grammars(tokenizer, model.config.vocab_size)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_new_tokens=24, logprobs=2,
                            stop_ids=tuple(tokenizer.stop_ids))
    grammar = (tools_grammar(tools, "required", False) if answer == "tool call" else
               json_grammar({"type": "object", "properties": {"city": {"type": "integer"}, "open": {"type": "boolean"}},
                             "required": ["city", "open"]}))

    def run(speculative):
        loop = StepLoop(model, 1, len(prompt) + 24, max_queue=0, speculative=speculative)
        got = []
        request = GenerationRequest(list(prompt), params, lambda u: got.extend(u.logprobs),
                                    constraint=grammars.constraint(grammar))
        loop.submit(request)
        loop.run_until_done()
        return got, request.speculation

    off, _ = run("off")
    forced, stats = run("auto")  # the grammar's forced tokens drafted (the call's markers, the key "day")
    assert forced == off and stats.accepted_tokens > 0 and stats.forward_steps < len(off), stats
    oracle = _Oracle([prompt], [[t.token for t in off]])
    monkeypatch.setattr(Speculation, "draft", lambda self, lookup, stats, room: oracle.draft(lookup, stats, room))
    on, stats = run("auto")
    assert on == off and stats.accepted_tokens > 0


def test_generate_reports_speculation_and_off_drafts_nothing(scripted_cpu_artifact):
    ids = ",".join(map(str, COPY_PROMPT))
    shown = {mode: json.loads(run_cli("generate", scripted_cpu_artifact, "--prompt-ids", ids, "--max-new-tokens", "30",
                                      "--decode", "native", "--speculative", mode, "--json").stdout)
             for mode in ("auto", "off")}
    assert shown["auto"]["token_ids"] == shown["off"]["token_ids"] == TEXT[5:35]
    assert shown["auto"]["speculative"]["accepted_tokens"] >= 13 and shown["auto"]["speculative"]["forward_steps"] <= 17
    assert shown["off"]["speculative"] == {"draft_tokens": 0, "accepted_tokens": 0, "forward_steps": 30}


def test_the_graphs_never_draft(tiny_artifacts):
    """A backend whose forward of several positions is not exact to the bit (the graphs) decodes one token a step."""
    model = load_model(load_manifest(tiny_artifacts["bf16"]), decode="onnx")
    _, stats = _run(model, [COPY_PROMPT[:20] * 3], SamplingParams(max_new_tokens=8), "auto")
    assert stats[0].draft_tokens == 0 and stats[0].forward_steps == 8


def test_serve_reports_drafts_in_usage_and_metrics(scripted_cpu_artifact, tmp_path):
    """Through the official openai client, whole and streamed: the copied answer's tokens, its drafts in `usage`,
    the server's counts on /metrics; with --speculative off nothing is drafted."""
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from serving import MODEL, Server

    texts = {}
    for mode in ("auto", "off"):
        server = Server(scripted_cpu_artifact, tmp_path / mode, "--decode", "native", "--speculative", mode)
        try:
            asked = {"model": MODEL, "prompt": COPY_PROMPT, "max_tokens": 30, "temperature": 0}
            whole = server.client().completions.create(**asked)
            chunks = list(server.client().completions.create(**asked, stream=True,
                                                             stream_options={"include_usage": True}))
            for usage in (whole.usage, chunks[-1].usage):
                drafts = usage.model_extra["speculative"]
                if mode == "auto":
                    assert drafts["accepted_tokens"] >= 13 and drafts["forward_steps"] <= 17, drafts
                else:
                    assert drafts == {"draft_tokens": 0, "accepted_tokens": 0, "forward_steps": 30}
            texts[mode] = whole.choices[0].text
            assert texts[mode] and texts[mode] == "".join(c.choices[0].text for c in chunks if c.choices)
            accepted = server.metric("k2deploy_draft_tokens_accepted_total")
            assert (accepted >= 26) if mode == "auto" else accepted == 0
        finally:
            server.stop()
    assert texts["auto"] == texts["off"]


def test_recent_answers_are_drafted_from_and_stay_bounded():
    from k2deploy.runtime.engine.speculation import RecentOutputs

    recent = RecentOutputs(capacity=64)
    recent.add([1, 2, 3, 4, 5, 6])
    assert recent.propose([9, 9, 2, 3], 3) == [4, 5, 6]  # (2, 3) from the earlier answer
    assert recent.propose([6, 7], 3) == []  # an n-gram never spans two answers
    recent.add([7, 8, 9])
    assert recent.propose([5, 6, 7], 2) == []
    for start in range(0, 1000, 10):  # far more than the ring holds: old n-grams go, the index stays bounded
        recent.add(list(range(100 + start, 110 + start)))
    assert recent.propose([1, 2, 3], 3) == [] and len(recent.latest) <= 4 * 64
    assert recent.propose([1095, 1096], 2) == [1097, 1098]


def test_a_later_request_drafts_from_an_earlier_answer(scripted_cpu_artifact):
    """An agent's second request whose prompt does not hold the text: the first answer's tokens are the drafts."""
    model = _native(scripted_cpu_artifact)
    loop = StepLoop(model, 1, 128, max_queue=0, speculative="auto")
    firsts = []
    for prompt, tokens in (([TEXT[0]], 40), ([950, 951, TEXT[0]], 40)):
        got = []
        request = GenerationRequest(prompt, SamplingParams(max_new_tokens=tokens), lambda u: got.extend(u.token_ids))
        loop.submit(request)
        loop.run_until_done()
        firsts.append((got, request.speculation))
    (first, first_stats), (second, second_stats) = firsts
    assert first == second == TEXT[1:41]
    assert second_stats.accepted_tokens >= 18 and second_stats.forward_steps <= 22 < first_stats.forward_steps


def test_pages_are_all_back_after_preemption_and_cancel_with_drafts(scripted_cpu_artifact):
    """Two copying requests in a pool too small for both (one is preempted and runs again) and a third cancelled
    mid-answer: the same tokens as off, and every page back in the pool."""
    from k2deploy.core.cache_format import PAGE_SIZE

    model = _native(scripted_cpu_artifact)
    long_prompt = TEXT[:50] + TEXT[:3]  # 53 tokens: with 50 generated, two pages

    def run(speculative):
        loop = StepLoop(model, 3, 128, max_queue=0, pages=3, speculative=speculative)
        got = [[] for _ in range(3)]
        jobs = ((long_prompt, 50), (COPY_PROMPT, 40), (TEXT[:4], 40))
        requests = [GenerationRequest(list(p), SamplingParams(max_new_tokens=n),
                                      lambda u, i=i: got[i].extend(u.token_ids), row=i) for i, (p, n) in enumerate(jobs)]
        for request in requests:
            loop.submit(request)
        steps = 0
        while loop.scheduler.queue_depth() or loop.scheduler.running():
            loop.step()
            steps += 1
            if steps == 3:
                requests[2].cancelled = True
        assert loop.cache.pool.available == loop.cache.pool.pages == 3 and PAGE_SIZE * 2 >= 53 + 50
        return got, [r.preempted for r in requests], requests[2].finish_reason

    on, preempted, cancelled = run("auto")
    off, _, _ = run("off")
    assert on[:2] == off[:2] and on[0] == TEXT[3:53] and sum(preempted) > 0 and cancelled is None
