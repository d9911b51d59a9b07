"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded. numpy only."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.errors import K2Error


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 32
    stop_ids: tuple[int, ...] = ()
    banned_ids: tuple[int, ...] = ()  # never sampled (e.g. the tool-call section when no tool may be called)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise K2Error(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise K2Error(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise K2Error(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise K2Error(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits [vocab] float32 -> one token id."""
    if not np.isfinite(logits).all():
        raise K2Error("the model produced non-finite logits (NaN or inf); the artifact's weights or inputs are "
                      "damaged, re-export it from a sound checkpoint")
    if params.banned_ids:
        logits = logits.copy()
        logits[list(params.banned_ids)] = -np.inf
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    if params.top_k:
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
    return int(rng.choice(probs.shape[0], p=probs))
