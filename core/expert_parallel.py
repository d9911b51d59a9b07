"""`k2deploy plan --parallel ep`: expert parallelism, by formula from the config (no weights are read).

Placement on D devices over H hosts (P = D / H per host):
  expert shard  the routed experts of every MoE layer split evenly: a device holds s = ceil(E / D) of the E experts
                (where D does not divide E, the last D x s - E devices hold s - 1: a plan sizes every device for s)
  replicated    on every device: each layer's norms, attention, dense MLP (dense layers) or router, correction bias
                and shared experts (MoE layers), the embedding, the final norm and lm_head
  attention     data-parallel: a device runs the attention of its own sequences and holds their cache, so a batch of
                B puts b = ceil(B / D) sequences on the busiest device
Per device (the busiest), bytes:
  weights       replicated + s x (one routed expert's bytes) x MoE layers, in the --weights format
  cache         b x context x layers x the cache format's bytes per token per layer
  activations   plan.activation_bytes of b sequences, logits included, plus the all-to-all buffers:
                2 (dispatch and combine) x B x PREFILL_CHUNK x hidden x 4 (float32): any token of the batch may
                choose this device's experts
  capacity      USABLE_FRACTION of its memory
All-to-all per MoE layer: a token's hidden state goes to each other device that holds some of its k experts
(dispatch) and each one's weighted sum comes back (combine), hidden x 4 bytes (float32, as the pipeline's hop)
each way. The k experts are k distinct of the E, uniformly: device d holds none of them with probability
C(E - s_d, k) / C(E, k), so a token touches T = sum_d (1 - C(E - s_d, k) / C(E, k)) devices (its experts on one
device take one send), and its own device is any of the D alike:
  remote devices per token   T x (D - 1) / D, of them on other hosts T x (D - P) / D
  bytes per token            2 x hidden x 4 x T x (D - 1) / D per MoE layer,
                             of them leaving the host 2 x hidden x 4 x T x (D - P) / D
Decode, bounded by memory bandwidth and links: one step of B sequences, on the busiest device:
  reads          the replicated weights once (the embedding: b rows), the expected distinct experts of its shard
                 that the batch's B x k choices touch, s x (1 - (1 - k/E)^B) per MoE layer (core/bound.py), its cache
  all-to-all     per MoE layer b x max(bytes within the host / link, bytes leaving it / inter-host), link: one
                 device to another of its host, one direction; inter-host: one device's network link
  step           reads / memory bandwidth + MoE layers x the all-to-all time (no overlap of the two assumed)
  decode_ms_per_token = step (each sequence gets one token per step); tokens_per_s = B / step
Not counted: the links' latency (microseconds per all-to-all, 2 per MoE layer, which dominate at batch 1), and routing
imbalance beyond the mean (the busiest device of a layer may read more experts than its mean).
"""

from __future__ import annotations

import math

from . import bound
from .cache_format import CacheFormat
from .checkpoint.layout import BF16
from .config import ModelConfig
from .errors import K2Error
from .held_weights import DTYPE_BYTES, ModelBytes
from .placement import USABLE_FRACTION, DeviceKind, GB, format_bytes
from .plan import FLOAT32, activation_bytes, check_workload, plan
from .sizes import PREFILL_CHUNK

INTER_HOST_BYTES_PER_S = 50 * GB  # one 400 Gb/s network link per device (InfiniBand NDR / 400GbE): the default


def shards(experts: int, devices: int) -> list[int]:
    """Routed experts per device: ceil(E / D) on the first ones, one fewer on the last D x ceil(E / D) - E."""
    most = -(-experts // devices)
    fewer = devices * most - experts
    return [most] * (devices - fewer) + [most - 1] * fewer


def devices_touched(config: ModelConfig, devices: int) -> float:
    """T: the expected devices holding at least one of a token's k experts, sum_d (1 - C(E - s_d, k) / C(E, k))."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return sum(1 - math.comb(e - s, k) / math.comb(e, k) for s in shards(e, devices))


def all_to_all(config: ModelConfig, devices: int, hosts: int) -> dict:
    """A token's all-to-all per MoE layer (see the module doc): devices reached and bytes, within and across hosts."""
    touched, per_host = devices_touched(config, devices), devices // hosts
    hop = config.hidden_size * FLOAT32
    within, across = touched * (per_host - 1) / devices, touched * (devices - per_host) / devices
    return {"hidden_dtype": "float32", "bytes_per_hidden_value": FLOAT32, "devices_touched_per_token": touched,
            "remote_devices_per_token": within + across, "remote_devices_off_host_per_token": across,
            "bytes_per_token_per_moe_layer": 2 * hop * (within + across),
            "host_link_bytes_per_token_per_moe_layer": 2 * hop * across,
            "within_host_bytes_per_token_per_moe_layer": 2 * hop * within}


def _device_bytes(config: ModelConfig, held: ModelBytes, cache_per_token: int, devices: int, batch: int,
                  context: int) -> dict:
    """What the busiest of `devices` holds (see the module doc)."""
    moe = [layer for layer in held.layers if layer.experts]
    shard = shards(config.n_routed_experts, devices)[0]
    local = -(-batch // devices)
    replicated = held.embedding + held.head + sum(layer.fixed for layer in held.layers)
    experts = shard * sum(layer.expert for layer in moe)
    cache = local * context * config.num_hidden_layers * cache_per_token
    buffers = 2 * batch * PREFILL_CHUNK * config.hidden_size * FLOAT32
    activations = activation_bytes(config, local, last=True) + buffers
    total = replicated + experts + cache + activations
    return {"sequences": local, "experts_per_moe_layer": shard, "replicated_bytes": replicated,
            "expert_shard_bytes": experts, "weights_bytes": replicated + experts, "cache_bytes": cache,
            "activation_bytes": activations, "all_to_all_buffer_bytes": buffers, "total_bytes": total}


def expert_parallel(config: ModelConfig, devices_text: str, hosts: int = 1, context: int | None = None,
                    batch: int = 1, cache_format: str = "fp8", weights: str | None = None,
                    link: float | None = None, inter_host: float = INTER_HOST_BYTES_PER_S) -> dict:
    """The expert-parallel plan as a JSON-ready dict (see the module doc); link None: the device kind's own figure.
    A K2Error when the arguments are wrong or a device cannot hold its part, saying what would fit."""
    kind, count, context = check_workload(config, devices_text, hosts, context, batch)
    if config.first_k_dense_replace >= config.num_hidden_layers:
        raise K2Error("--parallel ep: this model has no MoE layers; use --parallel pp")
    held = ModelBytes.of(config, weights or kind.default_weights, cache_format)
    cache_per_token = CacheFormat.for_config(config, cache_format).bytes_per_token_per_layer
    capacity = kind.usable_bytes
    sizes = _device_bytes(config, held, cache_per_token, count, batch, context)
    if sizes["total_bytes"] > capacity:
        raise K2Error(_does_not_fit(config, held, cache_per_token, kind, count, sizes, batch, context)
                      + _pipeline_hint(config, devices_text, hosts, context, batch, cache_format, held.weights))
    link = link or kind.link_bytes_per_s
    traffic = all_to_all(config, count, hosts)
    if link is None and traffic["within_host_bytes_per_token_per_moe_layer"]:
        raise K2Error(f"--parallel ep on {count} x {kind.name}: give --link, the bandwidth from one device to "
                      f"another in a host (one direction), e.g. --link 450GB/s")

    moe_layers = sum(1 for layer in held.layers if layer.experts)
    local = sizes["sequences"]
    experts_read = bound.expected_shard_experts(config, batch, sizes["experts_per_moe_layer"])
    read = (sizes["replicated_bytes"] - held.embedding + local * config.hidden_size * DTYPE_BYTES[BF16]
            + experts_read * sum(layer.expert for layer in held.layers) + sizes["cache_bytes"])
    layer_seconds = local * max(traffic["within_host_bytes_per_token_per_moe_layer"] / (link or math.inf),
                                traffic["host_link_bytes_per_token_per_moe_layer"] / inter_host)
    read_ms, exchange_ms = 1e3 * read / kind.bandwidth_bytes_per_s, 1e3 * moe_layers * layer_seconds
    step_ms = read_ms + exchange_ms
    return {
        "parallel": "ep",
        "model": {"model_type": config.model_type, "layers": config.num_hidden_layers, "moe_layers": moe_layers,
                  "hidden_size": config.hidden_size, "routed_experts": config.n_routed_experts,
                  "experts_per_token": config.num_experts_per_tok},
        "devices": {"kind": kind.name, "count": count, "hosts": hosts, "memory_bytes": kind.memory_bytes,
                    "usable_fraction": USABLE_FRACTION, "capacity_bytes": capacity,
                    "bandwidth_bytes_per_s": kind.bandwidth_bytes_per_s, "link_bytes_per_s": link,
                    "inter_host_bytes_per_s": inter_host},
        "batch": batch,
        "context": context,
        "kv_cache": {"format": cache_format, "bytes_per_token_per_layer": cache_per_token},
        "weights": {"format": held.weights, "bytes": held.total},
        "experts": {"per_device": sizes["experts_per_moe_layer"],
                    "devices_with_one_fewer": count * sizes["experts_per_moe_layer"] - config.n_routed_experts,
                    "expert_bytes": sum(layer.expert for layer in held.layers) // moe_layers},
        "per_device": {**sizes, "capacity_bytes": capacity, "free_bytes": capacity - sizes["total_bytes"]},
        "all_to_all": {**traffic, "ms_per_moe_layer": 1e3 * layer_seconds, "ms_per_step": exchange_ms},
        "decode_read_bytes_per_step": round(read),
        "experts_read_per_moe_layer": experts_read,
        "decode_read_ms": read_ms,
        "decode_ms_per_token": step_ms,
        "tokens_per_s": batch / (step_ms / 1e3),
    }


def _does_not_fit(config: ModelConfig, held: ModelBytes, cache_per_token: int, kind: DeviceKind, count: int,
                  sizes: dict, batch: int, context: int) -> str:
    """Why the busiest device overflows, and the fewest such devices (or the memory per device) that would do."""
    capacity = kind.usable_bytes
    text = (f"--parallel ep on {count} x {kind.name}: each device needs {format_bytes(sizes['total_bytes'])} "
            f"(replicated {format_bytes(sizes['replicated_bytes'])}, {sizes['experts_per_moe_layer']} experts per "
            f"MoE layer {format_bytes(sizes['expert_shard_bytes'])}, cache of {_sequences(sizes['sequences'])} "
            f"{format_bytes(sizes['cache_bytes'])}, activations {format_bytes(sizes['activation_bytes'])}), more "
            f"than the {format_bytes(capacity)} one may hold")
    for more in range(count + 1, max(config.n_routed_experts, batch) + 1):
        if _device_bytes(config, held, cache_per_token, more, batch, context)["total_bytes"] <= capacity:
            return f"{text}; it fits on {more} x {kind.name}"
    least = _device_bytes(config, held, cache_per_token, max(config.n_routed_experts, batch), batch, context)
    return (f"{text}; the replicated part with one expert per MoE layer needs {format_bytes(least['total_bytes'])} "
            f"per device, so no count of {kind.name} holds it: devices of at least "
            f"{format_bytes(math.ceil(sizes['total_bytes'] / USABLE_FRACTION))} memory would hold this plan")


def _pipeline_hint(config: ModelConfig, devices_text: str, hosts: int, context: int, batch: int, cache_format: str,
                   weights: str) -> str:
    try:
        plan(config, devices_text, hosts, context, batch, cache_format, weights=weights)
    except K2Error:
        return ""
    return f"; --parallel pp fits on {devices_text}"


def _sequences(count: int) -> str:
    return f"{count} sequence{'s' * (count != 1)}"


def format_expert_parallel(info: dict) -> str:
    """The plan as text: the devices, what each holds, the all-to-all and the decode bound."""
    dev, kv, d, x, a = info["devices"], info["kv_cache"], info["per_device"], info["experts"], info["all_to_all"]
    link = format_bytes(dev["link_bytes_per_s"]) + "/s" if dev["link_bytes_per_s"] else "not given"
    fewer = f" ({x['devices_with_one_fewer']} devices hold one fewer)" if x["devices_with_one_fewer"] else ""
    lines = [
        f"devices     {dev['count']} x {dev['kind']} on {dev['hosts']} host{'s' * (dev['hosts'] > 1)}: "
        f"{format_bytes(dev['memory_bytes'])} each, {format_bytes(dev['capacity_bytes'])} usable "
        f"({dev['usable_fraction']:g}), {format_bytes(dev['bandwidth_bytes_per_s'])}/s; link {link} within a host, "
        f"{format_bytes(dev['inter_host_bytes_per_s'])}/s between hosts (assumed)",
        f"workload    batch {info['batch']}, context {info['context']}, {kv['format']} cache "
        f"({kv['bytes_per_token_per_layer']} bytes per token per layer), {info['model']['layers']} layers, "
        f"weights {info['weights']['format']} ({format_bytes(info['weights']['bytes'])})",
        f"placement   expert parallel: {x['per_device']} of {info['model']['routed_experts']} routed experts of each "
        f"of the {info['model']['moe_layers']} MoE layers per device{fewer}; attention, dense layer, shared experts, "
        f"routers, norms, embedding and head on every device; attention data-parallel: up to "
        f"{_sequences(d['sequences'])} per device, each with its cache",
        "",
        f"per device  replicated {format_bytes(d['replicated_bytes'])} + expert shard "
        f"{format_bytes(d['expert_shard_bytes'])} = weights {format_bytes(d['weights_bytes'])}, cache "
        f"{format_bytes(d['cache_bytes'])}, activations {format_bytes(d['activation_bytes'])}: "
        f"{format_bytes(d['total_bytes'])} of {format_bytes(d['capacity_bytes'])}, "
        f"{format_bytes(d['free_bytes'])} free",
        f"all-to-all  {a['bytes_per_token_per_moe_layer']:,.0f} bytes per token per MoE layer (float32 hidden "
        f"to {a['remote_devices_per_token']:.2f} remote devices and back, of {a['devices_touched_per_token']:.2f} "
        f"holding its {info['model']['experts_per_token']} experts); "
        f"{a['host_link_bytes_per_token_per_moe_layer']:,.0f} of them leave the host; {a['ms_per_moe_layer']:.4f} ms per MoE layer, {a['ms_per_step']:.3f} ms per step",
        f"decode      at least {info['decode_ms_per_token']:.2f} ms per token per sequence: reads "
        f"{format_bytes(info['decode_read_bytes_per_step'])} per step on the busiest device "
        f"({info['experts_read_per_moe_layer']:.2f} of its experts per MoE layer) in {info['decode_read_ms']:.2f} ms, "
        f"plus the all-to-all",
        f"            at most {info['tokens_per_s']:,.0f} tokens/s (batch {info['batch']} per step)",
    ]
    return "\n".join(lines)
