"""Prefill, then decode token by token, for a static batch of prompts of different lengths, through the step
loop (`steps.Steps`) on any backend of the runtime interface."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import K2Error
from .interface import Cache, Model
from .sampling import SamplingParams, sample
from .steps import Steps


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids only, without the stop token
    finish_reason: str = "length"  # "stop" when a stop id was drawn
    ttft_ms: float = 0.0  # prefill and the first token
    tpot_ms: float = 0.0  # mean time per later token


class Generator:
    def __init__(self, model: Model):
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

    def prefill(self, prompts: list[list[int]], cache: Cache) -> np.ndarray:
        """Runs the prompts (rows right-padded) into an empty cache -> logits at each row's last token [b, vocab]."""
        return Steps(self.model, cache).prefill(list(range(len(prompts))), prompts)

    def decode(self, tokens: np.ndarray, active: np.ndarray, cache: Cache) -> np.ndarray:
        """One token per row at the end of its sequence -> logits [b, vocab]; inactive rows leave the cache alone."""
        return Steps(self.model, cache).decode(list(range(len(tokens))), tokens, active)

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
        return Steps(self.model, self.model.new_cache(1, len(prompt))).prefill([0], [prompt], every_position=True)[0]
