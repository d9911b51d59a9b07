"""A model whose answer is chosen in advance: the n-th logits row it makes (since `script` was last called) puts all
its weight on the script's n-th token; everything else (the cache, the layers' forwards) is the wrapped model's.
Greedy decoding then follows the script exactly as far as the constraints let it, so a check of what comes back
(tests/test_json_spacing.py, benchmarks/tool_call_fidelity.py) sees any token a grammar or a parser bent."""

from __future__ import annotations

import numpy as np

from ..runtime.backends.interface import logits_at

SCRIPTED_LOGIT = 10.0  # the scripted token's logit; every other token's is 0


class ScriptedHead:
    def __init__(self, model):
        self.model, self.answer, self.made = model, [0], 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def script(self, ids: list[int]) -> None:
        """The answer's token ids, from the first generated one (after the prompt and any forced start)."""
        self.answer, self.made = list(ids) or [0], 0

    def forward_logits(self, token_ids, positions, valid, view, last) -> np.ndarray:
        """The wrapped model's forward, then the scripted logits at each row's position `last`."""
        return logits_at(self.logits, self.model.forward(token_ids, positions, valid, view), last)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [..., m] -> logits [..., vocab]: one row per scripted token in turn (the last one repeats)."""
        rows = int(np.prod(hidden.shape[:-1]))
        out = np.zeros((rows, self.model.config.vocab_size), np.float32)
        for row in range(rows):
            out[row, self.answer[min(self.made, len(self.answer) - 1)]] = SCRIPTED_LOGIT
            self.made += 1
        return out.reshape(*hidden.shape[:-1], -1)
