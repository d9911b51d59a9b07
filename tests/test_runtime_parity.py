"""The exported artifact, run by ONNX Runtime, against the eager PyTorch reference of the same checkpoint."""

import numpy as np
import pytest

pytest.importorskip("torch")

from k2deploy.bench import parity  # noqa: E402
from k2deploy.export import reference  # noqa: E402
from k2deploy.core.manifest import load_manifest  # noqa: E402
from k2deploy.runtime.engine.generator import Generator  # noqa: E402
from k2deploy.runtime.backends.onnx.model import OrtModel  # noqa: E402
from k2deploy.runtime.engine.sampling import SamplingParams  # noqa: E402

PROMPTS = [
    [5, 17, 300, 42, 9, 1000, 77, 3, 640, 12, 12, 401],
    [1, 2, 3],
    [700, 650, 20, 20, 20, 999, 4, 80, 81, 82, 83, 84, 85, 86, 87, 88, 500, 1],
]


@pytest.fixture(scope="module")
def generators(tiny_artifacts):
    return {cache: Generator(OrtModel(load_manifest(path))) for cache, path in tiny_artifacts.items()}


# prompt logits against the reference, max and mean |d| (logits of standard deviation near 2)
PROMPT_LOGIT_BOUNDS = {"bf16": (0.05, 0.01), "fp8": (8.0, 0.5)}


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_prompt_logits_match_the_float32_reference(generators, tiny_reference, cache):
    # The prompt attends to its own positions as the cache stores them (as a later decode step reads them), so
    # the cache format enters the prompt logits. Measured on these prompts: bf16 max |d| 0.017-0.022, mean
    # 0.003-0.004, every argmax the reference's; fp8 (e4m3's 3 mantissa bits) max 2.7-4.3, mean 0.10-0.27,
    # argmax 83-100%. A broken cache (wrong scale, wrong slot) gives errors of the logits' own size.
    largest, mean = PROMPT_LOGIT_BOUNDS[cache]
    for prompt in PROMPTS:
        error = np.abs(generators[cache].score(prompt) - reference.prompt_logits(tiny_reference, prompt).numpy())
        assert error.max() < largest and error.mean() < mean, (prompt, error.max(), error.mean())


def test_bf16_cache_greedy_tokens_are_identical(generators, tiny_reference):
    for prompt in PROMPTS:
        same, expected, got = parity.greedy_agreement(tiny_reference, generators["bf16"], prompt, 32)
        assert got == expected


def test_fp8_cache_agreement(generators, tiny_reference):
    # e4m3 keeps 3 mantissa bits against bf16's 7: the cached latent carries ~16x the relative
    # error, and an occasional flipped expert choice amplifies one step. Measured on these
    # prompts (teacher-forced, 32 steps): agreement 0.97-1.0, mean |dlogit| ~0.05 against ~0.003
    # for the bf16 cache. The thresholds leave room for that, and no more: a broken cache
    # (wrong scale, wrong slot) drops agreement to chance and the error to the logits' own size.
    results = [parity.teacher_forced(tiny_reference, generators["fp8"], prompt, 32) for prompt in PROMPTS]
    assert np.mean([r["argmax_agreement"] for r in results]) >= 0.9
    assert max(r["mean_abs_logit_error"] for r in results) < 0.15
    bf16 = parity.teacher_forced(tiny_reference, generators["bf16"], PROMPTS[0], 32)
    assert bf16["argmax_agreement"] == 1.0 and bf16["mean_abs_logit_error"] < 0.01


def test_a_batch_of_different_lengths_equals_each_prompt_alone(generators):
    generator = generators["bf16"]
    params = SamplingParams(max_new_tokens=12)
    alone = [generator.generate([p], params)[0].token_ids for p in PROMPTS]
    together = [g.token_ids for g in generator.generate(PROMPTS, params)]
    assert together == alone


def test_single_token_prompt_and_the_cache_at_its_maximum_length(generators, tiny_reference):
    generator = generators["bf16"]
    assert generator.generate([[7]], SamplingParams(max_new_tokens=5))[0].token_ids == reference.greedy(tiny_reference, [7], 5)
    cache = generator.model.new_cache(1, 8)
    generator.prefill([list(range(1, 8))], cache)
    generator.decode(np.array([9]), np.array([True]), cache)  # fills position 7, the last slot
    assert cache.lengths.tolist() == [8]
    from k2deploy.core.errors import K2Error

    with pytest.raises(K2Error, match="past the cache"):
        generator.decode(np.array([9]), np.array([True]), cache)


def test_sampling_is_seeded_and_stops_on_stop_ids(generators):
    generator = generators["fp8"]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=3, max_new_tokens=16)
    first = generator.generate([PROMPTS[0]], params)[0].token_ids
    assert generator.generate([PROMPTS[0]], params)[0].token_ids == first
    assert generator.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=4, max_new_tokens=16))[0].token_ids != first
    greedy = generator.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8))[0].token_ids
    at = next(i for i, token in enumerate(greedy) if i and token not in greedy[:i])  # its first appearance
    stopped = generator.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, stop_ids=(greedy[at],)))[0]
    assert stopped.token_ids == greedy[:at] and stopped.finish_reason == "stop"
