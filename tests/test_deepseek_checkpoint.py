"""A checkpoint in DeepSeek-V3's layout (model_type deepseek_v3, a `tokenizer.json` written by the `tokenizers`
library with its own special tokens and chat template) exports, generates text, scores and serves chat; one that
ships no tokenizer still runs everything that takes token ids."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from cli_runner import run_cli  # noqa: E402

from k2deploy.core.checkpoint.presets import SHARD_BYTES, preset_config  # noqa: E402
from k2deploy.core.checkpoint.synthetic import write_checkpoint  # noqa: E402
from k2deploy.core.errors import K2Error  # noqa: E402
from k2deploy.core.tokenizer_files import load_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # a tokenizer trained and a checkpoint exported

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do the gulls go?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "tide", "arguments": '{"port": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "high at six"},
        {"role": "assistant", "content": "Out to sea."}, {"role": "user", "content": "And then?"}]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """{"checkpoint", "artifact"}: the tiny preset as model_type deepseek_v3, exported through the CLI."""
    root = tmp_path_factory.mktemp("deepseek")
    checkpoint = write_checkpoint(root / "checkpoint", preset_config("tiny", overrides=["model_type=deepseek_v3"]),
                                  shard_bytes=SHARD_BYTES["tiny"])
    done = run_cli("export", checkpoint, "--out", root / "artifact", "--target", "cuda")
    assert done.returncode == 0, done.stderr
    assert "export: tokenizer: tokenizer.json, tokenizer_config.json, generation_config.json" in done.stderr
    return {"checkpoint": checkpoint, "artifact": root / "artifact"}


def test_the_tokenizer_is_what_transformers_loads(deepseek):
    """Same ids for text, same rendered chat (tool calls and results included) as transformers' fast tokenizer."""
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(deepseek["artifact"] / "tokenizer")
    theirs = transformers.AutoTokenizer.from_pretrained(str(deepseek["checkpoint"]))
    text = "The harbour town wakes before the sun, 1,234 gulls. <｜User｜> stays text"
    assert ours.encode(text, allow_special=True) == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))
    rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == rendered
    assert rendered.startswith("<｜begin▁of▁sentence｜>Be brief.<｜User｜>Where do the gulls go?<｜Assistant｜>")
    # client text never forms an added token: the marker typed in a message is plain text
    ids = ours.encode_chat([{"role": "user", "content": "<｜Assistant｜>"}])
    assert ids.count(ours.special_ids["<｜Assistant｜>"]) == 1  # the generation prompt's only


def test_generate_and_score_run_on_the_artifact(deepseek, tmp_path):
    done = run_cli("generate", deepseek["artifact"], "--prompt", "The harbour town", "--max-new-tokens", "6", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert isinstance(result["text"], str) and len(result["token_ids"]) >= 1
    chat = run_cli("generate", deepseek["artifact"], "--chat", "--prompt", "hi", "--max-new-tokens", "4", "--json")
    assert chat.returncode == 0, chat.stderr
    assert json.loads(chat.stdout)["prompt_ids"][:1] == [0]  # the template's bos
    scored = run_cli("score", deepseek["artifact"], "--prompt-ids", "5,6,7", "--out", tmp_path / "l.npy")
    assert scored.returncode == 0, scored.stderr
    assert np.load(tmp_path / "l.npy").shape == (3, 1024)


def test_tools_need_kimi_tool_call_tokens(deepseek, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "tide"}}]))
    done = run_cli("generate", deepseek["artifact"], "--chat", "--prompt", "hi", "--tools", tools)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "Kimi K2's format only" in done.stderr


def test_serves_chat_to_the_openai_client(deepseek, tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from serving import MODEL, Server

    server = Server(deepseek["artifact"], tmp_path / "serve")
    try:
        client = server.client()
        answer = client.chat.completions.create(model=MODEL, messages=CHAT[:2], max_tokens=6, temperature=0)
        assert answer.choices[0].message.role == "assistant" and isinstance(answer.choices[0].message.content, str)
        tokenizer = load_tokenizer(deepseek["artifact"] / "tokenizer")
        assert answer.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT[:2]))
        with pytest.raises(openai.BadRequestError, match="Kimi K2"):
            client.chat.completions.create(model=MODEL, messages=CHAT[:2], max_tokens=6,
                                           tools=[{"type": "function", "function": {"name": "tide"}}])
    finally:
        server.stop()


@pytest.fixture(scope="module")
def without_tokenizer(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("no-tokenizer")
    checkpoint = shutil.copytree(tiny_checkpoint, root / "checkpoint")
    for name in ("tiktoken.model", "tokenizer_config.json"):
        (checkpoint / name).unlink()
    done = run_cli("export", checkpoint, "--out", root / "artifact", "--target", "cuda", "--kv-cache", "bf16")
    assert done.returncode == 0, done.stderr
    assert "export: no tokenizer (tiktoken.model or tokenizer.json)" in done.stderr
    return root / "artifact"


def test_an_artifact_without_a_tokenizer_runs_on_token_ids(without_tokenizer, tmp_path):
    done = run_cli("generate", without_tokenizer, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["text"] is None and len(json.loads(done.stdout)["token_ids"]) == 4
    assert run_cli("score", without_tokenizer, "--prompt-ids", "5,6", "--out", tmp_path / "l.npy").returncode == 0
    bench = run_cli("bench", without_tokenizer, "--batch", "1", "--prompt-len", "8", "--gen-len", "2", "--baseline",
                    "none", "--repeats", "1", "--warmup", "0", "--out", tmp_path / "bench", "--json")
    assert bench.returncode == 0, bench.stderr
    text = run_cli("generate", without_tokenizer, "--prompt", "hello")
    assert text.returncode != 0 and "carries no tokenizer; pass --prompt-ids" in text.stderr


def test_serving_without_a_tokenizer_takes_token_id_prompts(without_tokenizer, tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("starlette")
    from serving import MODEL, Server

    server = Server(without_tokenizer, tmp_path / "serve")
    try:
        client = server.client()
        whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0)
        ids = whole.choices[0].model_extra["token_ids"]
        assert len(ids) == whole.usage.completion_tokens == 4 and whole.choices[0].text == ""
        streamed = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, stream=True)
        assert [i for c in streamed for i in c.choices[0].model_extra["token_ids"]] == ids
        for ask in (lambda: client.completions.create(model=MODEL, prompt="hello", max_tokens=4),
                    lambda: client.chat.completions.create(model=MODEL, messages=CHAT[1:2], max_tokens=4)):
            with pytest.raises(openai.BadRequestError, match="no tokenizer") as caught:
                ask()
            assert caught.value.code == "no_tokenizer"
    finally:
        server.stop()


@pytest.mark.parametrize("name, content, problem", [
    ("tokenizer.json", '{"model": 5}', "tokenizer.json: is not a tokenizer the tokenizers library can load"),
    ("tokenizer.json", "[1", "tokenizer.json: is not a tokenizer the tokenizers library can load"),
    ("tokenizer_config.json", "\udcff", "tokenizer_config.json: is not UTF-8 text"),
    ("tokenizer_config.json", '{"eos_token": "<eos>"}', "eos_token '<eos>' is not one of tokenizer.json's added"),
    ("generation_config.json", "[]", "generation_config.json: is not a JSON object"),
], ids=["not a tokenizer", "not JSON", "not UTF-8", "an unknown eos", "a config that is not an object"])
def test_a_damaged_tokenizer_json_folder_names_the_file(deepseek, tmp_path, name, content, problem):
    folder = shutil.copytree(deepseek["artifact"] / "tokenizer", tmp_path / "tokenizer")
    (folder / name).write_bytes(content.encode("utf-8", "surrogateescape"))
    with pytest.raises(K2Error, match=problem.replace("(", r"\(")):
        load_tokenizer(folder)
