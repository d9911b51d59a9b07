"""Constraints never bend an answer that already keeps to its schema: a model whose answer is a tool call (or a
JSON value) in any of the spacings JSON is written in gets it back through the server byte for byte, streamed and
not, while padding past what json.dumps writes stays masked.

The model is the tiny artifact's, its head replaced by a script (bench/scripted_head.py): the n-th logits row it
makes puts all its weight on the n-th token of a chosen answer (so the answer may repeat tokens, as JSON does), and
greedy decoding follows the script exactly as long as the grammar lets it."""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from k2deploy.bench.scripted_head import ScriptedHead  # noqa: E402
from k2deploy.core.manifest import load_manifest  # noqa: E402
from k2deploy.core.tokenizer_files import load_tokenizer  # noqa: E402
from k2deploy.runtime.text.constrained import Grammars, json_grammar  # noqa: E402
from k2deploy.runtime.backends.onnx.model import OrtModel  # noqa: E402
from k2deploy.runtime.engine.config import resolve_engine_config  # noqa: E402
from k2deploy.runtime.serve.app import build_app  # noqa: E402
from k2deploy.runtime.serve.engine_thread import Engine  # noqa: E402
from k2deploy.runtime.serve.metrics import ServerMetrics  # noqa: E402

MODEL = "scripted"
VALUE = {"city": "Paris", "days": [1, 2], "units": {"metric": True}}
SPACINGS = {  # how a model may write the same arguments: json.dumps' own forms
    "spaced": json.dumps(VALUE),
    "compact": json.dumps(VALUE, separators=(",", ":")),
    "indented": json.dumps(VALUE, indent=2),
    "tabs": json.dumps(VALUE, indent="\t"),
}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {
    "type": "integer"}}, "units": {"type": "object", "properties": {"metric": {"type": "boolean"}}}},
    "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tiny_cpu_artifact):
    manifest = load_manifest(tiny_cpu_artifact)
    tokenizer = load_tokenizer(tiny_cpu_artifact / "tokenizer", manifest.config.vocab_size)
    model = ScriptedHead(OrtModel(manifest))
    metrics = ServerMetrics()
    engine = Engine(model, resolve_engine_config(manifest, max_context=512, max_queue=8), metrics)
    with TestClient(build_app(engine, tokenizer, MODEL, metrics)) as http:
        yield model, tokenizer, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)


def _call_arguments(client, stream: bool) -> tuple[str, str]:
    """The answer's one call's arguments and its finish_reason."""
    asked = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120)
    if not stream:
        choice = client.chat.completions.create(**asked).choices[0]
        calls = choice.message.tool_calls or []
        assert [c.function.name for c in calls] == ["get_weather"], choice
        return calls[0].function.arguments, choice.finish_reason
    arguments, finish = "", None
    for chunk in client.chat.completions.create(**asked, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return arguments, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spacing", SPACINGS)
def test_a_tool_call_comes_back_byte_identical_in_any_spacing(served, spacing, stream):
    model, tokenizer, client = served
    model.script(tokenizer.encode(CALL.replace("{}", SPACINGS[spacing]), allow_special=True))
    assert _call_arguments(client, stream) == (SPACINGS[spacing], "tool_calls")


@pytest.mark.parametrize("spacing", SPACINGS)
def test_a_json_answer_comes_back_byte_identical_in_any_spacing(served, spacing):
    model, tokenizer, client = served
    model.script(tokenizer.encode(SPACINGS[spacing] + "<|im_end|>", allow_special=True))
    answer = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=120,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": "weather", "schema": SCHEMA}}).choices[0]
    assert (answer.message.content, answer.finish_reason) == (SPACINGS[spacing], "stop")


def test_a_json_answer_after_the_reasoning_keeps_both(served):
    """response_format with a thinking prompt (chat_template_kwargs thinking): the reasoning runs free up to
    </think>, then the answer is the JSON, as the model wrote it."""
    model, tokenizer, client = served
    model.script(tokenizer.encode("Paris, surely.</think>" + SPACINGS["indented"] + "<|im_end|>", allow_special=True))
    answer = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=120, response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"thinking": True}}).choices[0]
    assert (answer.message.content, answer.finish_reason) == (SPACINGS["indented"], "stop")
    assert answer.message.model_extra["reasoning_content"] == "Paris, surely."


@pytest.mark.parametrize("padded", ['{"city":' + " " * 40 + '"Paris"}', '{' + "\n" * 3 + '"city": "Paris"}',
                                    '{"city": "Paris"' + " \n" * 30 + "}", '{"city":  "Paris"}',
                                    '{\n' + " " * 33 + '"city": "Paris"}'])
def test_padding_past_what_json_dumps_writes_is_masked(served, padded):
    """A weak model cannot pad an answer: between two JSON tokens at most one space, then one line break and 32
    spaces or 16 tabs of indentation."""
    _, tokenizer, _ = served
    grammars = Grammars(tokenizer, 1024)
    constraint = grammars.constraint(json_grammar(SCHEMA))
    masked = False
    for token in tokenizer.encode(padded):
        if constraint.allowed(np.zeros(1024, np.float32))[token] == -np.inf:
            masked = True
            break
        constraint.consume(token)
    assert masked


TWO_CALLS = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>'
             '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')


@pytest.mark.parametrize("stream", [False, True])
def test_several_calls_in_one_section_come_back_as_several_tool_calls(served, stream):
    """Kimi K2 writes two calls in one section (vLLM #24478 misparsed them): two tool_calls, each with its own id
    functions.NAME:IDX and its arguments, streamed as deltas of index 0 then 1, no special token in any piece."""
    model, tokenizer, client = served
    model.script(tokenizer.encode(TWO_CALLS, allow_special=True))
    asked = dict(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120)
    if not stream:
        choice = client.chat.completions.create(**asked).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        finish = choice.finish_reason
    else:
        calls, finish = [], None
        for chunk in client.chat.completions.create(**asked, stream=True):
            for choice in chunk.choices:
                assert not any(name in (choice.delta.content or "") for name in tokenizer.special_ids)
                for delta in choice.delta.tool_calls or []:
                    if delta.id is not None:
                        assert delta.index == len(calls)
                        calls.append((delta.id, delta.function.name, ""))
                    index = delta.index
                    assert not any(name in (delta.function.arguments or "") for name in tokenizer.special_ids)
                    calls[index] = (*calls[index][:2], calls[index][2] + (delta.function.arguments or ""))
                finish = choice.finish_reason or finish
    assert calls == [("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                     ("functions.get_weather:1", "get_weather", '{"city": "Rome"}')]
    assert finish == "tool_calls"
