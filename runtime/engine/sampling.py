"""Choosing the next token from logits: penalties and bias, greedy, temperature, top-k, top-p, min-p, seeded; the\nsampled token's log-probability. numpy only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...core.errors import K2Error


PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency penalties, as OpenAI takes them
BIAS_RANGE = (-100.0, 100.0)  # a logit_bias value, as OpenAI takes it
MAX_TOP_LOGPROBS = 20


SEED_RANGE = (-(2**63), 2**63)  # a seed: a signed 64-bit integer, as OpenAI's API takes it


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0 (or the vocabulary or more): no limit
    top_p: float = 1.0
    min_p: float = 0.0  # drops tokens less likely than min_p x the likeliest one's probability
    seed: int | None = None
    max_new_tokens: int = 32
    stop_ids: tuple[int, ...] = ()
    banned_ids: tuple[int, ...] = ()  # never sampled (e.g. the tool-call section when no tool may be called)
    presence_penalty: float = 0.0  # OpenAI's: subtracted from a token's logit once it is in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time the token is in the output
    repetition_penalty: float = 1.0  # transformers' (CTRL): a token of the prompt or output has its logit divided
    # by this where positive, multiplied where negative; 1: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    logprobs: int | None = None  # None: none; n: the sampled token's log-probability and the n likeliest ones'

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise K2Error(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise K2Error(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise K2Error(f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise K2Error(f"min_p must lie in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 1:
            raise K2Error(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= getattr(self, name) <= PENALTY_RANGE[1]:
                raise K2Error(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10):
            raise K2Error(f"repetition_penalty must lie in (0, 10], got {self.repetition_penalty}")
        if any(not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1] for _, bias in self.logit_bias):
            raise K2Error("each logit_bias value must lie in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise K2Error(f"top logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise K2Error(f"seed must fit in a signed 64-bit integer, got {self.seed}")

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.banned_ids)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, prompt: Sequence[int] = (),
           generated: Sequence[int] = ()) -> int:
    """logits [vocab] float32 (-inf: a token a grammar forbids) -> one token id; prompt and generated (the output so
    far) feed the penalties."""
    top = float(logits.max())  # NaN wherever one is (max propagates it): one pass over the vocabulary
    if math.isnan(top) or top == math.inf:
        raise K2Error("the model produced non-finite logits (NaN or inf); the artifact's weights or inputs are "
                      "damaged, re-export it from a sound checkpoint")
    if params.adjusts_logits:
        logits = adjusted(logits, params, prompt, generated)
        top = float(logits.max())
    if top == -math.inf:
        raise K2Error("no token may come next: the grammar, bias and banned tokens together forbid them all")
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.shape[0]:  # a top_k of the vocabulary or more keeps every token
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]  # smallest set reaching top_p
        kept = np.zeros_like(probs)
        kept[keep] = probs[keep]
        probs = kept / kept.sum()
    if params.min_p:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return int(rng.choice(probs.shape[0], p=probs))


def adjusted(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]) -> np.ndarray:
    """The logits [vocab] after the repetition penalty, OpenAI's presence and frequency penalties, logit_bias and
    the banned tokens, in that order (float64, a copy)."""
    out = logits.astype(np.float64)
    if params.repetition_penalty != 1:
        seen = np.unique(np.fromiter((*prompt, *generated), dtype=np.int64))
        out[seen] = np.where(out[seen] > 0, out[seen] / params.repetition_penalty, out[seen] * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(generated):
        counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=out.shape[0])[:out.shape[0]]
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for token, bias in params.logit_bias:
        out[token] += bias
    if params.banned_ids:
        out[list(params.banned_ids)] = -np.inf
    return out


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The model's log-probability of `token` under logits [vocab] (before penalties, bias and temperature, as
    OpenAI reports them) and the `top` likeliest (id, log-probability), likeliest first."""
    shifted = logits.astype(np.float64) - logits.max()
    logprobs = shifted - np.log(np.exp(shifted).sum())
    top = min(top, logprobs.shape[0])
    best = np.argpartition(-logprobs, top - 1)[:top] if top else np.empty(0, dtype=np.int64)
    best = best[np.argsort(-logprobs[best], kind="stable")]
    return float(logprobs[token]), tuple((int(i), float(logprobs[i])) for i in best)
