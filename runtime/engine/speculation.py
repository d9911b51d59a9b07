"""Speculative decoding without a draft model: tokens a request's own text suggests (prompt and history lookup), checked
by one forward of several positions, kept where the model's own choice is the same.

The draft: the longest earlier match (NGRAM_SIZES, longest first) of the request's last tokens in its prompt and what
it generated, and the up to MAX_DRAFTS tokens that followed that match (`PromptLookup`, an index of every n-gram's
latest end, kept as tokens come); where its own tokens hold none, the same in the loop's recent answers
(`RecentOutputs`: the last 65,536 tokens other requests generated, bounded, for the artifact the loop runs).

The check is the non-speculative process itself. A decode step of a request with k drafted tokens runs its last token
and the k drafts at their positions in one forward, which gives each position the logits it would get alone (a
backend whose multi-position forward is exact, `exact_positions`: the native step). Then the request samples position
0 exactly as a decode step would (its own sampler, grammar, penalties and random stream), and goes on to position
i + 1 only while the token it sampled at position i is draft i: each position's logits were computed after the very
tokens the request has now chosen, so every sample is the one decoding one token a step would draw, and the random
stream advances once per sampled token in the same order. Positions past the first mismatch are dropped unsampled;
their cache entries are never committed (the slot's length is the accepted one, its spare pages go back, and only
pages filled by accepted tokens get a prefix hash). Greedy or seeded, the tokens and log-probabilities are the ones
`--speculative off` gives, alone or in a batch.

Where a grammar constrains the answer (a json_schema, tools), the tokens it forces next (JSON keys and punctuation,
Kimi's tool-call markers, a call id's fixed parts: llguidance's fast-forward tokens) are the draft instead, whatever
the measured acceptance: each is the only token its mask will allow, so it is accepted unless the model writes the
same text in other tokens.

`auto` drafts only where it pays: each request keeps its measured acceptance (accepted over drafted, with one prior
success in two), the loop keeps the measured time of a step by the positions its longest row ran, and a request
drafts the k (0 .. MAX_DRAFTS) whose expected tokens a step, 1 + a + ... + a^k, over the step's time relative to a
one-token step is largest (each step's time the least of its last 8 measured: a busy host's pauses only ever add
time, so they do not turn drafting off); k = 0 (no draft) wins where acceptance is low (random weights) or a wider
step is slow.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "off")
MAX_DRAFTS = 7  # tokens a request drafts at most in one step (a step then runs 8 positions)
NGRAM_SIZES = (4, 3, 2)  # match lengths tried, longest first
PRIOR_COST = 0.1  # before a wider step was timed: each extra position costs this much of a one-token step
COST_WINDOW = 8  # a step's cost: the least of its last this many measured times (a pause only ever adds time)


class PromptLookup:
    """A request's tokens (prompt, then what it generates) and, for each n-gram, where its latest earlier occurrence
    ended: the draft is what followed the last tokens the last time they occurred."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> the index after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in NGRAM_SIZES:  # each n-gram ending here, kept as it ended before this one (propose reads it)
                if end > n:
                    self.latest[tuple(self.tokens[end - n - 1:end - 1])] = end - 1

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest n-gram the tokens end with, at its latest earlier place."""
        end = len(self.tokens)
        for n in NGRAM_SIZES:
            if end <= n:
                continue
            at = self.latest.get(tuple(self.tokens[end - n:]))
            if at is not None and at < end:
                return self.tokens[at:at + limit]
        return []


class RecentOutputs:
    """The latest `capacity` tokens that requests generated (on a server: across its requests, for one artifact), in
    a ring, and each n-gram's latest place in it: a request whose own tokens hold no match may draft what followed
    its last tokens in an earlier answer (agents repeat text across turns and requests). Bounded: the ring's tokens
    and at most 4 x capacity n-grams (the index is rebuilt from the ring when it grows past that)."""

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self.ring = [0] * capacity
        self.written = 0  # tokens written over the ring's life; position p sits at ring[p % capacity]
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence

    def add(self, tokens: list[int]) -> None:
        """One finished answer's tokens (n-grams never span two answers)."""
        start = self.written
        for token in tokens:
            self.ring[self.written % self.capacity] = token
            self.written += 1
            end = self.written
            for n in NGRAM_SIZES:
                if end - start > n:
                    self.latest[tuple(self._span(end - n - 1, end - 1))] = end - 1
        if len(self.latest) > 4 * self.capacity:  # drop the n-grams whose place the ring wrote over
            oldest = self.written - self.capacity
            self.latest = {gram: at for gram, at in self.latest.items() if at - len(gram) >= oldest}

    def _span(self, first: int, stop: int) -> list[int]:
        return [self.ring[p % self.capacity] for p in range(first, stop)]

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest n-gram `tokens` end with, where it last occurred."""
        oldest = self.written - self.capacity
        for n in NGRAM_SIZES:
            if len(tokens) < n:
                continue
            gram = tuple(tokens[-n:])
            at = self.latest.get(gram)
            if at is not None and at - n >= oldest and tuple(self._span(at - n, at)) == gram:
                return self._span(at, min(at + limit, self.written))
        return []


@dataclass
class SpeculationStats:
    """What speculation did for one request: tokens drafted, drafts accepted, forwards that gave it tokens."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    forward_steps: int = 0

    def as_dict(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "forward_steps": self.forward_steps}


class Speculation:
    """A step loop's speculation: its mode, and the time of a step by the positions its longest row ran."""

    def __init__(self, mode: str, exact: bool):
        """mode: auto or off; exact: the backend's forward of several positions gives each the logits it gets alone
        (without it nothing is drafted: the tokens would no longer be the ones decoding gives)."""
        if mode not in MODES:
            raise ValueError(f"speculative mode {mode!r}: choose one of {', '.join(MODES)}")
        self.on = mode == "auto" and exact
        self.seconds: dict[int, list[float]] = {}  # positions a row -> the step's last COST_WINDOW measured seconds
        self.recent = RecentOutputs()  # the answers of the loop's earlier requests

    def relative_cost(self, positions: int) -> float:
        """A step of `positions` positions a row against a one-token step (measured where both were, else the
        prior)."""
        if positions == 1:
            return 1.0
        if 1 in self.seconds and positions in self.seconds:
            return min(self.seconds[positions]) / min(self.seconds[1])
        return 1.0 + PRIOR_COST * (positions - 1)

    def timed(self, positions: int, seconds: float) -> None:
        kept = self.seconds.setdefault(positions, [])
        kept.append(seconds)
        del kept[:-COST_WINDOW]

    def draft(self, lookup: PromptLookup, stats: SpeculationStats, room: int) -> list[int]:
        """The tokens a request drafts this step (at most `room`: what its max_tokens and the context leave): from
        its own tokens, else from recent answers."""
        if not self.on or room <= 0:
            return []
        limit = min(MAX_DRAFTS, room)
        proposal = lookup.propose(limit) or self.recent.propose(lookup.tokens, limit)
        if not proposal:
            return []
        rate = (stats.accepted_tokens + 1) / (stats.draft_tokens + 2)
        best, best_gain, expected = 0, 1.0, 1.0
        for k in range(1, len(proposal) + 1):
            expected += rate ** k
            gain = expected / self.relative_cost(k + 1)
            if gain > best_gain:
                best, best_gain = k, gain
        return proposal[:best]
