"""Pipeline placements: contiguous ranges of decoder layers, one range per device.

Only the hidden state [b, s, hidden] crosses from one stage to the next; the embedding lives with the
first stage, the final norm and lm_head with the last. A placement is written as text, one
`START:STOP@DEVICE` per stage, comma-separated, layers [START, STOP):

    0:31@cuda:0,31:61@cuda:1          two GPUs of one host
    0:16@h0/cuda:0,16:61@h1/cuda:0    a `hN/` prefix puts the device on host N (0-based; default h0)
    0:3@cpu

This module parses, writes, makes and checks placements from byte counts alone (no torch, no numpy).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import K2Error

# The share of a device's memory a plan fills: the rest is left to the CUDA context, the kernels'
# workspaces and the allocator's fragmentation (vLLM's default gpu_memory_utilization is also 0.9).
USABLE_FRACTION = 0.9


@dataclass(frozen=True)
class Stage:
    start: int  # first decoder layer held
    stop: int  # one past the last decoder layer held
    device: str  # "cpu" or "cuda:N", local to its host
    host: int  # which host (0-based) the device is on
    first: bool  # holds the embedding
    last: bool  # holds the final norm and lm_head

    @property
    def layers(self) -> int:
        return self.stop - self.start

    @property
    def name(self) -> str:
        """The device with its host, e.g. h1/cuda:0."""
        return f"h{self.host}/{self.device}"


@dataclass(frozen=True)
class DeviceKind:
    name: str
    memory_bytes: int  # as the vendor states it, decimal
    bandwidth_bytes_per_s: float  # peak memory bandwidth, as the vendor states it
    link_bytes_per_s: float | None = None  # device to device in one host, one direction (None: not known)
    cpu: bool = False  # a CPU host: its RAM and memory bandwidth; weights default to the cpu target's int8

    @property
    def usable_bytes(self) -> int:
        """What a plan may fill: USABLE_FRACTION of the memory."""
        return int(self.memory_bytes * USABLE_FRACTION)

    @property
    def default_weights(self) -> str:
        """The --weights format a plan assumes: what the cpu target lowers to on a CPU host, else as stored."""
        return "int8" if self.cpu else "stored"


GB = 10**9
TB = 10**12

# link: the vendor's device-to-device bandwidth inside one host, halved to one direction
DEVICES = {
    # NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s; NVLink 900 GB/s
    "H200": DeviceKind("H200", 141 * GB, 4.8 * TB, 450 * GB),
    # NVIDIA H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s; NVLink 900 GB/s
    "H100": DeviceKind("H100", 80 * GB, 3.35 * TB, 450 * GB),
    # NVIDIA HGX B200: 180 GB HBM3e, 8 TB/s per GPU; NVLink 1.8 TB/s
    "B200": DeviceKind("B200", 180 * GB, 8.0 * TB, 900 * GB),
    # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s; NVLink 600 GB/s
    "A100": DeviceKind("A100", 80 * GB, 2.039 * TB, 300 * GB),
    # AMD Instinct MI300X: 192 GB HBM3, 5.3 TB/s; Infinity Fabric 896 GB/s (7 links of 128 GB/s)
    "MI300X": DeviceKind("MI300X", 192 * GB, 5.3 * TB, 448 * GB),
    # NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s; no NVLink: PCIe Gen4 x16, 64 GB/s
    "L40S": DeviceKind("L40S", 48 * GB, 0.864 * TB, 32 * GB),
}

_ITEM = re.compile(r"^(\d+):(\d+)@(?:h(\d+)/)?(cpu|cuda:\d+)$")
_DEVICES = re.compile(r"^(\d+)x(.+)$", re.IGNORECASE)
_SIZE = r"(\d+(?:\.\d+)?)(GB|TB)"
_CUSTOM = re.compile(rf"^{_SIZE}@{_SIZE}/s$", re.IGNORECASE)
_CPU = re.compile(rf"^CPU(?::{_SIZE})?(?:@{_SIZE}/s)?$", re.IGNORECASE)
_BANDWIDTH = re.compile(rf"^{_SIZE}/s$", re.IGNORECASE)


def _decimal(number: str, unit: str) -> float:
    return float(number) * (TB if unit.upper() == "TB" else GB)


def parse_bandwidth(text: str, option: str) -> float:
    """`450GB/s` or `0.4TB/s` -> bytes per second (decimal units); a K2Error naming `option` otherwise."""
    match = _BANDWIDTH.match(text.strip())
    if not match or _decimal(match[1], match[2]) <= 0:
        raise K2Error(f"{option} {text}: expected a bandwidth such as 450GB/s or 0.4TB/s")
    return _decimal(match[1], match[2])


def format_bytes(count: float) -> str:
    """Decimal units, as device memory is sold: 1.03 TB, 126.90 GB, 4.2 MB."""
    for size, unit in ((TB, "TB"), (GB, "GB"), (10**6, "MB"), (10**3, "kB")):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count:.0f} B"


def parse_placement(text: str, num_layers: int) -> list[Stage]:
    """Stages in layer order; a K2Error naming the first problem: a malformed item, an empty or out-of-range
    range, layers on no device or on two, a GPU given two ranges (a host's cpu may run several stages, each its
    own process or Ray actor)."""
    where = f"--placement {text}"
    ranges = []
    for item in text.split(","):
        match = _ITEM.match(item.strip())
        if not match:
            raise K2Error(f"{where}: {item.strip()!r} is not START:STOP@DEVICE with DEVICE cpu or cuda:N "
                          f"(optionally hN/cuda:N for host N), e.g. 0:31@cuda:0,31:61@cuda:1")
        start, stop, host, device = int(match[1]), int(match[2]), int(match[3] or 0), match[4]
        if start >= stop:
            raise K2Error(f"{where}: {start}:{stop} holds no layers; a range is START:STOP with START < STOP")
        if stop > num_layers:
            raise K2Error(f"{where}: {start}:{stop} goes past the model's {num_layers} layers (0:{num_layers})")
        ranges.append((start, stop, host, device))
    ranges.sort()
    seen: dict[tuple[int, str], tuple[int, int]] = {}
    for start, stop, host, device in ranges:
        if (host, device) in seen and device != "cpu":
            a, b = seen[(host, device)]
            raise K2Error(f"{where}: h{host}/{device} holds both {a}:{b} and {start}:{stop}; "
                          f"a device holds one contiguous range")
        seen[(host, device)] = (start, stop)
    reached = 0
    for start, stop, host, device in ranges:
        if start > reached:
            raise K2Error(f"{where}: layers {reached}:{start} are on no device")
        if start < reached:
            raise K2Error(f"{where}: layers {start}:{min(reached, stop)} are on two devices")
        reached = stop
    if reached < num_layers:
        raise K2Error(f"{where}: layers {reached}:{num_layers} are on no device")
    return [Stage(start, stop, device, host, start == 0, stop == num_layers) for start, stop, host, device in ranges]


def format_placement(stages: list[Stage]) -> str:
    """The text parse_placement reads; host prefixes only when some stage is off host 0."""
    hosts = any(s.host for s in stages)
    return ",".join(f"{s.start}:{s.stop}@{f'h{s.host}/' if hosts else ''}{s.device}" for s in stages)


def parse_devices(text: str) -> tuple[DeviceKind, int]:
    """`16xH200` -> (H200, 16); a kind is a catalogue name (any case), MEMORY@BANDWIDTH (e.g. 512GB@0.2TB/s), or
    a CPU host CPU:MEMORY@BANDWIDTH (e.g. CPU:768GB@0.3TB/s: its RAM and memory bandwidth; both required, since
    plan does not measure this host: a bandwidth measured on a shared machine is no figure to plan by)."""
    match = _DEVICES.match(text.strip())
    kind = None
    if match:
        name = match[2]
        kind = next((k for key, k in DEVICES.items() if key.lower() == name.lower()), None)
        custom, cpu = _CUSTOM.match(name), _CPU.match(name)
        if custom:
            kind = DeviceKind(name, int(_decimal(custom[1], custom[2])), _decimal(custom[3], custom[4]))
        if cpu:
            if cpu[1] is None or cpu[3] is None:
                raise K2Error(f"--devices {text}: give the CPU host's memory and its memory bandwidth, e.g. "
                              f"1xCPU:768GB@0.3TB/s (plan does not measure them: a bandwidth measured on a busy "
                              f"host is not reliable; STREAM triad, or channels x MT/s x 8 bytes from the "
                              f"platform's specification)")
            kind = DeviceKind(name, int(_decimal(cpu[1], cpu[2])), _decimal(cpu[3], cpu[4]), cpu=True)
    if kind is None or int(match[1]) < 1 or kind.memory_bytes <= 0 or kind.bandwidth_bytes_per_s <= 0:
        raise K2Error(f"--devices {text}: expected COUNTxKIND with KIND one of {', '.join(DEVICES)}, "
                      f"MEMORY@BANDWIDTH or CPU:MEMORY@BANDWIDTH (e.g. 16xH200, 1x512GB@0.2TB/s, "
                      f"1xCPU:768GB@0.3TB/s)")
    return kind, int(match[1])


def devices_needed(sizes: list[int], capacity: int) -> int | None:
    """The fewest contiguous stages of at most `capacity` bytes that hold `sizes` in order (filling each
    stage before the next is optimal for contiguous ranges); None when one size alone exceeds it."""
    if max(sizes) > capacity:
        return None
    count, load = 1, 0
    for size in sizes:
        if load + size > capacity:
            count, load = count + 1, 0
        load += size
    return count


def auto_placement(layer_bytes: list[int], first_extra: int, last_extra: int, count: int, hosts: int,
                   capacity: int, cpu: bool = False) -> list[Stage]:
    """`count` contiguous stages, one per device, that balance their bytes: the largest stage as small as it
    can be, then the stages as even as they can be under it (least sum of squares). layer_bytes[i] is all
    layer i puts on its device (weights and its cache); the first stage adds first_extra, the last last_extra;
    `capacity` is what one device may hold. Devices 0..count/hosts-1 are cuda:0.. of host 0, and so on (`cpu`:
    each device is a host's cpu)."""
    n = len(layer_bytes)
    if count < 1 or hosts < 1 or count % hosts:
        raise K2Error(f"--hosts {hosts}: {count} devices do not split evenly over {hosts} hosts")
    if count > n:
        raise K2Error(f"{count} devices for {n} layers: a stage holds at least one layer; use at most {n} devices")
    sizes = list(layer_bytes)
    sizes[0] += first_extra
    sizes[-1] += last_extra
    total = sum(sizes)
    needed = devices_needed(sizes, capacity)
    if needed is None:
        i = sizes.index(max(sizes))
        extra = " with the embedding" * (i == 0) + " with the head" * (i == n - 1)
        raise K2Error(f"layer {i}{extra} alone needs {format_bytes(sizes[i])} of weights and cache, more than the "
                      f"{format_bytes(capacity)} one device may hold; use a device with more memory")
    if needed > count:
        held = f"{count} devices hold" if count > 1 else "1 device holds"
        raise K2Error(f"needs {format_bytes(total)} of weights and cache, {held} {format_bytes(count * capacity)} "
                      f"for them; with whole layers on each it takes at least {needed} such devices")
    bounds = _balanced_bounds(sizes, count)
    per_host = count // hosts
    return [Stage(a, b, "cpu" if cpu else f"cuda:{i % per_host}", i // per_host, a == 0, b == n)
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def _balanced_bounds(sizes: list[int], count: int) -> list[int]:
    """Stage boundaries [0, b1, ..., n] splitting `sizes` into `count` non-empty ranges: the least largest range,
    then the least sum of squares among the splits that keep it (two dynamic programmes over prefix sums)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def best(cost, combine, allowed):
        # table[k][i]: the best cost of splitting sizes[:i] into k ranges; choice[k][i]: where the last begins
        table = [[math.inf] * (n + 1) for _ in range(count + 1)]
        choice = [[0] * (n + 1) for _ in range(count + 1)]
        table[0][0] = 0
        for k in range(1, count + 1):
            for i in range(k, n - (count - k) + 1):
                for j in range(k - 1, i):
                    part = prefix[i] - prefix[j]
                    if part <= allowed and table[k - 1][j] != math.inf:
                        value = combine(table[k - 1][j], cost(part))
                        if value < table[k][i]:
                            table[k][i], choice[k][i] = value, j
        return table, choice

    largest = best(lambda part: part, max, math.inf)[0][count][n]
    _, choice = best(lambda part: part * part, lambda a, b: a + b, largest)
    bounds = [n]
    for k in range(count, 0, -1):
        bounds.append(choice[k][bounds[-1]])
    return bounds[::-1]


def check_fits(stages: list[Stage], per_stage_bytes: list[int], capacity: int) -> None:
    """A K2Error naming the first stage whose bytes exceed `capacity` (what one device may hold)."""
    for i, (stage, need) in enumerate(zip(stages, per_stage_bytes)):
        if need > capacity:
            raise K2Error(f"stage {i} (layers {stage.start}:{stage.stop} on {stage.name}) needs {format_bytes(need)}, "
                          f"more than the {format_bytes(capacity)} its device may hold; it must shed "
                          f"{format_bytes(need - capacity)}: move layers to another stage or lower --context or "
                          f"--batch")
