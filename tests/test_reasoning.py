"""A thinking model's reasoning (`<think>` ... `</think>`, as Kimi-K2-Thinking writes it) comes back apart from its
answer: `reasoning_content` whole and streamed (before the answer and any tool calls), `generate --chat` too."""

from __future__ import annotations

import json
import random

import pytest

from k2deploy.runtime.text.reasoning import ReasoningSplitter

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("torch")

from cli_runner import run_cli  # noqa: E402
from scripted import script, write_scripted_checkpoint  # noqa: E402
from serving import MODEL, Server, with_markers_flagged, with_tokenizer_config  # noqa: E402

from k2deploy.core.tokenizer import THINKING_CHAT_TEMPLATE, TOOL_MARKERS, KimiTokenizer, write_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # a server per case of the markers


def _split(pieces: list[str], thinking: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(thinking)
    parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(p.reasoning for p in parts), "".join(p.answer for p in parts)


@pytest.mark.parametrize("text, thinking, expected", [
    ("<think>plan it</think>\nSeven.", False, ("plan it", "\nSeven.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("Seven <think> is text here", False, ("", "Seven <think> is text here")),
    ("plan it</think>Seven.", True, ("plan it", "Seven.")),
    ("<think>cut off mid-thou", False, ("cut off mid-thou", "")),
    ("<", False, ("", "<")),
    ("<think>call it<|tool_calls_section_begin|><|tool_call_begin|>f", False,
     ("call it", "<|tool_calls_section_begin|><|tool_call_begin|>f")),
    ("call it<|tool_call_section_begin|>x", True, ("call it", "<|tool_call_section_begin|>x")),
    ("call it<|tool_call_begin|>x</think>y", True, ("call it", "<|tool_call_begin|>x</think>y")),
])
def test_reasoning_splits_the_same_however_the_text_arrives(text, thinking, expected):
    assert _split([text], thinking) == expected
    for seed in range(20):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _split(pieces, thinking) == expected, pieces


# (each token of a scripted answer may appear once: tests/scripted.py)
ANSWER = "<think>Check it</think>At six.<|im_end|>"
CALL = ("<think>Use it</think><|tool_calls_section_begin|><|tool_call_begin|>functions.bakery:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
CALL_IN_REASONING = ("<think>Use it<|tool_calls_section_begin|><|tool_call_begin|>functions.bakery:0"  # not closed
                     "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
TOOLS = [{"type": "function", "function": {"name": "bakery", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder, 1024)
    return KimiTokenizer.from_dir(folder)


def _artifact(root, tokenizer, answer):
    from k2deploy.export.exporter import ExportOptions, export_artifact

    checkpoint = write_scripted_checkpoint(root / "checkpoint",
                                           script(tokenizer.encode("<|im_middle|>" + answer, allow_special=True)))
    export_artifact(ExportOptions(str(checkpoint), kv_cache="bf16", target="cuda"), root / "artifact")
    return root / "artifact"


@pytest.mark.parametrize("special", [True, False], ids=["markers flagged special", "markers not special"])
@pytest.mark.parametrize("answer, tools", [(ANSWER, None), (CALL, TOOLS), (CALL_IN_REASONING, TOOLS)],
                         ids=["answer", "tool call", "tool call before the reasoning closes"])
def test_reasoning_content_whole_and_streamed(tmp_path, tokenizer, answer, tools, special):
    """Through the official openai client, whatever the tokenizer config says of the think and tool markers."""
    artifact = with_markers_flagged(_artifact(tmp_path, tokenizer, answer), tmp_path / "flagged",
                                    ("<think>", "</think>", *TOOL_MARKERS), special)
    offered = []  # the tools offered to generate too: without them a call's section may not be sampled
    if tools:
        (tmp_path / "tools.json").write_text(json.dumps(tools))
        offered = ["--tools", tmp_path / "tools.json"]
    shown = json.loads(run_cli("generate", artifact, "--chat", "--prompt", "When?", "--json", *offered).stdout)
    reasoning = "Check it" if tools is None else "Use it"
    assert shown["reasoning"] == reasoning and "<think>" not in shown["text"]
    server = Server(artifact, tmp_path / "serve")
    try:
        asked = {"model": MODEL, "messages": [{"role": "user", "content": "When?"}], "max_tokens": 40, "temperature": 0}
        asked |= {"tools": tools} if tools else {}
        message = server.client().chat.completions.create(**asked).choices[0].message
        assert message.model_extra["reasoning_content"] == reasoning
        if tools is None:
            assert message.content == "At six."
        else:
            assert not message.content and message.tool_calls[0].function.name == "bakery"
        deltas = [c.choices[0].delta for c in server.client().chat.completions.create(**asked, stream=True)
                  if c.choices]
        thoughts = [i for i, d in enumerate(deltas) if (d.model_extra or {}).get("reasoning_content")]
        answered = [i for i, d in enumerate(deltas) if d.content or d.tool_calls]
        assert "".join(deltas[i].model_extra["reasoning_content"] for i in thoughts) == reasoning
        assert thoughts and answered and max(thoughts) < min(answered)  # the reasoning first
        assert not any("think>" in (d.content or "") for d in deltas)
        for delta in deltas:  # no special token's text in any streamed piece
            texts = [delta.content or "", (delta.model_extra or {}).get("reasoning_content") or ""]
            texts += [t for c in delta.tool_calls or [] for t in (c.id or "", c.function.name or "",
                                                                   c.function.arguments or "")]
            assert not any(name in text for name in tokenizer.special_ids for text in texts), delta
        if tools is None:  # the template opens the reasoning on request: the answer continues inside it
            opened = server.client().chat.completions.create(**asked, extra_body={
                "chat_template_kwargs": {"thinking": True}})
            assert opened.choices[0].message.model_extra["reasoning_content"] == reasoning
            assert opened.choices[0].message.content == "At six."
            assert opened.usage.prompt_tokens == len(tokenizer.encode_chat(asked["messages"])) + 1
            with pytest.raises(openai.BadRequestError, match="must be a boolean or a number"):
                server.client().chat.completions.create(**asked, extra_body={
                    "chat_template_kwargs": {"thinking": "<think>"}})
    finally:
        server.stop()


def test_the_template_opens_the_reasoning_when_asked(tokenizer):
    messages = [{"role": "user", "content": "When?"}]
    think = tokenizer.special_ids["<think>"]
    assert tokenizer.encode_chat(messages, options={"thinking": True}) == tokenizer.encode_chat(messages) + [think]
    assert tokenizer.encode_chat(messages, options={"thinking": False}) == tokenizer.encode_chat(messages)
    assert tokenizer.encode_chat(messages, options={"messages": []}) == tokenizer.encode_chat(messages)


# A K2-Thinking agent chat: an earlier answer (its reasoning is history), then the current turn's call made with
# reasoning and sent back by the client with an id of another vendor's form, and the call's result.
THINKING_CHAT = [
    {"role": "user", "content": "Is the bakery open?"},
    {"role": "assistant", "content": "Let me see.", "reasoning_content": "Old thoughts."},
    {"role": "user", "content": "When?"},
    {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
        {"id": "call_9f", "type": "function", "function": {"name": "bakery", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_9f", "name": "bakery", "content": "06:00"},
]
THINKING_PROMPT = (  # as Kimi-K2-Thinking's template renders it: the history's reasoning left out, the call's kept
    "<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS, separators=(",", ":")) + "<|im_end|>"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\n"
    "<|im_user|>user<|im_middle|>Is the bakery open?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>Let me see.<|im_end|>"
    "<|im_user|>user<|im_middle|>When?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>Look it up.</think><|tool_calls_section_begin|><|tool_call_begin|>"
    "functions.bakery:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    "<|im_system|>bakery<|im_middle|>## Return of functions.bakery:0\n06:00<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>")


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("thinking")
    write_tokenizer(folder, 1024, thinking=True)  # as an INT4 (Kimi-K2-Thinking) synthetic checkpoint carries it
    return KimiTokenizer.from_dir(folder)


def test_the_thinking_template_keeps_only_the_current_turns_reasoning(thinking_tokenizer, tokenizer):
    from k2deploy.runtime.text.chat_tools import normalise_call_ids

    expected = thinking_tokenizer.encode(THINKING_PROMPT, allow_special=True)
    assert thinking_tokenizer.encode_chat(normalise_call_ids(THINKING_CHAT), TOOLS) == expected
    answered = [*THINKING_CHAT, {"role": "assistant", "content": "At six.", "reasoning_content": "It said 06:00."},
                {"role": "user", "content": "Thanks"}]  # the call's turn is history now: its reasoning goes too
    shown = thinking_tokenizer.decode(thinking_tokenizer.encode_chat(normalise_call_ids(answered), TOOLS))
    assert "Look it up." not in shown and "It said" not in shown and shown.count("<think></think>") == 3
    assert "Old thoughts" not in tokenizer.decode(tokenizer.encode_chat(THINKING_CHAT))  # Instruct's: no reasoning


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_serve_renders_reasoning_of_tool_call_turns_as_the_checkpoints_template_says(tmp_path, tokenizer,
                                                                                       thinking_tokenizer, stream):
    """`reasoning_content` on an assistant tool-call turn is accepted and rendered, earlier reasoning blanked, the
    foreign call id renamed functions.NAME:IDX: the prompt the server counts is the template's."""
    artifact = with_tokenizer_config(_artifact(tmp_path, tokenizer, CALL), tmp_path / "thinking",
                                     lambda config: config.update(chat_template=THINKING_CHAT_TEMPLATE))
    server = Server(artifact, tmp_path / "serve")
    try:
        asked = {"model": MODEL, "messages": THINKING_CHAT, "tools": TOOLS, "max_tokens": 40, "temperature": 0}
        if stream:
            chunks = list(server.client().chat.completions.create(**asked, stream=True,
                                                                  stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = server.client().chat.completions.create(**asked).usage
        assert usage.prompt_tokens == len(thinking_tokenizer.encode(THINKING_PROMPT, allow_special=True))
    finally:
        server.stop()
