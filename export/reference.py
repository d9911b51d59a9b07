"""Prefill and decode with the eager reference over a latent cache (c_kv and k_pe per layer).

Rows of one batch share their length; rows of different lengths run as separate batches.
"""

from __future__ import annotations

import torch

from .model import Transformer


class LatentCache:
    """Per layer: latent [b, t, c] and rope [b, t, r], grown as tokens arrive."""

    def __init__(self, model: Transformer, batch: int):
        c = model.config
        self.latent = [torch.zeros(batch, 0, c.kv_lora_rank) for _ in model.layers]
        self.rope = [torch.zeros(batch, 0, c.qk_rope_head_dim) for _ in model.layers]

    @property
    def length(self) -> int:
        return self.latent[0].shape[1]


@torch.no_grad()
def forward(model: Transformer, tokens: torch.Tensor, cache: LatentCache) -> torch.Tensor:
    """tokens [b, s] following the cache's positions -> logits [b, s, vocab]; the cache grows by s."""
    b, s = tokens.shape
    start = cache.length
    positions = torch.arange(start, start + s).expand(b, s)
    keys = torch.arange(start + s)
    mask = (keys[None, :] <= positions[0][:, None]).expand(b, s, start + s)  # causal over cached + new
    x = model.embed_tokens(tokens)
    for i, block in enumerate(model.layers):
        x, new_latent, new_rope = block(x, positions, (cache.latent[i], cache.rope[i]), mask)
        cache.latent[i] = torch.cat([cache.latent[i], new_latent], dim=1)
        cache.rope[i] = torch.cat([cache.rope[i], new_rope], dim=1)
    return model.lm_head(model.norm(x))


def prompt_logits(model: Transformer, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] logits of every prompt position, from one prefill."""
    return forward(model, torch.tensor([prompt]), LatentCache(model, 1))[0]


def greedy(model: Transformer, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Prefill, then one token per decode step; returns the generated ids only."""
    cache = LatentCache(model, 1)
    logits = forward(model, torch.tensor([prompt]), cache)
    generated = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        generated.append(token)
        logits = forward(model, torch.tensor([[token]]), cache)
    return generated
