"""A checkpoint whose greedy decoding follows a script: after token a comes token b, as the test chooses.

Every decoder layer's output projections are zero, so the hidden state at a position is its
token's embedding. Each scripted token gets its own embedding axis (one-hot), the final norm is
one, and the head maps that axis to the token that must follow and to nothing else; so the
logits at a scripted token put all their weight on its successor, whatever came before it.
"""

import json
from pathlib import Path

import numpy as np

from k2deploy.core.checkpoint.presets import SHARD_BYTES, preset_config
from k2deploy.core.checkpoint.safetensors_io import NUMPY_DTYPES, read_header
from k2deploy.core.checkpoint.synthetic import write_checkpoint

HEAD_WEIGHT = 4.0  # a successor's logit: 4 * sqrt(hidden) after the norm, against 0 for every other token


def write_scripted_checkpoint(out: Path, successors: dict[int, int], layers: int = 1) -> Path:
    """The tiny preset with `layers` decoder layers whose greedy decoding maps each key of `successors` to
    its value."""
    config = preset_config("tiny", layers=layers)
    if len(successors) > config.hidden_size:
        raise ValueError(f"at most {config.hidden_size} scripted tokens, one embedding axis each")
    write_checkpoint(out, config, seed=0, shard_bytes=SHARD_BYTES["tiny"])
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]

    def rewrite(name: str, change) -> None:
        entry = read_header(out / weight_map[name])[name]
        with open(entry.shard, "r+b") as f:
            f.seek(entry.begin)
            values = np.frombuffer(f.read(entry.nbytes), dtype=NUMPY_DTYPES[entry.dtype]).reshape(entry.shape).copy()
            f.seek(entry.begin)
            f.write(np.ascontiguousarray(change(values)).tobytes())

    for name in weight_map:  # what each layer adds to the residual stream: nothing
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            rewrite(name, np.zeros_like)
    axes = {token: axis for axis, token in enumerate(successors)}

    def embed(values):
        for token, axis in axes.items():
            values[token] = 0
            values[token, axis] = 1
        return values

    def head(values):
        values[:, list(axes.values())] = 0
        for token, axis in axes.items():
            values[successors[token], axis] = HEAD_WEIGHT
        return values

    rewrite("model.embed_tokens.weight", embed)
    rewrite("model.norm.weight", np.ones_like)
    rewrite("lm_head.weight", head)
    return out


def script(ids: list[int]) -> dict[int, int]:
    """Successors that make greedy decoding after ids[0] produce ids[1:] (each id may lead only once)."""
    pairs = list(zip(ids, ids[1:]))
    sources = [a for a, _ in pairs]
    if len(set(sources)) != len(sources):
        raise ValueError(f"a scripted token leads twice: {ids}")
    return dict(pairs)
