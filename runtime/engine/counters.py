"""What the step loop counts as it runs, declared here so that the loop needs no server: any object with these
Prometheus-style counters and histograms will do (runtime/serve/metrics.py's ServerMetrics is one)."""

from __future__ import annotations

from typing import Protocol


class Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


class Labelled(Protocol):
    def labels(self, *values: str) -> Counter: ...


class StepCounters(Protocol):
    prompt_tokens: Counter  # prompt tokens prefilled
    cached_prompt_tokens: Counter  # prompt tokens found in the cache at admission
    generated_tokens: Counter
    preemptions: Counter
    finished: Labelled  # generations ended, by reason (stop, length, cancelled, error)
    ttft: Histogram  # seconds from arrival to the first token
    per_token: Histogram  # seconds between a request's tokens
    decode_batch: Histogram  # sequences each decode step ran
    draft_tokens: Counter  # tokens drafted (runtime/engine/speculation.py)
    accepted_tokens: Counter  # drafted tokens accepted
