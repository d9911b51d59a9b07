"""`k2deploy plan`: which decoder layers go on which device, what each device then holds, and how fast
decode can be at best, all by formula from the config (no weights are read).

Per device (one pipeline stage):
  weights      its layers' tensors in the --weights format (core/held_weights.py; `stored`, the default but on CPU
               hosts, is as the checkpoint stores them: FP8 projections at one byte per value plus float32
               128x128 block scales, BF16 norms and router, float32 correction bias), plus the embedding on the
               first stage and the final norm and lm_head on the last
  cache        batch x context x its layers x the cache format's bytes per token per layer
  activations  batch x PREFILL_CHUNK x 4 bytes (float32) x (LIVE_HIDDEN_BUFFERS x hidden + the widest per-token
               intermediate of the model), plus batch x vocab float32 logits on the last stage. The widest
               intermediate is the largest of: gate and up of the dense MLP (2 x intermediate_size), gate and up
               of the chosen and shared experts (2 x moe_intermediate_size x (top-k + shared)), and the query
               latents of absorbed attention (heads x max(kv_lora_rank, qk_head_dim)); plus the attention's
               workspace: the runtime shrinks a prefill chunk as the context grows so that its float32 scores
               [rows, chunk x heads, keys] stay within sizes.ATTENTION_SCORES_BYTES, of which the attention holds
               sizes.LIVE_SCORE_TENSORS at once, whatever the context.
  capacity     USABLE_FRACTION of the device's memory (placement.USABLE_FRACTION)

Decode, bounded by memory bandwidth (core/bound.py's bytes per step, split by stage): one step of `batch`
sequences reads, on each stage, its layers' weights (dense tensors whole, routed experts the expected distinct
count E x (1 - (1 - k/E)^batch)), the embedding rows on the first stage, the whole head on the last, and its
cache at `context` tokens; the stage takes at least read bytes / bandwidth.
  decode_ms_per_token = sum over stages of the stage times: one step through every stage, one token for each
                        of the batch's sequences (the latency a sequence sees per token)
  tokens_per_s_in_turn = batch / decode_ms_per_token: the batch steps through the stages one after another (all a
                        batch too small to split can do: batch 1 never pipelines)
  tokens_per_s        = batch / the slowest stage's time: with micro-batches in flight every stage works at once,
                        and no split of the batch reads fewer bytes, so this bounds the pipeline's throughput
Between stages only the hidden state crosses: hidden x 4 bytes (float32) per token, batch x that per step.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import bound
from .cache_format import CacheFormat
from .config import ModelConfig
from .errors import K2Error
from .held_weights import ModelBytes
from .sizes import PREFILL_CHUNK, attention_workspace_bytes
from .placement import (USABLE_FRACTION, DeviceKind, Stage, auto_placement, check_fits, devices_needed,
                        format_bytes, format_placement, parse_devices, parse_placement)

LIVE_HIDDEN_BUFFERS = 4  # [batch, chunk, hidden] float32 at once: stage input, residual, normed input, sublayer out
FLOAT32 = 4


def widest_intermediate(config: ModelConfig) -> int:
    """The most float32 values per token one layer holds beside the hidden buffers (see the module doc)."""
    c = config
    widths = [c.num_attention_heads * max(c.kv_lora_rank, c.qk_head_dim)]
    if c.first_k_dense_replace > 0:
        widths.append(2 * c.intermediate_size)
    if c.first_k_dense_replace < c.num_hidden_layers:
        widths.append(2 * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts))
    return max(widths)


def activation_bytes(config: ModelConfig, batch: int, last: bool) -> int:
    """The activation estimate of one stage (see the module doc); the last stage also holds the logits."""
    hidden = batch * PREFILL_CHUNK * FLOAT32 * (LIVE_HIDDEN_BUFFERS * config.hidden_size + widest_intermediate(config))
    return hidden + attention_workspace_bytes() + (batch * config.vocab_size * FLOAT32 if last else 0)


@dataclass(frozen=True)
class Footprint:
    """What the model puts on its devices at one batch size, in bytes."""
    layer_weights: list[int]  # per decoder layer, in the plan's weights format
    embedding: int  # weights of the first stage's embedding
    head: int  # weights of the last stage's final norm and lm_head
    cache_per_token: int  # one token in one layer's cache (the format's bytes_per_token_per_layer)
    batch: int  # sequences whose caches a device holds
    activations: int  # every stage's activation estimate but the last's logits
    logits: int  # the last stage's logits on top

    @classmethod
    def of(cls, config: ModelConfig, batch: int, cache_format: str, held: ModelBytes) -> Footprint:
        base = activation_bytes(config, batch, last=False)
        return cls([layer.total for layer in held.layers], held.embedding, held.head,
                   CacheFormat.for_config(config, cache_format).bytes_per_token_per_layer, batch, base,
                   activation_bytes(config, batch, last=True) - base)

    def cache_bytes(self, context: int, layers: int) -> int:
        """batch x context x layers x bytes per token per layer."""
        return self.batch * context * layers * self.cache_per_token

    def layer_bytes(self, context: int) -> list[int]:
        """Each layer's weights and cache at `context` tokens."""
        return [w + self.cache_bytes(context, 1) for w in self.layer_weights]

    def place(self, context: int, count: int, hosts: int, capacity: int, cpu: bool = False) -> list[Stage]:
        """The balanced placement on `count` devices (CPU hosts where `cpu`) that each hold `capacity` bytes."""
        return auto_placement(self.layer_bytes(context), self.embedding, self.head + self.logits, count, hosts,
                              capacity - self.activations, cpu)

    def largest_context(self, below: int, count: int, capacity: int) -> int | None:
        """The longest context under `below` at which some placement on `count` devices fits, None if none does."""
        def fits(context: int) -> bool:
            sizes = self.layer_bytes(context)
            sizes[0] += self.embedding
            sizes[-1] += self.head + self.logits
            needed = devices_needed(sizes, capacity - self.activations)
            return needed is not None and needed <= count <= len(sizes)

        low, high = 0, below - 1
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low if low and fits(low) else None


def check_workload(config: ModelConfig, devices_text: str, hosts: int, context: int | None,
                   batch: int) -> tuple[DeviceKind, int, int]:
    """(device kind, device count, context) from a plan's arguments; context None: the model's
    max_position_embeddings. A K2Error naming the first argument out of range."""
    context = config.max_position_embeddings if context is None else context
    if batch < 1:
        raise K2Error(f"--batch must be at least 1, got {batch}")
    if not 1 <= context <= config.max_position_embeddings:
        raise K2Error(f"--context {context}: choose 1 to the model's {config.max_position_embeddings} positions")
    if hosts < 1:
        raise K2Error(f"--hosts must be at least 1, got {hosts}")
    kind, count = parse_devices(devices_text)
    if count % hosts:
        raise K2Error(f"--devices {devices_text} --hosts {hosts}: {count} devices do not split evenly over "
                      f"{hosts} hosts")
    return kind, count, context


def plan(config: ModelConfig, devices_text: str, hosts: int = 1, context: int | None = None, batch: int = 1,
         cache_format: str = "fp8", placement: str | None = None, weights: str | None = None) -> dict:
    """The plan as a JSON-ready dict (see the module doc); context None: the model's max_position_embeddings;
    weights None: the device kind's default (int8 on a CPU host, else as stored).
    A K2Error when the arguments are wrong or the model does not fit, saying what would."""
    kind, count, context = check_workload(config, devices_text, hosts, context, batch)
    held = ModelBytes.of(config, weights or kind.default_weights, cache_format)
    footprint = Footprint.of(config, batch, cache_format, held)
    capacity = kind.usable_bytes

    def shorter_context() -> str:
        fits = footprint.largest_context(context, count, capacity)
        return f"; at --context {fits} it fits on {count} x {kind.name}" if fits else ""

    if placement is None:
        try:
            stages = footprint.place(context, count, hosts, capacity, kind.cpu)
        except K2Error as exc:
            raise K2Error(f"--devices {devices_text}: {exc}{shorter_context()}") from None
    else:
        stages = parse_placement(placement, config.num_hidden_layers)
        _check_devices(stages, placement, devices_text, kind, count, hosts)

    rows = []
    step = bound.decode_step_bytes(config, footprint.cache_per_token, batch, context, held)
    for index, s in enumerate(stages):
        weights = sum(footprint.layer_weights[s.start:s.stop]) + footprint.embedding * s.first + footprint.head * s.last
        cache = footprint.cache_bytes(context, s.layers)
        activations = footprint.activations + footprint.logits * s.last
        total = weights + cache + activations
        read = sum(step["layers"][s.start:s.stop]) + step["embedding"] * s.first + step["head"] * s.last + cache
        rows.append({"stage": index, "device": s.device, "host": s.host, "layers": [s.start, s.stop],
                     "weights_bytes": weights, "cache_bytes": cache, "activation_bytes": activations,
                     "total_bytes": total, "capacity_bytes": capacity, "free_bytes": capacity - total,
                     "decode_read_bytes": round(read), "decode_ms": 1e3 * read / kind.bandwidth_bytes_per_s})
    if placement is not None:
        try:
            check_fits(stages, [r["total_bytes"] for r in rows], capacity)
        except K2Error as exc:
            try:
                fitting = footprint.place(context, count, hosts, capacity, kind.cpu)
                hint = f"; --placement {format_placement(fitting)} fits"
            except K2Error as no_fit:
                hint = f"; no placement on these devices fits: {no_fit}{shorter_context()}"
            raise K2Error(f"{exc}{hint}") from None

    hidden_bytes = config.hidden_size * FLOAT32
    boundaries = [{"at_layer": b.start, "from": a.name, "to": b.name, "crosses_hosts": a.host != b.host,
                   "bytes_per_token": hidden_bytes, "bytes_per_step": batch * hidden_bytes}
                  for a, b in zip(stages, stages[1:])]
    stage_ms = [r["decode_ms"] for r in rows]
    return {
        "parallel": "pp",
        "model": {"model_type": config.model_type, "layers": config.num_hidden_layers,
                  "hidden_size": config.hidden_size},
        "devices": {"kind": kind.name, "count": count, "hosts": hosts, "memory_bytes": kind.memory_bytes,
                    "usable_fraction": USABLE_FRACTION, "capacity_bytes": capacity,
                    "bandwidth_bytes_per_s": kind.bandwidth_bytes_per_s},
        "batch": batch,
        "context": context,
        "kv_cache": {"format": cache_format, "bytes_per_token_per_layer": footprint.cache_per_token},
        "weights": {"format": held.weights, "bytes": held.total},
        "activation_estimate": {"prefill_chunk": PREFILL_CHUNK, "live_hidden_buffers": LIVE_HIDDEN_BUFFERS,
                                "attention_workspace_bytes": attention_workspace_bytes(),
                                "widest_intermediate": widest_intermediate(config), "logits_bytes": footprint.logits},
        "placement": {"text": format_placement(stages),
                      "stages": [{"layers": [s.start, s.stop], "device": s.device, "host": s.host,
                                  "first": s.first, "last": s.last} for s in stages]},
        "per_device": rows,
        "totals": {key: sum(r[key] for r in rows)
                   for key in ("weights_bytes", "cache_bytes", "activation_bytes", "total_bytes", "capacity_bytes")},
        "decode_read_bytes_per_step": round(step["total"]),
        "experts_read_per_moe_layer": step["experts_per_moe_layer"],
        "decode_ms_per_token": sum(stage_ms),
        "tokens_per_s": batch / (max(stage_ms) / 1e3),
        "tokens_per_s_in_turn": batch / (sum(stage_ms) / 1e3),
        "boundaries": boundaries,
        "boundary_bytes_per_token": hidden_bytes,
        "host_link_bytes_per_token": hidden_bytes * sum(b["crosses_hosts"] for b in boundaries),
    }


def _check_devices(stages: list[Stage], text: str, devices_text: str, kind: DeviceKind, count: int,
                   hosts: int) -> None:
    """An explicit placement names only devices that --devices and --hosts describe."""
    per_host = count // hosts
    if len(stages) > count:
        raise K2Error(f"--placement {text}: {len(stages)} stages, but --devices {devices_text} has {count} devices")
    for s in stages:
        if kind.cpu and s.device != "cpu":
            raise K2Error(f"--placement {text}: {s.name} is a GPU, but --devices {devices_text} are CPU hosts; "
                          f"place the layers on cpu (hN/cpu for host N)")
        if s.host >= hosts:
            raise K2Error(f"--placement {text}: {s.name} is on host {s.host}, but --hosts {hosts} gives hosts "
                          f"h0 to h{hosts - 1}")
        if s.device.startswith("cuda:") and int(s.device[5:]) >= per_host:
            raise K2Error(f"--placement {text}: {s.name} is not one of the {per_host} {kind.name} per host "
                          f"(cuda:0 to cuda:{per_host - 1})")


def format_plan(info: dict) -> str:
    """The plan as a table: one row per device, then totals, the decode bound and the boundaries."""
    dev, kv = info["devices"], info["kv_cache"]
    lines = [
        f"devices     {dev['count']} x {dev['kind']} on {dev['hosts']} host{'s' * (dev['hosts'] > 1)}: "
        f"{format_bytes(dev['memory_bytes'])} each, {format_bytes(dev['capacity_bytes'])} usable "
        f"({dev['usable_fraction']:g}), {format_bytes(dev['bandwidth_bytes_per_s'])}/s",
        f"workload    batch {info['batch']}, context {info['context']}, {kv['format']} cache "
        f"({kv['bytes_per_token_per_layer']} bytes per token per layer), {info['model']['layers']} layers, "
        f"weights {info['weights']['format']} ({format_bytes(info['weights']['bytes'])})",
        f"placement   {info['placement']['text']}",
        "",
        f"{'stage':>5}  {'device':<11} {'layers':<7} {'weights':>10} {'cache':>10} {'activ.':>10} {'total':>10} "
        f"{'free':>10} {'read/step':>10} {'ms/step':>8}",
    ]
    for r in info["per_device"]:
        name, layers = f"h{r['host']}/{r['device']}", "{}:{}".format(*r["layers"])
        lines.append(f"{r['stage']:>5}  {name:<11} {layers:<7} "
                     + " ".join(f"{format_bytes(r[k]):>10}" for k in ("weights_bytes", "cache_bytes",
                                                                     "activation_bytes", "total_bytes", "free_bytes"))
                     + f" {format_bytes(r['decode_read_bytes']):>10} {r['decode_ms']:>8.3f}")
    t = info["totals"]
    lines += [
        f"{'all':>5}  {'':<11} {'':<7} "
        + " ".join(f"{format_bytes(t[k]):>10}" for k in ("weights_bytes", "cache_bytes", "activation_bytes",
                                                         "total_bytes"))
        + f" {format_bytes(t['capacity_bytes'] - t['total_bytes']):>10} "
          f"{format_bytes(info['decode_read_bytes_per_step']):>10} {info['decode_ms_per_token']:>8.3f}",
        "",
        f"decode      at least {info['decode_ms_per_token']:.2f} ms per token per sequence (the stages one after "
        f"another, {info['experts_read_per_moe_layer']:.1f} experts read per MoE layer)",
        _throughput_line(info, len(info["placement"]["stages"])),
    ]
    crossing = [b for b in info["boundaries"] if b["crosses_hosts"]]
    if info["boundaries"]:
        lines.append(f"boundaries  {len(info['boundaries'])}, each {info['boundary_bytes_per_token']:,} bytes per "
                     f"token (float32 hidden), {info['batch'] * info['boundary_bytes_per_token']:,} per step; "
                     f"{len(crossing)} between hosts ({info['host_link_bytes_per_token']:,} bytes per token over "
                     f"host links)")
    lines += [f"            {b['from']} -> {b['to']} before layer {b['at_layer']}" for b in crossing]
    return "\n".join(lines)


def _throughput_line(info: dict, stages: int) -> str:
    in_turn = f"            at most {info['tokens_per_s_in_turn']:,.0f} tokens/s"
    if stages == 1:
        return in_turn
    if info["batch"] < stages:
        return (f"{in_turn} (the batch steps through the {stages} stages in turn; pipelining needs at least {stages} "
                f"sequences in flight: plan --batch {stages} for that bound)")
    return (f"{in_turn} stepping the batch through the stages in turn; at most {info['tokens_per_s']:,.0f} tokens/s "
            f"pipelined ({stages} micro-batches in flight)")
