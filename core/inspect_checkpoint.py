"""`k2deploy inspect` on a checkpoint directory: what it holds, counted from its tensor headers."""

from __future__ import annotations

from .checkpoint import layout
from .checkpoint.reader import Checkpoint
from .sizes import kv_cache_bytes_per_token


def describe_checkpoint(checkpoint: Checkpoint) -> dict:
    c = checkpoint.config
    entries = checkpoint.entries
    total = active = 0
    for spec in layout.all_tensors(c):
        count = spec.parameters
        if not count:
            continue
        total += count
        # a routed expert's weights are read by k of every E tokens
        active += count * c.num_experts_per_tok // c.n_routed_experts if layout.is_routed_expert(spec.name) else count
    per_layer = [
        {"layer": i, "kind": "moe" if c.is_moe_layer(i) else "dense", "bytes": checkpoint.layer_bytes(i)}
        for i in range(c.num_hidden_layers)
    ]
    return {
        "kind": "checkpoint",
        "path": str(checkpoint.root),
        "model_type": c.model_type,
        "config": {
            "layers": c.num_hidden_layers,
            "dense_layers": sum(1 for i in range(c.num_hidden_layers) if not c.is_moe_layer(i)),
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "attention": {
                "heads": c.num_attention_heads,
                "q_lora_rank": c.q_lora_rank,
                "kv_lora_rank": c.kv_lora_rank,
                "qk_nope_head_dim": c.qk_nope_head_dim,
                "qk_rope_head_dim": c.qk_rope_head_dim,
                "v_head_dim": c.v_head_dim,
            },
            "moe": {
                "routed_experts": c.n_routed_experts,
                "experts_per_token": c.num_experts_per_tok,
                "shared_experts": c.n_shared_experts,
                "expert_width": c.moe_intermediate_size,
                "n_group": c.n_group,
                "topk_group": c.topk_group,
                "routed_scaling_factor": c.routed_scaling_factor,
            },
            "weights": _weights_line(c),
            "rope_scaling": c.rope_scaling,
            "max_position_embeddings": c.max_position_embeddings,
        },
        "parameters": {"total": total, "active_per_token": active},
        "bytes": {
            "total": sum(e.nbytes for e in entries.values()),
            "shards": len(checkpoint.shards()),
            "embedding": entries["model.embed_tokens.weight"].nbytes,
            "head": sum(entries[s.name].nbytes for s in layout.head_tensors(c)),
            "per_layer": per_layer,
            "by_format": _bytes_by_format(c, entries),
        },
        "kv_cache_bytes_per_token_per_layer": kv_cache_bytes_per_token(c),
    }


def format_checkpoint(info: dict) -> str:
    cfg, params, sizes = info["config"], info["parameters"], info["bytes"]
    att, moe = cfg["attention"], cfg["moe"]
    lines = [
        f"checkpoint  {info['path']}  ({info['model_type']})",
        f"layers      {cfg['layers']} ({cfg['dense_layers']} dense, {cfg['layers'] - cfg['dense_layers']} MoE), "
        f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}",
        f"attention   MLA, {att['heads']} heads, q_lora {att['q_lora_rank']}, kv_lora {att['kv_lora_rank']}, "
        f"nope {att['qk_nope_head_dim']}, rope {att['qk_rope_head_dim']}, v {att['v_head_dim']}",
        f"experts     {moe['routed_experts']} routed, top-{moe['experts_per_token']}, {moe['shared_experts']} shared, "
        f"width {moe['expert_width']}, scale {moe['routed_scaling_factor']}",
        f"weights     {cfg['weights']}",
        f"parameters  {params['total']:,} total ({_short(params['total'])}), "
        f"{params['active_per_token']:,} active per token ({_short(params['active_per_token'])})",
        f"bytes       {sizes['total']:,} in {sizes['shards']} shards; embedding {sizes['embedding']:,}, head {sizes['head']:,}",
        "  by format " + ", ".join(f"{name} {value:,}" for name, value in sizes["by_format"].items()),
    ]
    by_kind: dict[str, list[int]] = {}
    for row in sizes["per_layer"]:
        by_kind.setdefault(row["kind"], []).append(row["bytes"])
    for kind, values in by_kind.items():
        lines.append(f"  {kind:<5} layer  {values[0]:,} bytes each x {len(values)}"
                     if len(set(values)) == 1 else f"  {kind:<5} layers {values}")
    lines.append("kv cache    bytes per token per layer: " + ", ".join(
        f"{name} {value:,}" for name, value in info["kv_cache_bytes_per_token_per_layer"].items()))
    return "\n".join(lines)


def _short(count: int) -> str:
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.2f} {suffix}"
    return str(count)


def _weights_line(c) -> str:
    """How the checkpoint stores its projections, in a few words."""
    if c.int4 is not None:
        return (f"int4 (compressed-tensors pack-quantized, groups of {c.int4.group}, bf16 scales) where not ignored; "
                f"the rest bf16")
    block = c.fp8_block
    return f"fp8 e4m3, {block[0]}x{block[1]} blocks" if block else "bf16"


def _bytes_by_format(c, entries) -> dict[str, int]:
    """Tensor bytes by storage format: int4 (codes, group scales and shapes), fp8 (codes and block scales), and
    the plain dtypes of the rest."""
    totals: dict[str, int] = {}
    for spec in layout.all_tensors(c):
        name = "int4" if spec.role.startswith("int4") else "fp8" if spec.dtype == layout.FP8 or spec.role == "scale" \
            else spec.dtype.lower()
        totals[name] = totals.get(name, 0) + entries[spec.name].nbytes
    return totals
