"""The step loop itself (what generate, bench and the server run): prompts longer than one prefill chunk, requests
that join while others decode, cancelled requests, a full queue; and bench over pipeline stages."""

import numpy as np
import pytest

pytest.importorskip("torch")

from k2deploy.core.manifest import load_manifest  # noqa: E402
from k2deploy.core.sizes import PREFILL_CHUNK  # noqa: E402
from k2deploy.export import reference  # noqa: E402
from k2deploy.runtime.backends.onnx.model import OrtModel  # noqa: E402
from k2deploy.runtime.engine.requests import GenerationRequest  # noqa: E402
from k2deploy.runtime.engine.sampling import SamplingParams  # noqa: E402
from k2deploy.runtime.engine.scheduler import QueueFull  # noqa: E402
from k2deploy.runtime.engine.step_loop import StepLoop  # noqa: E402


@pytest.fixture(scope="module")
def model(tiny_artifacts):
    return OrtModel(load_manifest(tiny_artifacts["bf16"]))  # the bf16 cache: greedy tokens equal the reference's


def _request(prompt, new_tokens, row=None):
    updates = []
    request = GenerationRequest(list(prompt), SamplingParams(max_new_tokens=new_tokens), updates.append,
                                row=row)
    return request, updates


def test_a_prompt_longer_than_one_prefill_chunk_generates_the_references_tokens(model, tiny_reference, monkeypatch):
    prompt = (np.arange(PREFILL_CHUNK + 200) * 37 % 1000 + 3).tolist()  # two prefill chunks: 512 + 200
    widths = []  # the s of every forward's token_ids [b, s]
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda token_ids, *rest: widths.append(token_ids.shape[1]) or forward(token_ids, *rest))
    loop = StepLoop(model, 1, len(prompt) + 6, max_queue=0)
    request, _ = _request(prompt, 6, row=0)
    loop.submit(request)
    loop.run_until_done()
    assert widths == [PREFILL_CHUNK, 200, 1, 1, 1, 1, 1]  # two chunks, then one forward per later token
    assert request.generated == reference.greedy(tiny_reference, prompt, 6)


def test_a_request_that_joins_while_another_decodes_gets_the_tokens_it_gets_alone(model):
    first, second = [5, 17, 300, 42, 9, 1000, 77], [700, 650, 20, 20, 999, 4]
    alone = {}
    for prompt in (first, second):
        loop = StepLoop(model, 1, 32, max_queue=0)
        request, _ = _request(prompt, 8)
        loop.submit(request)
        loop.run_until_done()
        alone[tuple(prompt)] = request.generated

    loop = StepLoop(model, 2, 32, max_queue=4)
    early, _ = _request(first, 8)
    late, _ = _request(second, 8)
    loop.submit(early)
    for _ in range(3):  # the first request is prefilled and decodes before the second arrives: its first step
        # samples a token from the prompt and decodes one more
        loop.step()
    assert len(early.generated) == 4 and not late.generated
    loop.submit(late)
    loop.run_until_done()
    assert early.generated == alone[tuple(first)] and late.generated == alone[tuple(second)]
    assert early.finish_reason == late.finish_reason == "length"


def test_a_cancelled_request_leaves_and_its_slot_serves_the_next(model):
    loop = StepLoop(model, 1, 32, max_queue=1)
    cancelled, _ = _request([5, 17, 300], 20)
    waiting, _ = _request([9, 8, 7, 6], 4)
    loop.submit(cancelled)
    loop.step()
    loop.submit(waiting)  # queued: the one slot is taken
    with pytest.raises(QueueFull):
        loop.submit(_request([1, 2], 2)[0])
    cancelled.cancelled = True
    loop.run_until_done()
    assert len(cancelled.generated) < 20
    assert len(waiting.generated) == 4 and waiting.finish_reason == "length"


def test_requests_that_arrive_together_with_a_shared_prefix_prefill_it_once(model):
    """8 requests sent at once whose prompts share a 2,048-token prefix: the first prefills it, the other 7 wait
    for its pages and find them in the cache (cached_tokens), each prefilling only its own tail; an unrelated
    request sent with them is not held back."""
    shared = (np.arange(2048) * 37 % 1000 + 3).tolist()
    prompts = [shared + [5 + i, 17, 300 + i] for i in range(8)] + [[9, 8, 7, 6]]
    loop = StepLoop(model, len(prompts), len(shared) + 16, max_queue=0)
    requests = [_request(prompt, 2)[0] for prompt in prompts]
    for request in requests:
        loop.submit(request)
    loop.step()
    assert [r.cached_prompt_tokens is not None for r in requests] == [True] + [False] * 7 + [True]  # admitted
    loop.run_until_done()
    assert [r.cached_prompt_tokens for r in requests] == [0] + [2048] * 7 + [0]
    assert all(len(r.generated) == 2 for r in requests)


def test_bench_runs_over_pipeline_stages(tiny_artifacts):
    from k2deploy.bench.run import BenchOptions, run_bench

    doc = run_bench(BenchOptions(str(tiny_artifacts["fp8"]), batches=[1], prompt_lens=[4], threads=1, gen_len=3,
                                 repeats=1, warmup=0, placement="0:1@cpu,1:3@cpu", baseline="none",
                                 bandwidth_bytes=1 << 22, bandwidth_repeats=1))
    cell = doc["cells"][0]
    assert cell["tpot_ms"]["median"] > 0 and doc["threads"] == 1
