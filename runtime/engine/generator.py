"""Generation for `k2deploy generate`, score and the benchmarks: a batch of prompts as requests of the step loop
(`step_loop.StepLoop`, the server's), on any backend of the runtime interface; and the single prefill and
decode forwards (`batch_forward.BatchForward`) that benchmarks time one by one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...core.errors import K2Error
from .batch_forward import BatchForward
from ..cache.slots import Cache
from ..text.answer import AnswerStream
from ..text.constrained import Constraint
from ..backends.interface import Model
from .requests import GenerationRequest, Update
from .sampling import SamplingParams
from .step_loop import StepLoop


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # generated ids only, without the stop token
    finish_reason: str = "length"  # "stop" when a stop id was drawn
    ttft_ms: float = 0.0  # prefill and the first token
    tpot_ms: float = 0.0  # mean time per later token
    cached_tokens: int = 0  # prompt tokens found in the prefix cache, not prefilled
    text: str | None = None  # the answer's text, with its answer stream (runtime/text/answer.py); None without one
    reasoning: str = ""  # a thinking model's reasoning, split from the text
    tool_calls: list[dict] = field(default_factory=list)  # the calls the answer made, as the OpenAI API writes them
    speculative: dict = field(default_factory=dict)  # draft_tokens, accepted_tokens, forward_steps


class Generator:
    def __init__(self, model: Model, speculative: str = "auto"):
        """speculative: auto (drafted tokens checked where they pay, the same tokens) or off
        (runtime/engine/speculation.py)."""
        self.model = model
        self.config = model.config
        self.speculative = speculative

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
        return BatchForward(self.model, cache).prefill(list(range(len(prompts))), prompts)

    def decode(self, tokens: np.ndarray, active: np.ndarray, cache: Cache) -> np.ndarray:
        """One token per row at the end of its sequence -> logits [b, vocab]; inactive rows leave the cache alone."""
        return BatchForward(self.model, cache).decode(list(range(len(tokens))), tokens, active)

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 constraints: Callable[[list[int]], Constraint | None] = lambda prompt: None,
                 answers: Callable[[list[int]], AnswerStream | None] = lambda prompt: None) -> list[Generation]:
        """The prompts as requests of the step loop, run until each finished (a stop id or max_new_tokens);
        constraints(prompt): the grammar its answer keeps to (runtime/text/constrained.py), None for a free one;
        answers(prompt): its answer's text, reasoning and tool calls as the server makes them (runtime/text/answer.py),
        None for token ids alone."""
        for prompt in prompts:
            self.check_prompt(prompt, params.max_new_tokens)
        loop = StepLoop(self.model, len(prompts), max(len(p) for p in prompts) + params.max_new_tokens, max_queue=0,
                        speculative=self.speculative)
        streams = [answers(p) for p in prompts]
        updates: list[list[Update]] = [[] for _ in prompts]
        requests = [GenerationRequest(list(p), params, updates[row].append, row=row, constraint=constraints(p),
                                      answer=streams[row]) for row, p in enumerate(prompts)]
        for request in requests:  # one sharing another's prompt start waits for its pages (Scheduler.leader)
            loop.submit(request)
        loop.run_until_done()
        results = []
        for request, stream, got in zip(requests, streams, updates):
            if request.error is not None:
                raise K2Error(request.error)
            later = len(request.generated) - 1
            results.append(Generation(request.prompt_ids, list(request.generated), request.finish_reason,
                                      (request.first_token_at - request.arrived_at) * 1e3,
                                      (request.last_token_at - request.first_token_at) * 1e3 / later if later > 0 else 0.0,
                                      request.cached_prompt_tokens or 0,
                                      None if stream is None else "".join(u.text for u in got),
                                      "".join(u.reasoning for u in got), [] if stream is None else stream.calls(),
                                      request.speculation.as_dict()))
        return results

    def score(self, prompt: list[int]) -> np.ndarray:
        """float32 logits of every prompt position [len, vocab], from one prefill."""
        self.check_prompt(prompt)
        forward = BatchForward(self.model, self.model.new_cache(1, len(prompt)))
        return forward.prefill([0], [prompt], every_position=True)[0]

