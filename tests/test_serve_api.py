"""`k2deploy serve` as a client sees it: a real server process on 127.0.0.1 (torch blocked), the official
`openai` client for the happy paths, httpx for raw bytes, errors and disconnects."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serving import MODEL, Server  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_artifacts, tmp_path_factory):
    running = Server(tiny_artifacts["fp8"], tmp_path_factory.mktemp("serve"), "--max-batch", "16", "--max-queue", "16")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_artifacts):
    from k2deploy.core.tokenizer import KimiTokenizer

    return KimiTokenizer.from_dir(tiny_artifacts["fp8"] / "tokenizer")


def test_models_and_health(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client().models.retrieve("gpt-4")
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def test_logprobs_are_the_log_softmax_of_the_models_logits(server, tiny_artifacts, tokenizer):
    """Each sampled token's logprob and top_logprobs, chat and completions, whole and streamed, equal the
    log-softmax of `score`'s logits of the whole text (prompt and answer, one prefill) at the positions that
    chose them, to float rounding: the server's prefill attends to its own positions as the FP8 cache stores
    them, as its decode steps read them, so a text's logits do not depend on how it was run. Prompts share no
    cache page, so no answer reads another's prefix from the cache."""
    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.engine.generator import Generator
    from k2deploy.runtime.backends.onnx.model import OrtModel
    from k2deploy.runtime.engine.sampling import SamplingParams

    client, generator = server.client(), Generator(OrtModel(load_manifest(tiny_artifacts["fp8"])))
    asked = {"max_tokens": 8, "temperature": 0}
    first, second = "The harbour town wakes before the sun.", "Gulls circle over the quiet boats."
    completion = client.completions.create(model=MODEL, prompt=first, logprobs=3, **asked).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=second, logprobs=2, stream=True, **asked) if c.choices[0].logprobs]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": first}], logprobs=True,
                                          top_logprobs=2, **asked).choices[0].logprobs.content
    cases = [
        (tokenizer.encode(first), completion.tokens, completion.token_logprobs,
         [list(t.values()) for t in completion.top_logprobs]),
        (tokenizer.encode(second), [t for c in streamed for t in c.tokens],
         [lp for c in streamed for lp in c.token_logprobs], [list(t.values()) for c in streamed for t in c.top_logprobs]),
        (tokenizer.encode_chat([{"role": "user", "content": first}]), [e.token for e in chat],
         [e.logprob for e in chat], [[t.logprob for t in e.top_logprobs] for e in chat]),
    ]
    for prompt_ids, tokens, logprobs, tops in cases:
        # greedy: the server's tokens are generate's (tested above), named by their text
        ids = generator.generate([prompt_ids], SamplingParams(max_new_tokens=len(tokens)))[0].token_ids
        assert tokens == [tokenizer.token_bytes(i).decode("utf-8", "replace") for i in ids]
        # the logits at position i choose token i + 1: the prompt's last position chose the first answer token
        expected = _log_softmax(generator.score(prompt_ids + ids)[len(prompt_ids) - 1 : -1])  # [len(ids), vocab]
        assert logprobs == pytest.approx(expected[np.arange(len(ids)), ids].tolist(), abs=1e-4)
        for row, top in zip(expected, tops):  # completions' top_logprobs map text to logprob: same texts merge
            best = np.sort(row)[::-1][:3]
            assert top[0] == pytest.approx(best[0], abs=1e-4) and top == sorted(top, reverse=True)
            assert all(np.isclose(best, lp, atol=1e-4).any() for lp in top)
    assert [c.text_offset[0] for c in streamed] == [sum(map(len, streamed[0].tokens[:0]))] + [
        sum(len(t) for c in streamed[:i] for t in c.tokens) for i in range(1, len(streamed))]


def test_penalties_and_logit_bias_steer_the_server_as_generate(server, tiny_artifacts, tokenizer):
    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.engine.generator import Generator
    from k2deploy.runtime.backends.onnx.model import OrtModel
    from k2deploy.runtime.engine.sampling import SamplingParams

    client, prompt = server.client(), "The ferry leaves at dawn and the ferry returns at dusk."
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=1, seed=3,
                                       logit_bias={"7": 100}, extra_body={"top_k": 5, "min_p": 0.1})
    assert forced.choices[0].text == tokenizer.decode([7] * 4, skip_special=True)
    generator = Generator(OrtModel(load_manifest(tiny_artifacts["fp8"])))
    # a bias that makes token 7 the likeliest every step; the penalties then turn greedy decoding away from it
    penalties = {"frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 1.3}
    penalised = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                          logit_bias={"7": 30}, frequency_penalty=2, presence_penalty=2,
                                          extra_body={"repetition_penalty": 1.3})
    outputs = {}
    for name, options in (("plain", {}), ("penalised", penalties)):
        params = SamplingParams(max_new_tokens=16, stop_ids=tokenizer.stop_ids, logit_bias=((7, 30.0),), **options)
        outputs[name] = generator.generate([tokenizer.encode(prompt)], params)[0].token_ids
    assert penalised.choices[0].text == tokenizer.decode(outputs["penalised"], skip_special=True)
    assert outputs["plain"].count(7) == 16 and 0 < outputs["penalised"].count(7) < 16, outputs


def test_greedy_completion_is_what_generate_gives(server, tiny_artifacts, tokenizer):
    from k2deploy.core.manifest import load_manifest
    from k2deploy.runtime.engine.generator import Generator
    from k2deploy.runtime.backends.onnx.model import OrtModel
    from k2deploy.runtime.engine.sampling import SamplingParams

    prompt = "The harbour town wakes before the sun."
    result = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    generator = Generator(OrtModel(load_manifest(tiny_artifacts["fp8"])))
    expected = generator.generate([tokenizer.encode(prompt)], SamplingParams(max_new_tokens=12,
                                                                            stop_ids=tokenizer.stop_ids))[0]
    choice = result.choices[0]
    assert choice.text == tokenizer.decode(expected.token_ids, skip_special=True)  # as OpenAI: no special tokens
    assert choice.finish_reason == expected.finish_reason
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(tokenizer.encode(prompt)),
                                                                            len(expected.token_ids))
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.model == MODEL and result.object == "text_completion"


def test_streamed_completion_matches_the_whole_one(server):
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt=[5, 17, 300, 42], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 17, 300, 42], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_completion_uses_the_artifact_chat_template(server, tokenizer):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where do the gulls go?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_strings_cut_the_text(server):
    client = server.client()
    full = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=16, temperature=0).choices[0].text
    assert len(full) > 6, full
    stop = full[4:6]
    cut = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=16, temperature=0,
                                    stop=[stop, "\x07\x07"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=16, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_seeded_sampling_repeats(server):
    client = server.client()

    def draw(seed):
        return client.completions.create(model=MODEL, prompt="Tomorrow the gulls", max_tokens=8, temperature=1.0,
                                         top_p=0.9, seed=seed).choices[0].text

    assert draw(3) == draw(3)


def test_sixteen_concurrent_greedy_requests_match_each_alone(server):
    """Requests of different prompt and completion lengths join and leave the decode batch at different
    steps; each still gets exactly its own greedy tokens."""
    client = server.client()
    rng = np.random.default_rng(0)
    jobs = [(rng.integers(0, 700, size=int(n)).tolist(), int(m))
            for n, m in zip(rng.integers(2, 40, size=16), rng.integers(3, 13, size=16))]

    def run(job, delay=0.0):
        time.sleep(delay)  # the later ones staggered, to join a batch already decoding
        result = client.completions.create(model=MODEL, prompt=job[0], max_tokens=job[1], temperature=0)
        return result.choices[0].text, result.choices[0].finish_reason, result.usage.completion_tokens

    alone = [run(job) for job in jobs]
    solo_steps = server.metric('k2deploy_decode_step_sequences_bucket{le="1.0"}')
    steps = server.metric("k2deploy_decode_step_sequences_count")
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, jobs, [0.0] * 8 + [0.04 * i for i in range(len(jobs) - 8)]))
    assert together == alone
    shared = (server.metric("k2deploy_decode_step_sequences_count") - steps
              - server.metric('k2deploy_decode_step_sequences_bucket{le="1.0"}') + solo_steps)
    assert shared > 0, "no decode step ran two requests at once"
    server.wait_for_metric("k2deploy_cache_slots_used", 0)


def test_a_client_that_disconnects_frees_its_slot(server):
    cancelled = server.metric('k2deploy_generations_finished_total{reason="cancelled"}')
    body = {"model": MODEL, "prompt": "The ferry", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        server.wait_for_metric("k2deploy_cache_slots_used", 1)
    server.wait_for_metric("k2deploy_cache_slots_used", 0)
    server.wait_for_metric('k2deploy_generations_finished_total{reason="cancelled"}', cancelled + 1)
    # a whole (non-streamed) request whose client gives up is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body | {"stream": False}, timeout=1.0)
    server.wait_for_metric('k2deploy_generations_finished_total{reason="cancelled"}', cancelled + 2)
    server.wait_for_metric("k2deploy_cache_slots_used", 0)


def test_metrics_are_prometheus_text(server):
    server.client().completions.create(model=MODEL, prompt="a b c", max_tokens=3, temperature=0)
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    for name in ("k2deploy_requests_total", "k2deploy_generated_tokens_total", "k2deploy_prompt_tokens_total",
                 "k2deploy_time_to_first_token_seconds_bucket", "k2deploy_time_per_output_token_seconds_bucket",
                 "k2deploy_queue_depth", "k2deploy_cache_slots_used", "k2deploy_cache_tokens_used"):
        assert name in response.text, name
    assert server.metric("k2deploy_cache_slots") == 16
    assert server.metric("k2deploy_time_to_first_token_seconds_count") >= 1


def _long_prompt(tokens: int) -> list[int]:
    return [5] * tokens


# route, body (a dict is sent as JSON, bytes as they are), status, error code, error param, words in the message
BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny-k2", "prompt": ', 400, "invalid_json", None, "parse the JSON"),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json", None, "JSON object"),
    ("/v1/completions", {"prompt": "hi"}, 400, None, "model", "`model` is required"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found", "model", "does not exist"),
    ("/v1/completions", b'{"model": "tiny-k2", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "invalid_json", None, "nested deeper than 64 levels"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, None, "prompt", "`prompt` is required"),
    ("/v1/completions", {"model": MODEL}, 400, None, "prompt", "`prompt` is required"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, None, "prompt", "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": [["a"], "b"]}, 400, None, "prompt", "an array of either"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, None, "n", "[1, 16]"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 5000]}, 400, None, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, 400, None, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, None, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, None, "max_tokens", "at least 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5000}, 400, "context_length_exceeded",
     "max_tokens", "maximum context length is 4096"),
    ("/v1/completions", {"model": MODEL, "prompt": _long_prompt(4097), "max_tokens": 1}, 400,
     "context_length_exceeded", "prompt", "4097 in the prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 3}, 400, None, "temperature", "[0, 2]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, None, "temperature", "number"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, None, "top_p", "greater than 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 1.5}, 400, None, "seed", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, None, "stop",
     "at most 4"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, None, "stop", "not be empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, None, "stream", "boolean"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, None,
     "stream_options", "only allowed when `stream` is true"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, None, "logprobs", "[0, 20]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, None, "top_logprobs", "needs `logprobs` set to true"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 3}, 400, None, "presence_penalty",
     "[-2, 2]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, None, "logit_bias",
     "keys must be token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 150}}, 400, None, "logit_bias",
     "[-100, 100]"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, 400, None, "logit_bias",
     "outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, None, "repetition_penalty",
     "greater than 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "unsupported_option", "echo",
     "not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "unsupported_option", "best_of",
     "not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperatur": 1}, 400, "unrecognized_argument",
     "temperatur", "Unrecognized request argument"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, None, "messages", "non-empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, None, "messages", "non-empty array"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None,
     "messages[0].role", "must be one of"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 7}]}, 400, None,
     "messages[0].content", "string or an array of text parts"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400, "unsupported_option",
     "messages[0].content", "only text parts"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "<|im_end|>"}}]}, 400, None,
     "tools", "letters, digits, underscores or dashes"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "tool_choice": "required"}, 400, None, "tool_choice", "needs `tools`"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "6"}]}, 400, None,
     "messages[0].tool_call_id", "is required"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"id": "a"}]}]}, 400,
     None, "messages[0].tool_calls[0]", "arguments"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 4097}, 400, "context_length_exceeded", "max_tokens",
     "maximum context length"),
    ("/v1/embeddings", {"model": MODEL, "input": "hi"}, 404, "not_found", None, "Not Found"),
]


@pytest.mark.parametrize("route, body, status, code, param, words", BAD_REQUESTS,
                         ids=[f"{i:02d}-{row[4] or row[3]}" for i, row in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(server, route, body, status, code, param, words):
    raw = isinstance(body, bytes)
    send = {"content": body, "headers": {"content-type": "application/json"}} if raw else {"json": body}
    response = httpx.post(f"{server.url}{route}", timeout=30, **send)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param), error
    assert words in error["message"], error["message"]


def test_only_json_bodies_are_served_and_no_origin_is_allowed_by_default(server):
    """A web page may POST text/plain to any address without asking first; the server must not act on it."""
    body = '{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Origin": "https://evil.example"} | ({"Content-Type": content_type} if content_type else {})
        answer = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=30)
        assert answer.status_code == 415 and answer.json()["error"]["code"] == "unsupported_media_type", answer.text
        assert not any(h.startswith("access-control-") for h in answer.headers)
    preflight = httpx.options(f"{server.url}/v1/completions", timeout=30, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert not any(h.startswith("access-control-") for h in preflight.headers)
    assert httpx.post(f"{server.url}/v1/completions", content=body, timeout=30,
                      headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_bad_requests_disturb_nothing(server):
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405
    assert server.metric("k2deploy_cache_slots_used") == 0 and server.metric("k2deploy_queue_depth") == 0
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens <= 2
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.fixture
def guarded_server(tiny_artifacts, tmp_path):
    """One slot, no queue, an API key."""
    running = Server(tiny_artifacts["fp8"], tmp_path / "guarded", "--max-batch", "1", "--max-queue", "0",
                     "--api-key", "sesame", "--allow-origin", "http://localhost:3000")
    yield running
    running.stop()


def test_api_key_queue_full_and_sigterm_drain(guarded_server):
    server, key = guarded_server, {"Authorization": "Bearer sesame"}
    # the key: every route but /health
    assert httpx.get(f"{server.url}/health").status_code == 200
    for route in ("/v1/models", "/metrics"):
        assert httpx.get(f"{server.url}{route}").status_code == 401
        assert httpx.get(f"{server.url}{route}", headers={"Authorization": "Bearer wrong"}).status_code == 401
    denied = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "bearer sesame"}).status_code == 200
    client = server.client(api_key="sesame")
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens <= 2
    # more choices than the slot and the queue hold together, on an idle server: a 400 naming the limit, never a
    # 503 to retry forever
    never = httpx.post(f"{server.url}/v1/completions", headers=key, timeout=30,
                       json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
    assert never.status_code == 400 and "holds at most 1 at once" in never.json()["error"]["message"], never.text
    with pytest.raises(openai.BadRequestError, match="Send fewer prompts or a smaller n"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=3)

    # --allow-origin: that origin's pages may call (the preflight needs no key), no other's
    for origin, allowed in (("http://localhost:3000", True), ("https://evil.example", False)):
        preflight = httpx.options(f"{server.url}/v1/completions", timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert (preflight.headers.get("access-control-allow-origin") == origin) is allowed, preflight.headers

    # the one slot busy and no queue: 503 with Retry-After, and the running request carries on
    body = {"model": MODEL, "prompt": "The ferry", "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60, headers=key) as http, \
            http.stream("POST", f"{server.url}/v1/completions", json=body) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        busy = http.post(f"{server.url}/v1/completions", json=body | {"stream": False})
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.InternalServerError, match="at capacity"):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)

        # SIGTERM while it runs: it finishes, then the server exits
        server.process.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    server.process.wait(timeout=30)
    assert server.process.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.stderr_path.read_text()



WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14}},
           "required": ["city", "unit"], "additionalProperties": False}
TWO_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}},
             {"type": "function", "function": {"name": "clock", "parameters": {
                 "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
                 "additionalProperties": False}}}]


def _many(calls, count=50):
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(calls, range(count)))


@pytest.mark.slow
def test_json_schema_answers_validate_at_temperature_1(server):
    """A random-weight model sampled at temperature 1: every answer is JSON that follows the schema (its whitespace
    bounded between two JSON tokens, runtime/text/constrained.py WHITESPACE: 400 tokens are room enough)."""
    jsonschema = pytest.importorskip("jsonschema")
    client = server.client()
    answers = _many(lambda seed: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Weather, please ({seed})"}], temperature=1, seed=seed,
        max_tokens=400, response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER,
                                                                                 "strict": True}}).choices[0])
    for answer in answers:
        assert answer.finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.message.content), WEATHER)
    objects = _many(lambda seed: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Anything"}], temperature=1, seed=seed, max_tokens=200,
        response_format={"type": "json_object"}).choices[0], count=10)
    finished = [o for o in objects if o.finish_reason == "stop"]  # any object may run past max_tokens
    assert finished and all(isinstance(json.loads(o.message.content), dict) for o in finished)


@pytest.mark.slow
def test_tool_calls_at_temperature_1_name_declared_tools_with_valid_arguments(server):
    jsonschema = pytest.importorskip("jsonschema")
    client, schemas = server.client(), {t["function"]["name"]: t["function"]["parameters"] for t in TWO_TOOLS}
    for choice, count, parallel in (("required", 50, False), ("auto", 10, True)):  # one call, or any number
        answers = _many(lambda seed: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Weather or time? ({seed})"}], tools=TWO_TOOLS,
            tool_choice=choice, parallel_tool_calls=parallel, temperature=1, seed=seed, max_tokens=160).choices[0],
            count)
        ended = [a for a in answers if a.finish_reason == "tool_calls"]  # the rest ran past max_tokens
        if choice == "required":
            assert len(ended) >= 40 and all(a.finish_reason in ("tool_calls", "length") for a in answers)
        for call in (c for a in ended for c in a.message.tool_calls):
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    plain = _many(lambda seed: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Weather? ({seed})"}], temperature=1, seed=seed,
        max_tokens=8).choices[0])
    assert not any(a.message.tool_calls or a.finish_reason == "tool_calls" for a in plain)


def _ref_chain(links: int) -> dict:
    """An object schema nested `links` deep through a chain of $defs, each referring to the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"],
                      "additionalProperties": False} for i in range(links)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{links}": {"type": "string"}}}


WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}, "additionalProperties": False}


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "cannot be enforced"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": _ref_chain(1000)}}, "more than 64 deep"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": WIDE}}, "an object of 600 properties (at most 256)"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "must be {\"name\""),
    ({"type": "yaml"}, "text, json_object or json_schema"),
])
def test_a_response_format_that_cannot_be_enforced_is_a_400(server, response_format, words):
    answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": response_format})
    assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text


def test_a_tools_schema_past_the_limits_is_a_400_and_the_server_goes_on(server):
    """The chain of 1,000 $refs that crashed the grammar engine, and 600 properties that failed a whole step
    mid-answer, are refused before admission, naming the limit; the server then answers as before."""
    for schema, words in ((_ref_chain(1000), "more than 64 deep"), (WIDE, "600 properties")):
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
        assert answer.status_code == 400 and words in answer.json()["error"]["message"], answer.text
        assert answer.json()["error"]["param"] == "tools"
    assert httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200


def test_n_choices_share_one_prefill_of_their_prompt(server, tokenizer):
    """n=4 with a seed: four choices, sampled apart; the prompt counted once in
    usage and prefilled once: the other three choices take its pages (the full ones shared, the last copied) and
    run only its last token, for their own first token's logits."""
    client = server.client()
    prompt = "A long harbour morning: " + " ".join(f"boat {i} leaves," for i in range(40))
    length = len(tokenizer.encode(prompt))
    assert length % 64 != 1  # a partial last page to copy
    before = server.metric("k2deploy_prompt_tokens_cached_total")
    first = client.completions.create(model=MODEL, prompt=prompt, n=4, seed=7, temperature=1, max_tokens=6)
    assert server.metric("k2deploy_prompt_tokens_cached_total") - before == 3 * (length - 1)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2, 3] and len(set(texts)) > 1  # each its own stream
    assert first.usage.prompt_tokens == length
    assert [c.finish_reason for c in first.choices] == ["length"] * 4 and first.usage.completion_tokens == 4 * 6


def test_a_list_of_prompts_gets_a_choice_each_in_order(server, tokenizer):
    client, prompts = server.client(), ["The ferry leaves at dawn.", "Gulls over the harbour."]
    alone = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=5).choices[0].text
             for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=5)
    assert [(c.index, c.text) for c in batch.choices] == [(0, alone[0]), (1, alone[0]), (2, alone[1]), (3, alone[1])]
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    streamed = {}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=5, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: alone[0], 1: alone[1]}
