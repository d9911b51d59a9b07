"""The GPU path's first contact with a GPU: the plugin kernels and one real-size MoE layer, in one command.

    . .venv/bin/activate && python benchmarks/gpu_check.py --out gpu-check [--budget 280]
    python benchmarks/gpu_check.py --dry-run --out DIR     (no GPU: imports, shapes, launch plan)

Needs torch with CUDA, triton and cuda-python (cuda-bindings); no TensorRT. Writes DIR/gpu_check.json and
DIR/gpu_check.md, and prints the markdown. Three parts, each check recorded as passed, failed (with the
error) or skipped, so that one failure does not hide the rest:

1. kernels: every Triton kernel of the plugins, compiled and run on the GPU (MoeRoute, MoeExpertsUp and
   MoeExpertsDown over FP8 rows, MlaAttention, and the decode kernel over the FP8 latent cache), at the tiny
   preset's and Kimi K2's dimensions, against the eager op on the same GPU tensors (the interpreter tests'
   checks: identical expert ids, float32-rounding tolerances).
2. aot: each plugin's ahead-of-time PTX (plugins/tensorrt/aot.py), loaded with cuda-bindings and launched the
   way TensorRT launches an AOT plugin: input pointers, the int32 scalars, output pointers, then null for
   Triton's two scratch parameters, with the dynamic shared memory above 48 KB that the MLA kernel needs
   granted first; outputs against the eager op.
3. moe_layer: the product's own MoE decoder layer (export/graph_modules.py ExportLayer for the cuda target
   and the FP8 cache: the module the exporter traces into the shipped graph) at Kimi K2's size with random
   weights on the GPU (FP8 e4m3 with 128x128 block scales, 384 experts of width 2048, hidden 7168), one
   decode step timed (CUDA events, median) at batch 1, 8, 32 and context 128, 4096, 32768. Its custom ops run
   the Triton kernels of the TensorRT plugins (routing, the chosen experts, absorbed attention); the rest
   is the graph's own torch ops (FP8 weights dequantised, float32 matmuls). The shipped cuda / tensorrt graph
   widens the whole FP8 cache to float32 and concatenates it with the new entry every step before attention
   (it does not read the FP8 cache in place), and that is what is timed; the bound is the bytes the step
   must read (k2deploy.core.bound: FP8 weights at one byte, the cache at 656 bytes per token) over the
   device-to-device copy bandwidth measured in the same run.

--budget (seconds, default 280) bounds the run: timing cells that would start after it are skipped and
listed, so one command stays within five minutes on an H200.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

TINY = {"hidden": 192, "experts": 16, "top_k": 4, "width": 96, "heads": 4, "latent": 32, "rope": 16, "nope": 16,
        "v": 16, "block": 128, "softmax_scale": 0.25, "scaling": 2.5, "tokens": 5, "keys": 5}
K2 = {"hidden": 7168, "experts": 384, "top_k": 8, "width": 2048, "heads": 64, "latent": 512, "rope": 64, "nope": 128,
      "v": 128, "block": 128, "softmax_scale": 0.1309, "scaling": 2.827, "tokens": 8, "keys": 1000}
DIMS = {"tiny": TINY, "k2": K2}
BATCHES, CONTEXTS = (1, 8, 32), (128, 4096, 32768)
CACHE_BYTES_PER_TOKEN = 656  # Kimi K2's FP8 latent cache per layer: 512 e4m3 + 4 float32 scales + 64 float16
TIMED_STEPS, WARMUP_STEPS = 10, 3


class Report:
    def __init__(self, dry_run: bool, budget: float):
        self.started = time.perf_counter()
        self.budget = budget
        self.data = {"dry_run": dry_run, "checks": [], "moe_layer": [], "environment": {}, "notes": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def check(self, part: str, name: str, run) -> None:
        """Runs one check: run() returns a dict of figures or raises."""
        began = time.perf_counter()
        try:
            figures = run() or {}
            row = {"part": part, "name": name, "status": "passed", **figures}
        except Exception as error:  # one failure must not hide the rest of the run
            row = {"part": part, "name": name, "status": "failed", "error": f"{type(error).__name__}: {error}",
                   "where": traceback.format_exc(limit=-3).strip().splitlines()[-3:]}
        row["seconds"] = round(time.perf_counter() - began, 2)
        self.data["checks"].append(row)
        print(f"[{self.elapsed():6.1f}s] {part} {name}: {row['status']}"
              + (f" ({row['error']})" if row["status"] == "failed" else ""), file=sys.stderr, flush=True)


# -- the plan (no GPU) ------------------------------------------------------------------------------------

def launch_plan() -> dict:
    """Every plugin's AOT launch at both dimension sets, checked against TensorRT's calling convention."""
    from k2deploy.plugins.tensorrt import aot

    plan = {}
    for label, d in DIMS.items():
        for launch in aot_launches(d):
            aot.check_convention(launch)
            plan[f"{launch.plugin} {label}"] = {
                "kernel": launch.kernel.__name__, "signature": list(launch.signature.values()),
                "grid": list(launch.grid), "scalars": list(launch.scalars), "options": launch.options}
    return plan


def aot_launches(d: dict) -> list:
    from k2deploy.plugins.tensorrt import aot

    n = d["tokens"]
    experts = dict(n=n, k=d["top_k"], f=d["width"], m=d["hidden"])
    return [aot.launch("MoeRoute", dict(n=n, e=d["experts"], m=d["hidden"]),
                       dict(top_k=d["top_k"], n_group=1, topk_group=1, normalise=1, scaling=d["scaling"])),
            aot.launch("MoeExpertsUp", experts, dict(block=d["block"])),
            aot.launch("MoeExpertsDown", experts, dict(block=d["block"])),
            aot.launch("MlaAttention", dict(b=2, s=1, t=d["keys"], h=d["heads"], c=d["latent"], r=d["rope"]),
                       dict(nope_dim=d["nope"], v_dim=d["v"], softmax_scale=d["softmax_scale"]))]


def layer_plan() -> dict:
    """The product's real-size MoE layer, built on the meta device: its routed experts' bytes and, per timing
    cell, the bytes one decode step must read."""
    import torch

    from k2deploy.core.bound import layer_read_bytes

    layer = product_layer(torch, torch.device("meta"))
    expert_bits = sum(b.numel() for name, b in layer.named_buffers() if name.startswith("mlp.experts_")
                      and name.endswith("_weight"))
    cells = [{"batch": b, "context": t, "weight_bytes": layer_read_bytes(layer.config, 1, b),
              "cache_bytes": b * t * CACHE_BYTES_PER_TOKEN} for b in BATCHES for t in CONTEXTS]
    return {"routed_expert_fp8_bytes": expert_bits, "cache_bytes_largest": max(c["cache_bytes"] for c in cells),
            "cells": cells}


def product_layer(torch, device):
    """Kimi K2's first MoE decoder layer as the product traces it for the cuda target and the FP8 cache,
    its buffers uninitialised on `device`."""
    from k2deploy.core.checkpoint.presets import preset_config
    from k2deploy.export.graph_modules import ExportLayer

    config = preset_config("k2", layers=2)
    moe_layer = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    with torch.device(device):
        return ExportLayer(config, moe_layer, "fp8", "cuda").eval()


# -- part 1: the Triton kernels against the eager ops ------------------------------------------------------

def fp8_experts(torch, g, e: int, rows: int, cols: int, block: int, device):
    """Random e4m3 bits (no NaN codes) [e, rows, cols] and positive block scales, made on the device."""
    bits = torch.randint(0, 126, (e, rows, cols), generator=g, dtype=torch.uint8, device=device)
    bits |= (torch.randint(0, 2, (e, rows, cols), generator=g, dtype=torch.uint8, device=device) << 7)
    scale = torch.rand(e, -(-rows // block), -(-cols // block), generator=g, device=device) * 0.02 + 0.001
    return bits, scale


def close(torch, got, expected, rtol=1e-4, atol_fraction=1e-5) -> dict:
    got, expected = got.float(), expected.float()
    scale = float(expected.abs().max()) or 1.0
    error = float((got - expected).abs().max())
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol_fraction * scale)
    return {"max_abs_error": error, "relative_to_largest": error / scale}


def kernel_inputs(torch, d: dict, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    n, m, e, f = d["tokens"], d["hidden"], d["experts"], d["width"]
    h, c, r, dn, v, t = d["heads"], d["latent"], d["rope"], d["nope"], d["v"], d["keys"]
    gate, gate_scale = fp8_experts(torch, g, e, f, m, d["block"], device)
    up, up_scale = fp8_experts(torch, g, e, f, m, d["block"], device)
    down, down_scale = fp8_experts(torch, g, e, m, f, d["block"], device)
    return {
        "x": torch.randn(n, m, generator=g, device=device),
        "router": torch.randn(e, m, generator=g, device=device) * 0.02,
        "bias": torch.randn(e, generator=g, device=device) * 0.01,
        "gate": gate, "gate_scale": gate_scale, "up": up, "up_scale": up_scale, "down": down, "down_scale": down_scale,
        "q_nope": torch.randn(2, 1, h, dn, generator=g, device=device),
        "q_pe": torch.randn(2, 1, h, r, generator=g, device=device),
        "latent": torch.randn(2, t, c, generator=g, device=device),
        "rope": torch.randn(2, t, r, generator=g, device=device),
        "kv_b": torch.randn(h * (dn + v), c, generator=g, device=device) * 0.05,
        "lengths": torch.tensor([t, max(1, t // 2)], device=device),
    }


def check_kernels(report: Report, torch, device) -> None:
    for label, d in DIMS.items():
        for name, run in kernel_checks(torch, d, device):
            report.check("kernels", f"{name} {label}", run)
        torch.cuda.empty_cache()


def kernel_checks(torch, d: dict, device) -> list:
    """(name, run) for each Triton kernel at dimensions d, in order: the experts take the routing's choice."""
    from k2deploy.plugins import triton_kernels as tk
    from k2deploy.plugins.experts import experts_down_eager, experts_up_eager
    from k2deploy.plugins.mla import mla_attention_eager
    from k2deploy.plugins.routing import route

    i = kernel_inputs(torch, d, device)
    mask = (torch.arange(d["keys"], device=device)[None, None, :] < i["lengths"][:, None, None])  # [2, 1, t]
    state = {}

    def routing():
        expected_w, expected_ids = route(i["x"], i["router"], i["bias"], d["top_k"], 1, 1, True, d["scaling"])
        got_w, got_ids = tk.moe_route(i["x"], i["router"], i["bias"], d["top_k"], 1, 1, True, d["scaling"])
        if not torch.equal(got_ids, expected_ids):
            raise AssertionError(f"expert ids differ: {got_ids.tolist()} vs {expected_ids.tolist()}")
        state["ids"], state["weights"] = expected_ids, expected_w
        return close(torch, got_w, expected_w, rtol=1e-5, atol_fraction=1e-6)

    def experts_up():
        expected = experts_up_eager(i["x"], state["ids"], i["gate"], i["gate_scale"], i["up"], i["up_scale"], d["block"])
        got = tk.moe_experts_up(i["x"], state["ids"], i["gate"], i["gate_scale"], i["up"], i["up_scale"], d["block"])
        state["hidden"] = expected
        return close(torch, got, expected)

    def experts_down():
        expected = experts_down_eager(state["hidden"], state["ids"], state["weights"], i["down"], i["down_scale"],
                                      d["block"])
        got = tk.moe_experts_down(state["hidden"], state["ids"], state["weights"], i["down"], i["down_scale"],
                                  d["block"])
        return close(torch, got, expected)

    def attention():
        expected = mla_attention_eager(i["q_nope"], i["q_pe"], i["latent"], i["rope"], i["kv_b"], mask, d["nope"],
                                       d["v"], d["softmax_scale"])
        got = tk.mla_attention(i["q_nope"], i["q_pe"], i["latent"], i["rope"], i["kv_b"], mask, d["nope"], d["v"],
                               d["softmax_scale"])
        return close(torch, got, expected)

    def fp8_cache_decode():
        group = min(128, d["latent"])
        latent = i["latent"].transpose(0, 1).contiguous()  # [t, b, c], as the runtime holds the cache
        grouped = latent.view(d["keys"], 2, -1, group)
        scale = (grouped.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
        bits = (grouped / scale).to(torch.float8_e4m3fn).view(d["keys"], 2, d["latent"])
        rope = i["rope"].transpose(0, 1).contiguous().half()
        got = tk.mla_decode_fp8(i["q_nope"], i["q_pe"], bits, scale.squeeze(-1), rope, i["kv_b"], i["lengths"],
                                d["nope"], d["v"], d["softmax_scale"])
        dequantised = (bits.float().view(d["keys"], 2, -1, group) * scale).view(d["keys"], 2, d["latent"])
        expected = mla_attention_eager(i["q_nope"], i["q_pe"], dequantised.transpose(0, 1),
                                       rope.float().transpose(0, 1), i["kv_b"], mask, d["nope"], d["v"],
                                       d["softmax_scale"])
        return close(torch, got, expected)

    return [("MoeRoute", routing), ("MoeExpertsUp", experts_up), ("MoeExpertsDown", experts_down),
            ("MlaAttention", attention), ("MLA decode over the FP8 cache", fp8_cache_decode)]


# -- part 2: the AOT PTX, launched as TensorRT launches it ---------------------------------------------------

class Driver:
    """The few CUDA driver calls an AOT launch needs, through cuda-bindings."""

    def __init__(self):
        try:
            from cuda.bindings import driver
        except ImportError:
            from cuda import cuda as driver
        self.cu = driver
        self.call(driver.cuInit(0))

    def call(self, result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA driver error {int(err)} ({self.cu.cuGetErrorName(err)[1]})")
        return rest[0] if len(rest) == 1 else rest

    def load(self, ptx: str, name: str, shared: int):
        import numpy as np

        image = np.frombuffer(ptx.encode() + b"\0", dtype=np.uint8)
        module = self.call(self.cu.cuModuleLoadData(image.ctypes.data))
        function = self.call(self.cu.cuModuleGetFunction(module, name.encode()))
        if shared > 48 * 1024:  # above the default: TensorRT must grant it the same way
            attribute = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self.call(self.cu.cuFuncSetAttribute(function, attribute, shared))
        return module, function

    def launch(self, function, grid, threads: int, shared: int, values: list, stream: int) -> None:
        """values: ("ptr", address) or ("i32", int), in the kernel's parameter order."""
        import numpy as np

        holders = [np.array([v], dtype=np.uint64 if kind == "ptr" else np.int32) for kind, v in values]
        pointers = np.array([h.ctypes.data for h in holders], dtype=np.uint64)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        self.call(self.cu.cuLaunchKernel(function, *grid, threads, 1, 1, shared, self.cu.CUstream(stream),
                                         pointers.ctypes.data, 0))


def check_aot(report: Report, torch, device) -> None:
    from k2deploy.plugins.experts import experts_down_eager, experts_up_eager
    from k2deploy.plugins.mla import mla_attention_eager
    from k2deploy.plugins.routing import route
    from k2deploy.plugins.tensorrt import aot

    driver = Driver()
    max_ptx = aot.driver_ptx_version()
    report.data["environment"]["driver_ptx_version"] = max_ptx
    for label, d in DIMS.items():
        i = kernel_inputs(torch, d, device, seed=1)
        n, k = d["tokens"], d["top_k"]
        weights, ids = route(i["x"], i["router"], i["bias"], k, 1, 1, True, d["scaling"])
        hidden = experts_up_eager(i["x"], ids, i["gate"], i["gate_scale"], i["up"], i["up_scale"], d["block"])
        mask = (torch.arange(d["keys"], device=device)[None, None, :] < i["lengths"][:, None, None]).contiguous()
        cases = {  # plugin -> (inputs in descriptor order, outputs, expected outputs)
            "MoeRoute": ([i["x"], i["router"], i["bias"]],
                         [torch.empty(n, k, device=device), torch.empty(n, k, dtype=torch.long, device=device)],
                         [weights, ids]),
            "MoeExpertsUp": ([i["x"], ids, i["gate"], i["gate_scale"], i["up"], i["up_scale"]],
                             [torch.empty(n, k, d["width"], device=device)], [hidden]),
            "MoeExpertsDown": ([hidden, ids, weights, i["down"], i["down_scale"]],
                               [torch.empty(n, d["hidden"], device=device)],
                               [experts_down_eager(hidden, ids, weights, i["down"], i["down_scale"], d["block"])]),
            "MlaAttention": ([i["q_nope"], i["q_pe"], i["latent"], i["rope"], i["kv_b"], mask],
                             [torch.empty(2, 1, d["heads"], d["v"], device=device)],
                             [mla_attention_eager(i["q_nope"], i["q_pe"], i["latent"], i["rope"], i["kv_b"], mask,
                                                  d["nope"], d["v"], d["softmax_scale"])]),
        }
        for launch in aot_launches(d):
            tensors_in, tensors_out, expected = cases[launch.plugin]

            def run(launch=launch, tensors_in=tensors_in, tensors_out=tensors_out, expected=expected):
                kernel = aot.compile_launch(launch, max_ptx_version=max_ptx)
                module, function = driver.load(kernel.ptx, kernel.name, kernel.shared)
                values = ([("ptr", t.data_ptr()) for t in tensors_in] + [("i32", int(s)) for s in launch.scalars]
                          + [("ptr", t.data_ptr()) for t in tensors_out])
                values += [("ptr", 0)] * (len(kernel.parameters) - len(values))  # Triton's scratch: null, as TensorRT
                torch.cuda.synchronize()
                driver.launch(function, launch.grid, 32 * kernel.warps, kernel.shared, values,
                              torch.cuda.current_stream().cuda_stream)
                torch.cuda.synchronize()
                figures = {"shared_bytes": kernel.shared, "warps": kernel.warps, "ptx_parameters": len(kernel.parameters)}
                for got, want in zip(tensors_out, expected):
                    if want.dtype == torch.long:
                        if not torch.equal(got, want):
                            raise AssertionError("expert ids differ from the eager routing")
                    else:
                        figures.update(close(torch, got, want))
                driver.call(driver.cu.cuModuleUnload(module))
                return figures

            report.check("aot", f"{launch.plugin} {label}", run)
        del i, cases
        torch.cuda.empty_cache()


# -- part 3: one real-size MoE layer, one decode step ---------------------------------------------------------

def copy_bandwidth(torch, device, nbytes: int = 2 << 30) -> float:
    """GB/s of device-to-device copies (read + write counted), median of 5 after one warm-up."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        stop.record()
        torch.cuda.synchronize()
        samples.append(2 * nbytes / (start.elapsed_time(stop) / 1e3) / 1e9)
    del src, dst
    return statistics.median(samples)


WIDENED_CACHE_NOTE = ("the shipped cuda / tensorrt layer graph widens the whole FP8 latent cache to float32 and "
                      "concatenates it with the new entry every step before attention (it does not read the FP8 "
                      "cache in place); moe_layer times that")


def run_ops_on_plugin_kernels(torch) -> None:
    """On CUDA tensors the layer's custom ops run the Triton kernels of the TensorRT plugins: MoeRoute, MoeExperts
    as MoeExpertsUp then MoeExpertsDown (as a TensorRT copy of the graph runs it), MlaAttention."""
    from k2deploy.plugins import triton_kernels as tk

    def experts(x, ids, weights, gate, gate_scale, up, up_scale, down, down_scale, block):
        hidden = tk.moe_experts_up(x, ids, gate, gate_scale, up, up_scale, block)
        return tk.moe_experts_down(hidden, ids, weights, down, down_scale, block)

    torch.library.register_kernel("k2deploy::moe_route", "cuda", tk.moe_route)
    torch.library.register_kernel("k2deploy::moe_experts", "cuda", experts)
    torch.library.register_kernel("k2deploy::mla_attention", "cuda", tk.mla_attention)


def random_layer(torch, device, seed: int = 0):
    """The product's layer on the GPU, every buffer random: e4m3 weights and expert bits without NaN codes,
    positive block scales, unit norms, a small router."""
    layer = product_layer(torch, device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, buffer in layer.named_buffers():  # buffers, not parameters: no autograd here
        if name.endswith("rotary.frequencies"):
            continue  # computed from the config
        if name == "e4m3_values":  # the value of each e4m3 bit pattern, for the fp8 cache's pages
            from k2deploy.plugins.fp8 import E4M3_VALUES

            buffer.copy_(torch.from_numpy(E4M3_VALUES))
            continue
        if buffer.dtype == torch.uint8:  # e4m3 bits of the routed experts
            buffer.random_(0, 126, generator=g)
            buffer.bitwise_or_(torch.randint(0, 2, buffer.shape, generator=g, dtype=torch.uint8, device=device) << 7)
        elif buffer.dtype == torch.float8_e4m3fn:
            buffer.copy_(torch.randn(buffer.shape, generator=g, device=device).to(torch.float8_e4m3fn))
        elif name.endswith("scale_inv") or name.endswith("_scale"):
            buffer.copy_(torch.rand(buffer.shape, generator=g, device=device) * 0.02 + 0.001)
        elif "norm" in name:
            buffer.fill_(1.0)
        else:  # the router and its correction bias
            buffer.copy_(torch.randn(buffer.shape, generator=g, device=device) * 0.01)
    return layer


def fp8_cache(torch, layer, batch: int, context: int, device):
    """A full FP8 latent cache of `context` tokens for `batch` rows, paged as the runtime holds it: (page_table
    [batch, n], latent_pages [pages, PAGE_SIZE, c] as e4m3 bits, rope_pages, latent_scale_pages)."""
    from k2deploy.core.cache_format import PAGE_SIZE

    c = layer.config
    n = -(-context // PAGE_SIZE)
    pages = batch * n
    table = torch.arange(pages, device=device).view(batch, n)
    bits = torch.randint(0, 126, (pages, PAGE_SIZE, c.kv_lora_rank), dtype=torch.uint8, device=device)
    scale = torch.full((pages, PAGE_SIZE, layer.cache.scales_per_token), 1e-2, device=device)
    rope = torch.randn(pages, PAGE_SIZE, c.qk_rope_head_dim, device=device).half()
    return table, bits, rope, scale


def time_moe_layer(report: Report, torch, device, plan: dict) -> None:
    gbps = copy_bandwidth(torch, device)
    report.data["environment"]["copy_bandwidth_gbps"] = round(gbps, 1)
    run_ops_on_plugin_kernels(torch)
    layer = random_layer(torch, device)
    for cell in plan["cells"]:
        row = {"batch": cell["batch"], "context": cell["context"]}
        if report.elapsed() > report.budget:
            row["status"] = "skipped: past --budget"
            report.data["moe_layer"].append(row)
            continue
        try:
            b, t = cell["batch"], cell["context"]
            cache = fp8_cache(torch, layer, b, t, device)
            hidden = torch.randn(b, 1, layer.config.hidden_size, device=device)
            positions = torch.full((b, 1), t, dtype=torch.long, device=device)
            samples = []
            with torch.no_grad():
                for step in range(WARMUP_STEPS + TIMED_STEPS):
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    layer(hidden, positions, *cache)
                    stop.record()
                    torch.cuda.synchronize()
                    if step >= WARMUP_STEPS:
                        samples.append(start.elapsed_time(stop))
            must_read = cell["weight_bytes"] + cell["cache_bytes"]
            bound_ms = must_read / (gbps * 1e9) * 1e3
            row.update(status="timed", step_ms=round(statistics.median(samples), 3), bytes_read=int(must_read),
                       bound_ms=round(bound_ms, 3), step_over_bound=round(statistics.median(samples) / bound_ms, 2))
            del cache
            torch.cuda.empty_cache()
        except Exception as error:  # out of memory or a kernel failure: record it, keep the other cells
            row.update(status="failed", error=f"{type(error).__name__}: {error}")
        print(f"[{report.elapsed():6.1f}s] moe_layer batch {row['batch']} context {row['context']}: {row['status']}"
              + (f" {row['step_ms']} ms" if row["status"] == "timed" else ""), file=sys.stderr, flush=True)
        report.data["moe_layer"].append(row)


# -- output ------------------------------------------------------------------------------------------------

def markdown(data: dict) -> str:
    env = data["environment"]
    lines = [f"# GPU check{' (dry run: no GPU used)' if data['dry_run'] else ''}", "",
             f"- device: {env.get('device', 'none')}; torch {env.get('torch')}, triton {env.get('triton')}, "
             f"cuda-bindings {env.get('cuda_bindings')}; copy bandwidth {env.get('copy_bandwidth_gbps', '-')} GB/s",
             f"- command: `{env.get('command')}`; {data.get('seconds', 0):.0f} s", ""]
    if data["checks"]:
        lines += ["| part | check | status | max abs error | relative | shared bytes | s |", "|---|---|---|---:|---:|---:|---:|"]
        for row in data["checks"]:
            status = row["status"] if row["status"] != "failed" else f"FAILED: {row['error'][:120]}"
            error = f"{row['max_abs_error']:.2e}" if "max_abs_error" in row else ""
            relative = f"{row['relative_to_largest']:.2e}" if "relative_to_largest" in row else ""
            lines.append(f"| {row['part']} | {row['name']} | {status} | {error} | {relative} | "
                         f"{row.get('shared_bytes', '')} | {row['seconds']} |")
        lines.append("")
    if data["moe_layer"]:
        lines += ["The product's real-size Kimi K2 MoE layer (cuda target, FP8 cache widened to float32 and "
                  "concatenated each step, as the shipped graph does), one decode step (median of CUDA events):", "",
                  "| batch | context | status | step ms | MB to read | bound ms | step / bound |",
                  "|---:|---:|---|---:|---:|---:|---:|"]
        for row in data["moe_layer"]:
            status = row["status"] if row["status"] != "failed" else f"FAILED: {row['error'][:100]}"
            read = f"{row['bytes_read'] / 1e6:.0f}" if "bytes_read" in row else ""
            lines.append(f"| {row['batch']} | {row['context']} | {status} | {row.get('step_ms', '')} | {read} | "
                         f"{row.get('bound_ms', '')} | {row.get('step_over_bound', '')} |")
        lines.append("")
    if data.get("plan"):
        lines += ["Launch plan (checked against TensorRT's calling convention):", "",
                  "| plugin | kernel | grid | int32 scalars |", "|---|---|---|---|"]
        for name, launch in data["plan"]["launches"].items():
            lines.append(f"| {name} | {launch['kernel']} | {launch['grid']} | {launch['scalars']} |")
        layer = data["plan"]["layer"]
        lines += ["", f"Real-size layer: {layer['routed_expert_fp8_bytes'] / 1e9:.1f} GB of FP8 routed experts; the "
                      f"largest cache {layer['cache_bytes_largest'] / 1e9:.2f} GB; {len(layer['cells'])} timing cells.", ""]
    for note in data["notes"]:
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


def environment(torch) -> dict:
    from importlib import metadata

    def version(package: str):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    env = {"command": " ".join(["python", *sys.argv]), "python": platform.python_version(),
           "torch": getattr(torch, "__version__", None) if torch else None, "triton": version("triton"),
           "cuda_bindings": version("cuda-bindings") or version("cuda-python")}
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                   compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="output folder (default: gpu-check)")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: check the imports, the launch plan and the layer's shapes, write the report")
    parser.add_argument("--budget", type=float, default=280.0,
                        help="seconds after which no new timing cell starts (default 280)")
    args = parser.parse_args(argv)
    report = Report(args.dry_run, args.budget)
    report.data["notes"].append(WIDENED_CACHE_NOTE)
    missing = [name for name in ("torch", "triton") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"gpu_check: error: {', '.join(missing)} not installed: pip install -e '.[dev]' (or torch with CUDA "
              f"and triton on the GPU machine)", file=sys.stderr)
        return 2
    import torch

    report.data["environment"] = environment(torch)
    try:
        report.data["plan"] = {"launches": launch_plan(), "layer": layer_plan()}
    except Exception as error:  # the plan itself is broken: nothing on a GPU would run either
        print(f"gpu_check: error: the launch plan does not hold: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if not args.dry_run:
        if not torch.cuda.is_available():
            print("gpu_check: error: no CUDA GPU visible to torch; use --dry-run to check the plan alone",
                  file=sys.stderr)
            return 2
        if importlib.util.find_spec("cuda") is None:
            report.data["notes"].append("cuda-bindings is not installed: the aot part is skipped (pip install cuda-python)")
        device = torch.device("cuda", 0)
        torch.backends.cuda.matmul.allow_tf32 = False  # the eager references in float32
        check_kernels(report, torch, device)
        if importlib.util.find_spec("cuda") is not None:
            check_aot(report, torch, device)
        try:
            time_moe_layer(report, torch, device, report.data["plan"]["layer"])
        except Exception as error:  # building the layer failed: the checks above still stand
            report.data["notes"].append(f"moe_layer not run: {type(error).__name__}: {error}")
    report.data["seconds"] = round(report.elapsed(), 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report.data, indent=2, default=str))
    text = markdown(report.data)
    (args.out / "gpu_check.md").write_text(text)
    print(text)
    failed = [row for row in report.data["checks"] + report.data["moe_layer"] if row["status"] == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
