"""Fills the reference modules from a checkpoint, one layer at a time, dequantised to float32."""

from __future__ import annotations

import numpy as np
import torch

from ..core.checkpoint.reader import Checkpoint
from .model import Block, MoE, Transformer

STACKED_EXPERTS = {"experts_gate_proj": "gate_proj", "experts_up_proj": "up_proj", "experts_down_proj": "down_proj"}


def _tensor(checkpoint: Checkpoint, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(checkpoint.float32(name)))


def fill_block(block: Block, checkpoint: Checkpoint, layer: int) -> Block:
    prefix = f"model.layers.{layer}."
    with torch.no_grad():
        for name, param in block.named_parameters():
            leaf = name.rpartition(".")[2]
            if isinstance(block.mlp, MoE) and leaf in STACKED_EXPERTS:
                for expert in range(param.shape[0]):
                    param[expert].copy_(_tensor(checkpoint, f"{prefix}mlp.experts.{expert}.{STACKED_EXPERTS[leaf]}.weight"))
            else:
                param.copy_(_tensor(checkpoint, prefix + name))
    return block


def load_transformer(checkpoint: Checkpoint, absorb: bool = False) -> Transformer:
    model = Transformer(checkpoint.config, absorb).eval()
    with torch.no_grad():
        model.embed_tokens.weight.copy_(_tensor(checkpoint, "model.embed_tokens.weight"))
        model.norm.weight.copy_(_tensor(checkpoint, "model.norm.weight"))
        model.lm_head.weight.copy_(_tensor(checkpoint, "lm_head.weight"))
    for layer, block in enumerate(model.layers):
        fill_block(block, checkpoint, layer)
    return model
