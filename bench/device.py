"""Names the machine a benchmark ran on, so that runs from machines of one type sort into one row.

GPU providers (cuda, tensorrt): the GPU's name and memory from `nvidia-smi`, e.g.
"NVIDIA H200, 140 GiB" -> slug "gpu-nvidia-h200-140gib". CPU: the CPU model from /proc/cpuinfo
(else the platform's), the cores this process may run on and the memory, e.g.
"AMD EPYC, 2 cores, 24 GiB" -> "cpu-amd-epyc-2c-24gib".

Memory is named by a nominal size, not the exact figure the kernel reports: MemTotal is the
installed memory less what the firmware and kernel keep, which differs a little between machines
of one type; rounding it up to a multiple of a quarter of its power of two (23.4 -> 24,
62.8 -> 64, 503 -> 512 GiB) gives them one name. The exact bytes are kept alongside.
"""

from __future__ import annotations

import math
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

from ..core.targets import GPU_PROVIDERS

GIB = 1 << 30


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name: /proc/cpuinfo's `model name` (x86) or `Hardware`/`Model` (Arm), else the platform's."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    for key in ("model name", "Hardware", "Model"):
        for line in cpuinfo.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return " ".join(value.split())
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_bytes(meminfo: str | None = None) -> int | None:
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            meminfo = ""
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    if match:
        return int(match.group(1)) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def nominal_gib(nbytes: int | None) -> int | None:
    """Installed-looking size in GiB: rounded up to a multiple of 2**(floor(log2 GiB) - 2), at least 1."""
    if not nbytes:
        return None
    gib = nbytes / GIB
    if gib <= 1:
        return 1
    step = 2 ** max(0, math.floor(math.log2(gib)) - 2)
    return int(math.ceil(gib / step - 1e-9) * step)


def gpus(nvidia_smi: str | None = None) -> list[dict]:
    """[{name, memory_bytes}] of the NVIDIA GPUs nvidia-smi sees; [] without nvidia-smi."""
    if nvidia_smi is None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return []
        try:
            nvidia_smi = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                                        capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return []
    found = []
    for line in nvidia_smi.strip().splitlines():
        name, _, mib = line.rpartition(",")
        try:
            found.append({"name": name.strip(), "memory_bytes": int(float(mib)) << 20})
        except ValueError:
            continue
    return found


def gpu_memory_used(pid: int | None = None) -> int | None:
    """Device memory this process holds on NVIDIA GPUs (nvidia-smi's per-process figure), or None."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    pid = os.getpid() if pid is None else pid
    try:
        out = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used = [int(float(mib)) << 20 for p, _, mib in (line.partition(",") for line in out.strip().splitlines())
            if p.strip() == str(pid) and mib.strip().replace(".", "", 1).isdigit()]
    return sum(used) if used else None


def slugify(text: str) -> str:
    """Lower-case letters, digits and single dashes: usable as a folder name everywhere."""
    text = re.sub(r"\((r|tm|c)\)", "", text.lower()).replace("+", " plus")
    text = re.sub(r"\b(cpu|processor)\b|@.*$", "", text)  # "... CPU @ 2.10GHz": the model is the rest
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "unknown"


def describe_device(provider: str = "cpu", *, cpuinfo: str | None = None, meminfo: str | None = None,
                    cores: int | None = None, nvidia_smi: str | None = None, gpu_name: str | None = None) -> dict:
    """The device of one run: {kind, label, slug, cpu: {...}, gpu: {...} | None}.

    The keyword arguments stand in for /proc/cpuinfo, /proc/meminfo, the affinity mask and
    nvidia-smi's output (tests); by default they are read from this machine. gpu_name, when the
    runtime knows it (the TensorRT backend asks CUDA), names the GPU where nvidia-smi does not.
    """
    cores = cpu_cores() if cores is None else cores
    memory = memory_bytes(meminfo)
    cpu = {"model": cpu_model(cpuinfo), "cores": cores, "memory_bytes": memory, "memory_gib": nominal_gib(memory),
           "machine": platform.machine()}
    cpu_label = f"{cpu['model']}, {cores} core{'s' * (cores != 1)}" + (f", {cpu['memory_gib']} GiB" if memory else "")
    cpu_slug = f"cpu-{slugify(cpu['model'])}-{cores}c" + (f"-{cpu['memory_gib']}gib" if memory else "")
    if provider not in GPU_PROVIDERS:
        return {"kind": "cpu", "label": cpu_label, "slug": cpu_slug, "cpu": cpu, "gpu": None}
    found = gpus(nvidia_smi)
    if not found and gpu_name:
        gpu = {"name": gpu_name, "memory_bytes": None, "memory_gib": None, "count": 1,
               "note": "named by CUDA; nvidia-smi did not answer, so its memory is not known"}
        return {"kind": "gpu", "label": gpu_name, "slug": f"gpu-{slugify(gpu_name)}", "cpu": cpu, "gpu": gpu}
    if not found:
        gpu = {"name": "unknown GPU", "memory_bytes": None, "memory_gib": None, "count": 0,
               "note": "nvidia-smi did not answer; the GPU is not named"}
        return {"kind": "gpu", "label": f"unknown GPU ({provider}) on {cpu_label}",
                "slug": f"gpu-unknown-{cpu_slug}", "cpu": cpu, "gpu": gpu}
    first = found[0]  # ONNX Runtime runs on device 0 unless told otherwise
    gib = round(first["memory_bytes"] / GIB)  # one GPU model has one memory size: no nominal rounding needed
    gpu = {"name": first["name"], "memory_bytes": first["memory_bytes"], "memory_gib": gib, "count": len(found)}
    return {"kind": "gpu", "label": f"{first['name']}, {gib} GiB", "slug": f"gpu-{slugify(first['name'])}-{gib}gib",
            "cpu": cpu, "gpu": gpu}
