"""Third round of hostile input: schemas bounded before the grammar engine compiles them (a chain of 1,000 $refs
crashed it, 600 properties failed an answer mid-way), a top_k past the vocabulary, integers of thousands of digits,
endless files, absurd thread counts and stop strings: each a one-line refusal, a 400 or a sensible answer, never a
crash, a stall or a traceback."""

import json

import pytest

from cli_runner import run_cli
from k2deploy.core.errors import K2Error
from k2deploy.runtime.text.chat_tools import MAX_TOOLS, check_tools
from k2deploy.runtime.text.schema_limits import LIMITS, SchemaTooLarge, check_schema


def _chain(links: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"]}
            for i in range(links)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{links}": {"type": "string"}}}


def _tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


@pytest.mark.parametrize("schema, words", [
    (_chain(1000), "more than 64 deep"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}, "600 properties"),
    ({"enum": list(range(5000))}, "an enum of 5000 values"),
    ({"anyOf": [{"type": "object", "properties": {f"p{j}": {"type": "integer"} for j in range(200)}}
                for _ in range(60)]}, "more than 10000 schemas"),
])
def test_schemas_past_a_limit_are_refused_naming_it(schema, words):
    with pytest.raises(SchemaTooLarge, match=words):
        check_schema(schema)
    with pytest.raises(SchemaTooLarge, match=f"`tools\\[0\\].function.parameters` .*{words}"):
        check_tools(_tool(schema))


@pytest.mark.parametrize("schema, loop", [
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/\\$defs/a -> #/\\$defs/a"),
    ({"$ref": "#"}, "# -> #"),
    ({"$defs": {"a": {"$ref": "#/$defs/b", "title": "A"}, "b": {"$ref": "#/$defs/a"}},
      "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}, "#/\\$defs/b -> #/\\$defs/a -> #/\\$defs/b"),
])
def test_a_schema_that_refers_only_to_itself_is_refused(schema, loop):
    """A loop of references that say nothing else defines no value: it was a 200 with empty content and finish
    "stop" (no JSON value); now a refusal naming the loop, for response_format as for tools."""
    from k2deploy.runtime.serve.protocol import ApiError, parse_options

    with pytest.raises(SchemaTooLarge, match=f"refers only to itself: {loop}"):
        check_schema(schema)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    with pytest.raises(ApiError, match="refers only to itself") as refused:
        parse_options(body, chat=True)
    assert refused.value.status == 400 and refused.value.param == "response_format"


def test_schemas_within_the_limits_pass_recursive_and_shared_ones_too():
    tree = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    shared = {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
              "type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/point"} for i in range(LIMITS.properties)}}
    for schema in (tree, shared, _chain(LIMITS.depth - 2), {"enum": list(range(LIMITS.enum))}):
        check_schema(schema)


def test_more_tools_than_openai_allows_are_refused():
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
    with pytest.raises(K2Error, match=f"declares {MAX_TOOLS + 1} tools; at most {MAX_TOOLS}"):
        check_tools(tools)


def test_generate_with_a_thousand_deep_tools_schema_is_one_line(tiny_cpu_artifact, tmp_path):
    """It exited 139 (a segfault inside the grammar engine)."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(_tool(_chain(1000))))
    refused = run_cli("generate", tiny_cpu_artifact, "--chat", "--prompt", "hi", "--tools", tools)
    assert refused.returncode == 2 and "more than 64 deep" in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("top_k", ["1025", str(10**9)])
def test_generate_with_a_top_k_past_the_vocabulary_samples_from_all_of_it(tiny_cpu_artifact, top_k):
    """It was a traceback ("kth out of bounds"); OpenAI-compatible servers take it as no limit."""
    done = run_cli("generate", tiny_cpu_artifact, "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                   "--temperature", "1", "--top-k", top_k, "--seed", "1", "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(json.loads(done.stdout)["token_ids"]) == 3


@pytest.mark.parametrize("body", [b'{"model": "m", "prompt": "\xff\xfe"}', b"\xff\xfe{}", '{"a": "é"}'.encode("latin-1")])
def test_a_body_that_is_not_utf8_is_called_so(body):
    """Bytes that are not UTF-8 are a 400 that says so (they were "a number with too many digits")."""
    from k2deploy.runtime.serve.protocol import ApiError, parse_json

    with pytest.raises(ApiError, match=r"\(not UTF-8\)") as refused:
        parse_json(body)
    assert refused.value.status == 400 and refused.value.code == "invalid_json"


def test_a_number_of_thousands_of_digits_is_garbled_json_not_a_crash(tiny_cpu_artifact, tmp_path):
    """Python refuses to convert integers past 4,300 digits with a ValueError that was a 500 and a traceback."""
    from k2deploy.runtime.serve.protocol import ApiError, parse_json

    with pytest.raises(ApiError, match="a number with too many digits"):
        parse_json(b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}")
    tools = tmp_path / "tools.json"
    tools.write_text('[{"type": "function", "function": {"name": "f", "parameters": {"maxProperties": '
                     + "9" * 5000 + "}}}]")
    refused = run_cli("generate", tiny_cpu_artifact, "--chat", "--prompt", "hi", "--tools", tools)
    assert refused.returncode == 2 and "not valid JSON (a number with too many digits" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, words", [
    (["--chat", "--prompt", "hi", "--tools", "/dev/zero"], "holds more than 4194304 bytes"),
    (["--prompt-ids", "1,2", "--threads", "100000"], "--threads 100000: give 1 to 256"),
])
def test_endless_files_and_absurd_thread_counts_are_one_line(tiny_cpu_artifact, args, words):
    refused = run_cli("generate", tiny_cpu_artifact, *args)
    assert refused.returncode == 2 and words in refused.stderr, refused.stderr[-2000:]
    assert len(refused.stderr.strip().splitlines()) == 1


def test_a_stop_string_past_its_length_limit_is_a_400():
    """Each token's text is checked against every stop string's starts: a 1 MB one stalled every request."""
    from k2deploy.runtime.serve.protocol import MAX_STOP_CHARS, ApiError, parse_options

    with pytest.raises(ApiError, match=f"at most {MAX_STOP_CHARS} characters"):
        parse_options({"model": "m", "prompt": "hi", "stop": ["x" * (MAX_STOP_CHARS + 1)]}, chat=False)
    assert parse_options({"model": "m", "prompt": "hi", "stop": ["x" * MAX_STOP_CHARS]}, chat=False).stop
