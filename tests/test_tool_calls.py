import json
import random

import pytest

from k2deploy.runtime.text.tool_calls import KIMI_K2_MARKERS, CallDelta, ParsedDelta, ToolCall, ToolCallParser
from k2deploy.core.tokenizer import KimiTokenizer, write_tokenizer

SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = KIMI_K2_MARKERS.tokens()


def call(call_id: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{call_id}{ARGUMENT_BEGIN}{arguments}{CALL_END}"


def section(*calls: str) -> str:
    return SECTION_BEGIN + "".join(calls) + SECTION_END


WEATHER, TIME = '{"city": "Beijing"}', '{"tz": "CST"}'
UNICODE = '{"city": "北京", "emoji": "🌧"}'
EXAMPLE = "I will check." + section(call("functions.get_weather:0", WEATHER), call("functions.get_time:1", TIME))


def chunkings(text: str, seed: int = 0):
    """The text whole, char by char, split in two at every position, and in random pieces."""
    yield [text]
    yield list(text)
    for at in range(len(text) + 1):
        yield [text[:at], text[at:]]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(chunks):
    """Feed the chunks and finish; checks that the deltas add up to the parser's content and calls."""
    parser = ToolCallParser()
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    assert "".join(d.content for d in deltas) == parser.content
    arguments = {}
    for delta in (c for d in deltas for c in d.calls):
        if delta.index in arguments:
            assert (delta.id, delta.name) == (None, None)
        else:
            assert delta.index == len(arguments)  # calls start in order
            assert (delta.id, delta.name) == (parser.calls[delta.index].id, parser.calls[delta.index].name)
        arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    assert arguments == {i: c.arguments for i, c in enumerate(parser.calls)}
    return parser, deltas


def parse(text: str) -> ToolCallParser:
    """The parser after the whole text, checked to give the same result under every chunking."""
    whole, _ = stream([text])
    for chunks in chunkings(text):
        parser, _ = stream(chunks)
        assert (parser.content, parser.calls) == (whole.content, whole.calls), chunks
    return whole


def test_any_chunking_gives_the_same_result():
    text = "Before <b> " + EXAMPLE + " 之后 " + CALL_BEGIN + "functions.x:2" + ARGUMENT_BEGIN + '{"cut": "of'
    whole, _ = stream([text])
    assert whole.content == "Before <b> I will check. 之后 "
    assert [c.complete for c in whole.calls] == [True, True, False]
    for seed in range(5):
        for chunks in chunkings(text, seed):
            parser, _ = stream(chunks)
            assert (parser.content, parser.calls) == (whole.content, whole.calls), chunks


def test_one_call():
    parser = parse(section(call("functions.get_weather:0", WEATHER)))
    assert parser.content == ""
    assert parser.calls == [ToolCall("functions.get_weather:0", "get_weather", WEATHER, complete=True)]
    assert parser.called
    assert json.loads(parser.calls[0].arguments) == {"city": "Beijing"}


def test_three_calls_whitespace_between_them_dropped():
    calls = [call(f"functions.f{i}:{i}", f'{{"n": {i}}}') for i in range(3)]
    parser = parse(section("\n", calls[0], "\n\n", calls[1], "  ", calls[2], "\n"))
    assert parser.content == ""
    assert [(c.id, c.name, c.arguments, c.complete) for c in parser.calls] == [
        ("functions.f0:0", "f0", '{"n": 0}', True),
        ("functions.f1:1", "f1", '{"n": 1}', True),
        ("functions.f2:2", "f2", '{"n": 2}', True),
    ]


def test_the_singular_section_spelling_is_a_section_too():
    """K2 now and then writes `<|tool_call_section_begin|>` and `..._end|>` (singular, plain text): taken as the
    section's markers, never content, whatever the chunking (llama.cpp #17376)."""
    text = ("I will check.<|tool_call_section_begin|>" + call("functions.get_weather:0", WEATHER)
            + call("functions.get_time:1", TIME) + "<|tool_call_section_end|> Done.")
    parser = parse(text)
    assert parser.content == "I will check. Done."
    assert [(c.id, c.name, c.arguments, c.complete) for c in parser.calls] == [
        ("functions.get_weather:0", "get_weather", WEATHER, True), ("functions.get_time:1", "get_time", TIME, True)]


def test_calls_after_text():
    parser = parse(EXAMPLE)
    assert parser.content == "I will check."
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [("get_weather", WEATHER, True),
                                                                          ("get_time", TIME, True)]


def test_text_after_the_section_is_content_and_a_second_section_parses():
    text = "A " + section(call("functions.f:0", "{}")) + "then B " + section(call("functions.g:1", "[]")) + "C"
    parser = parse(text)
    assert parser.content == "A then B C"
    assert [(c.name, c.arguments) for c in parser.calls] == [("f", "{}"), ("g", "[]")]


def test_plain_text_has_no_calls():
    text = "No tools: a < b, x <| y, <tool>, |> and <|tool_calls are plain text <"
    parser = parse(text)
    assert parser.content == text
    assert parser.calls == [] and not parser.called


def test_only_a_possible_marker_start_is_held_back():
    parser = ToolCallParser()
    assert parser.feed("a <b").content == "a <b"  # cannot begin a marker: released at once
    assert parser.feed(" and <|tool").content == " and "
    assert parser.feed("s").content == "<|tools"  # "<|tools" begins no marker
    assert parser.feed(" <|tool_call").content == " "
    assert parser.finish().content == "<|tool_call"  # held text is released as what it is


def test_deltas_stream_as_text_arrives():
    parser = ToolCallParser()
    assert parser.feed("Hi" + SECTION_BEGIN + CALL_BEGIN + "functions.get_weather:0").calls == ()
    assert parser.called and parser.calls == []
    assert parser.feed(ARGUMENT_BEGIN).calls == (CallDelta(0, "functions.get_weather:0", "get_weather", ""),)
    assert parser.feed('{"city"').calls == (CallDelta(0, None, None, '{"city"'),)
    assert parser.feed(': "Beijing"}<|tool_').calls == (CallDelta(0, None, None, ': "Beijing"}'),)
    assert parser.feed("call_end|>").calls == ()
    assert parser.calls[0].complete
    # whole text in one chunk: one delta per call, carrying its arguments
    parser = ToolCallParser()
    assert parser.feed(EXAMPLE).calls == (CallDelta(0, "functions.get_weather:0", "get_weather", WEATHER),
                                          CallDelta(1, "functions.get_time:1", "get_time", TIME))


def test_cut_off_inside_arguments():
    parser = parse("Let me look." + SECTION_BEGIN + call("functions.a:0", "{}") + CALL_BEGIN + "functions.b:1"
                   + ARGUMENT_BEGIN + '{"query": "rain <|tool_ca')
    assert parser.content == "Let me look."
    assert parser.calls == [ToolCall("functions.a:0", "a", "{}", complete=True),
                            ToolCall("functions.b:1", "b", '{"query": "rain <|tool_ca', complete=False)]


def test_cut_off_inside_a_header():
    """A header cut off names no call: its name may be cut short ("get_wea"), and a client dispatching calls by
    name must never get a name no tool has; its text is dropped, not made content."""
    parser = ToolCallParser()
    parser.feed("ok" + SECTION_BEGIN + CALL_BEGIN + "functions.get_wea")
    assert parser.called and parser.calls == []
    assert parser.finish() == ParsedDelta()
    assert parser.calls == [] and not parser.called and parser.content == "ok"
    assert parse("ok" + SECTION_BEGIN + CALL_BEGIN + "functions.get_wea").calls == []


@pytest.mark.parametrize("header", ["functions", "functions.", "func", "functions.get_weather:0"])
def test_a_header_cut_before_its_arguments_is_no_call(header):
    assert parse("ok" + SECTION_BEGIN + call("functions.a:0", "{}") + CALL_BEGIN + header).calls == [
        ToolCall("functions.a:0", "a", "{}", complete=True)]


def test_a_header_that_call_end_closes_is_a_call_without_arguments():
    assert parse(SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + CALL_END + SECTION_END).calls == [
        ToolCall("functions.f:0", "f", "", complete=True)]


def test_a_call_interrupted_by_another_or_by_section_end_is_incomplete():
    parser = parse(SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGUMENT_BEGIN + '{"a": 1'
                   + call("functions.g:1", "{}") + CALL_BEGIN + "functions.h:2" + ARGUMENT_BEGIN + '{"b"'
                   + CALL_BEGIN + "functions.cut_sh" + SECTION_END + "after")
    assert parser.calls == [ToolCall("functions.f:0", "f", '{"a": 1', complete=False),
                            ToolCall("functions.g:1", "g", "{}", complete=True),
                            ToolCall("functions.h:2", "h", '{"b"', complete=False)]  # the cut header: no call
    assert parser.content == "after"


@pytest.mark.parametrize("header, name", [("functions.get_weather:0", "get_weather"), ("get_weather:12", "get_weather"),
                                          ("functions.get_weather", "get_weather"), (" search ", "search")])
def test_name_from_the_header(header, name):
    parser = parse(section(call(header, "{}")))
    assert (parser.calls[0].id, parser.calls[0].name) == (header.strip(), name)


def test_to_openai_shapes():
    cut = EXAMPLE.index(WEATHER) + 8  # first chunk ends inside get_weather's arguments
    parser = ToolCallParser()
    deltas = [c.to_openai() for chunk in (EXAMPLE[:cut], EXAMPLE[cut:]) for c in parser.feed(chunk).calls]
    assert deltas == [
        {"index": 0, "id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": WEATHER[:8]}},
        {"index": 0, "function": {"arguments": WEATHER[8:]}},
        {"index": 1, "id": "functions.get_time:1", "type": "function",
         "function": {"name": "get_time", "arguments": TIME}},
    ]
    assert [c.to_openai() for c in parser.calls] == [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": WEATHER}},
        {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": TIME}},
    ]


@pytest.mark.parametrize("text, content, calls", [
    (EXAMPLE, "I will check.", [("functions.get_weather:0", WEATHER), ("functions.get_time:1", TIME)]),
    ("查一下。" + section(call("functions.get_weather:0", UNICODE)), "查一下。",
     [("functions.get_weather:0", UNICODE)]),
])
def test_tokens_decoded_one_by_one(tmp_path, text, content, calls):
    write_tokenizer(tmp_path, 1024)
    tok = KimiTokenizer.from_dir(tmp_path)
    ids = tok.encode(text, allow_special=True)
    assert tok.special_ids[CALL_BEGIN] in ids  # markers are single special tokens
    parser, done = ToolCallParser(), 0
    for k in range(len(ids)):
        decoded = tok.decode(ids[: k + 1])
        if not decoded.endswith("\ufffd"):  # a character still incomplete waits for its next token
            parser.feed(decoded[done:])
            done = len(decoded)
    parser.finish()
    assert done == len(text)
    assert parser.content == content
    assert [(c.id, c.arguments, c.complete) for c in parser.calls] == [(i, a, True) for i, a in calls]
