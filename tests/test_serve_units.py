"""The server's parts without HTTP: text streaming and stop strings, the scheduler's admission rules, the
cache rows one forward runs, request checking."""

from __future__ import annotations

import numpy as np
import pytest

from k2deploy.runtime.engine.sampling import SamplingParams
from k2deploy.commands.serve_command import add_serve_parser, exposure_warning
from k2deploy.runtime.serve.protocol import ApiError, max_new_tokens, parse_options
from k2deploy.runtime.engine.requests import GenerationRequest
from k2deploy.runtime.text.answer import AnswerStream, TextStream
from k2deploy.runtime.engine.scheduler import QueueFull, Scheduler

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\u00e9"}


def _decode(ids: list[int]) -> str:
    """A byte-level stand-in for the tokenizer: id 7 and 8 are the two UTF-8 bytes of 'é'."""
    raw = b"".join(PIECES[i].encode() if i in PIECES else bytes([0xC3 if i == 7 else 0xA9]) for i in ids)
    return raw.decode("utf-8", errors="replace")


def _stream(ids, stop=()):
    text_stream = TextStream(_decode, tuple(stop))
    out, stopped = [], False
    for token in ids:
        text, stopped = text_stream.push(token)
        out.append(text)
        if stopped:
            break
    return out, stopped, text_stream


def test_text_stream_holds_a_split_character_until_it_is_whole():
    out, stopped, _ = _stream([1, 7, 8, 2])
    assert out == ["Hel", "", "\u00e9", "lo"] and not stopped


def test_text_stream_finish_releases_an_incomplete_character():
    _, _, text_stream = _stream([1, 7])
    assert text_stream.finish() == "\ufffd"


def test_stop_string_across_tokens_is_cut_and_never_sent():
    out, stopped, _ = _stream([1, 2, 3, 4, 5], stop=["o wo"])
    assert out == ["Hel", "l", ""] and stopped  # "o" is held: it may start the stop string


def test_a_held_prefix_that_does_not_become_the_stop_string_is_sent():
    out, stopped, text_stream = _stream([1, 2, 3, 4, 5], stop=["lox"])
    assert "".join(out) + text_stream.finish() == "Hello world!" and not stopped
    assert out[:2] == ["He", "l"]  # "l", then "lo", waited: they may start "lox"


def _request(prompt=(1, 2, 3), max_new=3, stop_ids=(99,), stop=()):
    updates = []
    request = GenerationRequest(list(prompt), SamplingParams(max_new_tokens=max_new, stop_ids=stop_ids),
                                updates.append, answer=AnswerStream(_decode, tuple(stop)))
    return request, updates


def test_request_finishes_on_length_and_on_a_stop_id():
    request, _ = _request(max_new=2)
    assert request.accept(1).finish_reason is None
    last = request.accept(2)
    assert (last.text, last.finish_reason, request.generated) == ("lo", "length", [1, 2])
    request, _ = _request()
    request.accept(1)
    assert request.accept(99).finish_reason == "stop" and request.generated == [1]


def test_scheduler_admits_first_come_into_the_lowest_free_slots():
    scheduler = Scheduler(slots=2, max_queue=1)
    a, b, c = (_request()[0] for _ in range(3))
    for request in (a, b, c):
        scheduler.submit(request)  # 2 free slots + 1 queue place
    with pytest.raises(QueueFull):
        scheduler.submit(_request()[0])
    assert scheduler.admit() == [a, b] and (a.slot, b.slot) == (0, 1) and scheduler.queue_depth() == 1
    scheduler.leave(a)
    assert scheduler.admit() == [c] and c.slot == 0


def test_scheduler_drops_cancelled_waiting_requests():
    scheduler = Scheduler(slots=1, max_queue=4)
    a, b = _request()[0], _request()[0]
    scheduler.submit(a)
    scheduler.submit(b)
    a.cancelled = True
    assert scheduler.admit() == [b]


def test_no_queue_means_requests_beyond_the_free_slots_are_refused():
    scheduler = Scheduler(slots=1, max_queue=0)
    scheduler.submit(_request()[0])
    with pytest.raises(QueueFull):
        scheduler.submit(_request()[0])


def test_options_are_checked_strictly():
    options = parse_options({"model": "m", "prompt": [1, 2], "max_tokens": 4, "stop": "x", "n": 1,
                             "presence_penalty": 0.0, "logprobs": None}, chat=False)
    assert (options.prompts, options.max_tokens, options.stop, options.temperature) == (([1, 2],), 4, ("x",), 1.0)
    assert max_new_tokens(options, prompt_tokens=2, context=6) == 4
    with pytest.raises(ApiError, match="maximum context length is 5"):
        max_new_tokens(options, prompt_tokens=2, context=5)
    chat = parse_options({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                  {"type": "text", "text": "b"}]}]},
                         chat=True)
    assert chat.messages == [{"role": "user", "content": "ab"}]
    assert max_new_tokens(chat, prompt_tokens=10, context=64) == 54  # chat: the rest of the context
    assert parse_options({"model": "m", "prompt": "a", "frequency_penalty": 0.5}, chat=False).frequency_penalty == 0.5
    for body in ({"model": "m", "prompt": "a", "n": True}, {"model": "m", "prompt": "a", "frequency_penalty": 2.5},
                 {"model": "m", "messages": [{"role": "user", "content": "a"}]}):
        with pytest.raises(ApiError) as error:
            parse_options(body, chat=False)
        assert error.value.status == 400


def test_a_cache_view_runs_some_slots_as_a_cache_of_their_own(tiny_artifacts):
    """A prompt prefilled and decoded through slot 2 of a 4-slot cache, whose pages are not the first ones, gives
    the logits and cache entries it gives in a cache of its own, and leaves the other pages alone."""
    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.engine.batch_forward import BatchForward
    from k2deploy.runtime.backends.onnx.model import OrtModel

    model = OrtModel(load_manifest(tiny_artifacts["fp8"]), threads=1)
    prompt = [5, 17, 300, 42, 9]

    own = model.new_cache(1, 16)
    run = BatchForward(model, own)
    own_logits = [run.prefill([0], [prompt])[0], run.decode([0], np.array([7]))[0]]

    shared = model.new_cache(4, 16)
    shared.store.arrays["latent"][:] = 1  # stale entries of other pages must not leak in
    shared.reserve([0, 1], [16, 16])  # slot 2's page is not page 0
    run = BatchForward(model, shared)
    shared_logits = [run.prefill([2], [prompt])[0], run.decode([2], np.array([7]))[0]]
    np.testing.assert_array_equal(own_logits, shared_logits)
    assert shared.lengths.tolist() == [0, 0, 6, 0] and own.lengths.tolist() == [6]
    (page,), (own_page,) = shared.tables[2], own.tables[0]
    assert page == 2
    np.testing.assert_array_equal(shared.store.arrays["latent"][:, page, :6], own.store.arrays["latent"][:, own_page, :6])
    others = [p for p in range(shared.pool.pages) if p != page]
    assert (shared.store.arrays["latent"][:, others] == 1).all()


def test_serve_registers_on_the_main_parser():
    import argparse

    parser = argparse.ArgumentParser(prog="k2deploy")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "ART", "--max-batch", "4", "--api-key", "k"])
    assert (args.command, args.artifact, args.host, args.port, args.max_batch, args.api_key) == (
        "serve", "ART", "127.0.0.1", 8000, 4, "k")
    assert args.func.__name__ == "cmd_serve"


def _tool_request(pieces: list[str], single_call=False, forced="", max_new=32):
    """A chat request whose tokens decode to `pieces` (one token each); ids from 100, 99 stops."""
    from k2deploy.runtime.text.tool_calls import ToolCallParser

    table = dict(enumerate(pieces, start=100))
    answer = AnswerStream(lambda ids: "".join(table[i] for i in ids), (), ToolCallParser(), forced, single_call)
    request = GenerationRequest([1], SamplingParams(max_new_tokens=max_new, stop_ids=(99,)), lambda update: None,
                                answer=answer)
    return request, list(table)


CALLS = ["Let me look.", "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.tide:0",
         "<|tool_call_argument_begin|>", '{"port": ', '"Oslo"}', "<|tool_call_end|>", "<|tool_call_begin|>",
         "functions.wind:1", "<|tool_call_argument_begin|>", "{}", "<|tool_call_end|>", "<|tool_calls_section_end|>"]


def test_a_request_turns_its_answer_into_content_and_calls():
    request, ids = _tool_request(CALLS)
    updates = [request.accept(i) for i in ids] + [request.accept(99)]
    assert "".join(u.text for u in updates) == "Let me look."
    deltas = [d for u in updates for d in u.tool_calls]
    assert [(d.index, d.id, d.name) for d in deltas if d.id] == [(0, "functions.tide:0", "tide"),
                                                                 (1, "functions.wind:1", "wind")]
    assert "".join(d.arguments for d in deltas if d.index == 0) == '{"port": "Oslo"}'
    assert updates[-1].finish_reason == "tool_calls" and request.done


def test_parallel_tool_calls_false_ends_the_answer_after_its_first_call():
    request, ids = _tool_request(CALLS, single_call=True)
    updates = []
    for token in ids:
        updates.append(request.accept(token))
        if request.done:
            break
    assert updates[-1].finish_reason == "tool_calls" and len(request.generated) == 8  # through the first call_end
    assert {d.index for u in updates for d in u.tool_calls} == {0}


def test_forced_text_is_parsed_as_the_start_of_the_answer():
    request, ids = _tool_request(['{"port": "Bergen"}', "<|tool_call_end|>", "<|tool_calls_section_end|>"],
                                 forced="<|tool_calls_section_begin|><|tool_call_begin|>functions.tide:0"
                                        "<|tool_call_argument_begin|>")
    updates = [request.accept(i) for i in ids] + [request.accept(99)]
    first = updates[0].tool_calls[0]
    assert (first.id, first.name) == ("functions.tide:0", "tide")
    assert "".join(d.arguments for u in updates for d in u.tool_calls) == '{"port": "Bergen"}'
    assert updates[-1].finish_reason == "tool_calls" and "".join(u.text for u in updates) == ""


def test_a_request_without_a_tokenizer_sends_token_ids():
    request = GenerationRequest([1], SamplingParams(max_new_tokens=2, stop_ids=()), lambda update: None)
    updates = [request.accept(41), request.accept(42)]
    assert [u.token_ids for u in updates] == [(41,), (42,)] and [u.text for u in updates] == ["", ""]
    assert updates[-1].finish_reason == "length"


def test_sampling_never_picks_a_banned_token():
    from k2deploy.runtime.engine.sampling import sample

    logits = np.array([0.0, 5.0, 1.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    assert sample(logits, SamplingParams(banned_ids=(1,)), rng) == 2
    hot = SamplingParams(temperature=2.0, banned_ids=(1,))
    assert 1 not in {sample(logits, hot, rng) for _ in range(200)}


def test_serving_beyond_this_machine_without_a_key_is_warned_about():
    assert "reachable from other machines, without an API key" in exposure_warning("0.0.0.0", None)
    assert "reachable from other machines" in exposure_warning("::", None)
    assert exposure_warning("0.0.0.0", "sesame") is None
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None


@pytest.mark.parametrize("source", ["option", "environment", "file"])
def test_an_api_key_is_taken_without_the_spaces_around_it_from_every_source(tmp_path, monkeypatch, source):
    """A client's `Authorization: Bearer KEY` header never carries spaces around KEY, so a key given with them
    (`--api-key ' sekrit '`, K2DEPLOY_API_KEY='sekrit ') is the key without them, as a key file's line is."""
    import argparse

    from k2deploy.commands.serve_command import API_KEY_VARIABLE, _api_key

    args = argparse.Namespace(api_key=None, api_key_file=None)
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    if source == "option":
        args.api_key = " sekrit "
    elif source == "environment":
        monkeypatch.setenv(API_KEY_VARIABLE, "sekrit \t")
    else:
        (tmp_path / "key").write_text("  sekrit\n")
        args.api_key_file = str(tmp_path / "key")
    assert _api_key(args) == "sekrit"
