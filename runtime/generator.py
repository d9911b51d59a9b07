"""Prefill, then decode token by token, for a batch of prompts of different lengths."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import K2Error
from .ort_backend import OrtModel
from .sampling import SamplingParams, sample


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids only, without the stop token
    finish_reason: str = "length"  # "stop" when a stop id was drawn
    ttft_ms: float = 0.0  # prefill and the first token
    tpot_ms: float = 0.0  # mean time per later token


class Generator:
    def __init__(self, model: OrtModel):
        self.model = model
        self.config = model.config

    def check_prompt(self, prompt: list[int], max_new_tokens: int = 0) -> None:
        if not prompt:
            raise K2Error("the prompt is empty; give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise K2Error(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        if len(prompt) + max_new_tokens > self.config.max_position_embeddings:
            raise K2Error(f"prompt ({len(prompt)}) plus max new tokens ({max_new_tokens}) exceeds the context of "
                          f"{self.config.max_position_embeddings} positions")

    def prefill(self, prompts: list[list[int]], cache) -> np.ndarray:
        """Runs the prompts (rows right-padded) into an empty cache -> logits at each row's last token [b, vocab]."""
        lengths = np.array([len(p) for p in prompts])
        width = int(lengths.max())
        token_ids = np.zeros((len(prompts), width), dtype=np.int64)
        for row, prompt in enumerate(prompts):
            token_ids[row, : len(prompt)] = prompt
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), token_ids.shape).copy()
        valid = positions < lengths[:, None]
        hidden = self.model.forward(token_ids, positions, valid, cache)
        last = hidden[np.arange(len(prompts)), lengths - 1][:, None]  # [b, 1, m]
        return self.model.logits(last)[:, 0]

    def decode(self, tokens: np.ndarray, active: np.ndarray, cache) -> np.ndarray:
        """One token per row at the end of its sequence -> logits [b, vocab]; inactive rows leave the cache alone."""
        positions = cache.lengths[:, None].copy()
        hidden = self.model.forward(tokens[:, None].astype(np.int64), positions, active[:, None], cache)
        return self.model.logits(hidden)[:, 0]

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        for prompt in prompts:
            self.check_prompt(prompt, params.max_new_tokens)
        started = time.perf_counter()
        cache = self.model.new_cache(len(prompts), max(len(p) for p in prompts) + params.max_new_tokens)
        results = [Generation(list(p)) for p in prompts]
        rngs = [np.random.default_rng(None if params.seed is None else [params.seed, row]) for row in range(len(prompts))]
        logits = self.prefill(prompts, cache)
        active = np.ones(len(prompts), dtype=bool)
        tokens = np.zeros(len(prompts), dtype=np.int64)
        first_token_at = None
        for step in range(params.max_new_tokens):
            for row in np.flatnonzero(active):
                token = sample(logits[row], params, rngs[row])
                if token in params.stop_ids:
                    results[row].finish_reason = "stop"
                    active[row] = False
                else:
                    results[row].token_ids.append(token)
                    tokens[row] = token
            if first_token_at is None:
                first_token_at = time.perf_counter()
            if not active.any() or step == params.max_new_tokens - 1:
                break
            logits = self.decode(tokens, active, cache)
        finished = time.perf_counter()
        for result in results:
            result.ttft_ms = (first_token_at - started) * 1e3
            later = max(len(result.token_ids) - 1, 0)
            result.tpot_ms = (finished - first_token_at) * 1e3 / later if later else 0.0
        return results

    def score(self, prompt: list[int]) -> np.ndarray:
        """float32 logits of every prompt position [len, vocab], from one prefill."""
        self.check_prompt(prompt)
        cache = self.model.new_cache(1, len(prompt))
        positions = np.arange(len(prompt), dtype=np.int64)[None]
        hidden = self.model.forward(np.array([prompt], dtype=np.int64), positions, np.ones_like(positions, dtype=bool), cache)
        return self.model.logits(hidden)[0]
