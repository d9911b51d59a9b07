"""The sampling options a client may give, each changing the next token as it is specified to."""

import numpy as np
import pytest

from k2deploy.core.errors import K2Error
from k2deploy.runtime.engine.sampling import SamplingParams, adjusted, sample, token_logprobs

LOGITS = np.array([2.0, 1.9, -1.0, 0.5, -3.0], dtype=np.float32)


def _draws(params: SamplingParams, logits=LOGITS, n=400, **history) -> set[int]:
    rng = np.random.default_rng(0)
    return {sample(logits, params, rng, **history) for _ in range(n)}


def test_presence_and_frequency_penalties_subtract_per_output_occurrence():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = adjusted(LOGITS, params, prompt=[0, 0, 3], generated=[1, 1, 1, 3])
    assert out.tolist() == pytest.approx([2.0, 1.9 - 0.5 - 0.75, -1.0, 0.5 - 0.5 - 0.25, -3.0])  # the prompt: no
    assert sample(LOGITS, SamplingParams(frequency_penalty=0.2), None, generated=[0]) == 1  # greedy turns


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    out = adjusted(LOGITS, SamplingParams(repetition_penalty=2.0), prompt=[0, 2], generated=[4])
    assert out.tolist() == pytest.approx([1.0, 1.9, -2.0, 0.5, -6.0])


def test_logit_bias_forces_or_bans_a_token_at_any_temperature():
    assert _draws(SamplingParams(temperature=2.0, logit_bias=((4, 100.0),))) == {4}
    assert 0 not in _draws(SamplingParams(temperature=1.0, logit_bias=((0, -100.0),)))
    assert sample(LOGITS, SamplingParams(logit_bias=((3, 1.6),)), None) == 3  # greedy too


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_likeliest():
    probs = np.exp(LOGITS - LOGITS.max())  # relative to the likeliest: 1, 0.90, 0.05, 0.22, 0.007
    assert _draws(SamplingParams(temperature=1.0, min_p=0.5)) == {0, 1}
    assert _draws(SamplingParams(temperature=1.0, min_p=0.2)) == {0, 1, 3}
    assert probs[3] / probs[0] > 0.2 > probs[2] / probs[0]


def test_top_k_keeps_the_k_likeliest():
    assert _draws(SamplingParams(temperature=2.0, top_k=2)) == {0, 1}


@pytest.mark.parametrize("top_k", [5, 6, 10**9])
def test_a_top_k_of_the_vocabulary_or_more_keeps_every_token(top_k):
    assert _draws(SamplingParams(temperature=3.0, top_k=top_k), n=2000) == {0, 1, 2, 3, 4}
    logprob, top = token_logprobs(LOGITS, 0, top_k)  # as many as there are, likeliest first
    assert [token for token, _ in top] == [0, 1, 3, 2, 4]


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits():
    logprob, top = token_logprobs(LOGITS, 3, 3)
    expected = LOGITS.astype(np.float64) - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert logprob == pytest.approx(expected[3])
    assert [t for t, _ in top] == [0, 1, 3] and [lp for _, lp in top] == pytest.approx(expected[[0, 1, 3]])
    assert token_logprobs(LOGITS, 2, 0) == (pytest.approx(expected[2]), ())


@pytest.mark.parametrize("options, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must lie in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must lie in [-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must lie in (0, 10]"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias value must lie in [-100, 100]"),
    ({"min_p": 1.5}, "min_p must lie in [0, 1]"),
    ({"logprobs": 21}, "top logprobs must lie in [0, 20]"),
])
def test_out_of_range_options_are_refused(options, message):
    with pytest.raises(K2Error, match=message.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**options)


def test_logits_that_leave_no_token_or_are_not_finite_are_refused():
    masked = np.full(5, -np.inf, dtype=np.float32)
    with pytest.raises(K2Error, match="no token may come next"):
        sample(masked, SamplingParams(), None)
    with pytest.raises(K2Error, match="no token may come next"):
        sample(LOGITS, SamplingParams(logit_bias=tuple((i, -100.0) for i in range(5)), banned_ids=(0, 1, 2, 3, 4)), None)
    for bad in (np.nan, np.inf):
        with pytest.raises(K2Error, match="non-finite logits"):
            sample(np.array([0.0, bad, -np.inf], dtype=np.float32), SamplingParams(temperature=1.0),
                   np.random.default_rng(0))
