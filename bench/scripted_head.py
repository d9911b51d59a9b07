"""A model whose answer is chosen in advance: the n-th logits row it makes (since `script` was last called) puts all
its weight on the script's n-th token; everything else (the cache, the layers' forwards) is the wrapped model's.
Greedy decoding then follows the script exactly as far as the constraints let it, so a check of what comes back
(tests/test_json_spacing.py, benchmarks/tool_call_fidelity.py) sees any token a grammar or a parser bent.

`script_positions` keys the script by position instead (the logits at position p choose the script's token
p - first): a forward of several positions, some of them drafted tokens that are then rejected, still chooses the
scripted answer (benchmarks/speculative.py); there the wrapped model's own head runs too, so every forward costs
what the real one does, and only the choice of token is the script's."""

from __future__ import annotations

import numpy as np

from ..runtime.backends.interface import logits_at

SCRIPTED_LOGIT = 10.0  # the scripted token's logit; every other token's is 0


class ScriptedHead:
    def __init__(self, model):
        self.model, self.answer, self.made = model, [0], 0
        self.first: int | None = None  # script_positions: the position whose logits choose the answer's first token

    def __getattr__(self, name):
        return getattr(self.model, name)

    @property
    def exact_positions(self) -> bool:
        """Drafted tokens may be checked only where the script is by position: by row, a forward of several
        positions would take several of its rows at once."""
        return self.first is not None and getattr(self.model, "exact_positions", False)

    def script(self, ids: list[int]) -> None:
        """The answer's token ids, from the first generated one (after the prompt and any forced start)."""
        self.answer, self.made, self.first = list(ids) or [0], 0, None

    def script_positions(self, ids: list[int], prompt_length: int) -> None:
        """The answer's token ids, the first chosen by the logits at the prompt's last position."""
        self.answer, self.first = list(ids) or [0], prompt_length - 1

    def forward_logits(self, token_ids, positions, valid, view, last) -> np.ndarray:
        """The wrapped model's forward, then the scripted logits at each row's position `last` (every position
        where last is None)."""
        hidden = self.model.forward(token_ids, positions, valid, view)
        if self.first is None:
            return logits_at(self.logits, hidden, last)
        real = logits_at(self.model.logits, hidden, last)  # the head's cost, then its choice replaced
        at = positions if last is None else positions[np.arange(len(positions)), last][:, None]
        chosen = np.asarray(self.answer)[np.clip(at - self.first, 0, len(self.answer) - 1)]
        out = np.zeros(real.shape, np.float32)
        np.put_along_axis(out.reshape(*chosen.shape, -1), chosen[..., None], SCRIPTED_LOGIT, axis=-1)
        return out

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [..., m] -> logits [..., vocab]: one row per scripted token in turn (the last one repeats)."""
        rows = int(np.prod(hidden.shape[:-1]))
        out = np.zeros((rows, self.model.config.vocab_size), np.float32)
        for row in range(rows):
            out[row, self.answer[min(self.made, len(self.answer) - 1)]] = SCRIPTED_LOGIT
            self.made += 1
        return out.reshape(*hidden.shape[:-1], -1)
