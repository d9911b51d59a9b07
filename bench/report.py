"""Writes one benchmark result: DIR/<device>/bench.json (+ schema.json), bench.csv, and two PNG
plots (per_layer.png: one decode step by stage; tpot_vs_context.png: time per output token
against the prompt length, with the baseline and the bandwidth bound); and prints it as a table.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .schema import SCHEMA
from .stats import show

RESULT_FILE = "bench.json"
CSV_FILE = "bench.csv"
SCHEMA_FILE = "schema.json"
PER_LAYER_PNG = "per_layer.png"
TPOT_PNG = "tpot_vs_context.png"


def runs_on(doc: dict) -> str:
    """What ran the artifact: the ONNX Runtime provider ("cpu", "cuda", ...) or "tensorrt engines"
    (results written before the backend was recorded ran on ONNX Runtime)."""
    return "tensorrt engines" if doc.get("backend") == "tensorrt" else doc["provider"]


def run_label(doc: dict) -> str:
    """'AMD EPYC, 2 cores, 24 GiB / cpu / 2 threads': one result's row name across machines."""
    count = doc.get("threads")
    threads = f"{count} thread{'s' * (count != 1)}" if count else "default threads"
    return f"{doc['device']['label']} / {runs_on(doc)} / {threads}"


def _value(summary: dict | None, key: str = "median"):
    return None if not summary else summary[key]


def _fmt(value, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


# -- CSV --------------------------------------------------------------------------------------------------

CSV_FIGURES = ("ttft_ms", "tpot_ms", "prefill_tokens_per_s", "stream_tokens_per_s", "batch_tokens_per_s")


def csv_rows(doc: dict) -> list[dict]:
    rows = []
    for cell in doc["cells"]:
        row = {"device": doc["device"]["label"], "device_slug": doc["device"]["slug"], "provider": doc["provider"],
               "backend": doc.get("backend", "onnxruntime"), "threads": doc["threads"] or "", "manifest_sha256": doc["artifact"]["manifest_sha256"],
               "batch": cell["batch"], "prompt_len": cell["prompt_len"], "gen_len": cell["gen_len"]}
        for figure in CSV_FIGURES:
            for key in ("median", "p10", "p90"):
                row[f"{figure}_{key}"] = _value(cell[figure], key)
        steps = cell["decode_step_ms"]
        row["step_ms_median"] = steps["step"]["median"]
        row["embed_ms_median"] = steps["embed"]["median"]
        for i, layer in enumerate(steps["layers"]):
            row[f"layer_{i:03d}_ms_median"] = layer["median"]
        for stage in ("native_step", "head", "sampling", "overhead"):
            row[f"{stage}_ms_median"] = steps[stage]["median"] if stage in steps else None
        row["breakdown_sum_ratio"] = cell["breakdown_sum_ratio"]
        row["kv_cache_bytes_allocated"] = cell["kv_cache_bytes_allocated"]
        row["peak_rss_bytes"] = cell["peak_rss_bytes"]
        row["bound_bytes_per_step"] = cell["bound"]["bytes_per_step"]
        row["bound_ms"] = cell["bound"]["ms"]
        row["bound_ratio"] = cell["bound"]["ratio"]
        row["bandwidth_gb_per_s"] = doc["bandwidth"]["gb_per_s"]["median"]
        base = cell["baseline"] or {}
        row["baseline"] = doc["settings"]["baseline"]
        row["baseline_ttft_ms_median"] = _value(base.get("ttft_ms"))
        row["baseline_tpot_ms_median"] = _value(base.get("tpot_ms"))
        row["baseline_ttft_ratio"] = base.get("ttft_ratio")
        row["baseline_tpot_ratio"] = base.get("tpot_ratio")
        rows.append(row)
    return rows


def write_csv(doc: dict, path: Path) -> None:
    rows = csv_rows(doc)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# -- plots ------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _stage_labels(doc: dict) -> list[str]:
    layers = len(doc["cells"][0]["decode_step_ms"]["layers"])
    kinds = doc["artifact"].get("layer_structures") or [""] * layers
    native = ["native step\n(embed, layers)"] if "native_step" in doc["cells"][0]["decode_step_ms"] else []
    return ["embed", *[f"layer {i}" + (f"\n{kind}" if kind else "") for i, kind in enumerate(kinds)], *native,
            "head", "sampling", "overhead"]


def plot_per_layer(doc: dict, path: Path) -> None:
    """One decode step by stage: a group of bars per stage, one bar per cell, p10-p90 whiskers."""
    plt = _pyplot()
    labels = _stage_labels(doc)
    cells = doc["cells"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.1 * len(labels) + 2), 4.6), dpi=110)
    width = 0.8 / len(cells)
    for j, cell in enumerate(cells):
        steps = cell["decode_step_ms"]
        native = [steps["native_step"]] if "native_step" in steps else []
        stages = [steps["embed"], *steps["layers"], *native, steps["head"], steps["sampling"], steps["overhead"]]
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(labels))]
        medians = [s["median"] for s in stages]
        errors = [[max(s["median"] - s["p10"], 0) for s in stages], [max(s["p90"] - s["median"], 0) for s in stages]]
        ax.bar(xs, medians, width, yerr=errors, capsize=2,
               label=f"batch {cell['batch']}, prompt {cell['prompt_len']} (step {steps['step']['median']:.1f} ms)")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("ms per decode step (median, p10-p90)")
    ax.set_title(f"Decode step by stage: {doc['device']['label']}, {runs_on(doc)}\n"
                 f"{Path(doc['artifact']['path']).name} ({doc['artifact']['layers']} layers, "
                 f"{doc['artifact']['kv_cache']} cache)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plain_ticks(ax, values) -> None:
    """The prompt lengths themselves as x ticks (128, 512), not powers of two; plain numbers on the log y axis."""
    from matplotlib.ticker import FuncFormatter, NullFormatter, NullLocator

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.1g}"[0] in "25" else ""))
    values = sorted(set(values))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(values, [str(v) for v in values])
    if len(values) == 1:
        ax.set_xlim(values[0] / 1.5, values[0] * 1.5)


def _by_batch(doc: dict) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = {}
    for cell in doc["cells"]:
        groups.setdefault(cell["batch"], []).append(cell)
    return {b: sorted(cells, key=lambda c: c["prompt_len"]) for b, cells in sorted(groups.items())}


def plot_tpot(doc: dict, path: Path) -> None:
    """Time per output token against the prompt length: ours, the baseline, the bandwidth bound."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    baseline = doc["settings"]["baseline"]
    for k, (batch, cells) in enumerate(_by_batch(doc).items()):
        color = colors[k % len(colors)]
        x = [c["prompt_len"] for c in cells]
        tpot = [c["tpot_ms"] for c in cells]
        ax.errorbar(x, [t["median"] for t in tpot], yerr=[[t["median"] - t["p10"] for t in tpot],
                    [t["p90"] - t["median"] for t in tpot]], color=color, marker="o", capsize=3,
                    label=f"ours, batch {batch}")
        based = [(c["prompt_len"], c["baseline"]["tpot_ms"]) for c in cells if c["baseline"]]
        if based:
            ax.errorbar([p for p, _ in based], [t["median"] for _, t in based],
                        yerr=[[t["median"] - t["p10"] for _, t in based], [t["p90"] - t["median"] for _, t in based]],
                        color=color, marker="s", linestyle="--", capsize=3, label=f"{baseline}, batch {batch}")
        bound = [(c["prompt_len"], c["bound"]["ms"]) for c in cells if c["bound"]["ms"]]
        if bound:
            ax.plot([p for p, _ in bound], [b for _, b in bound], color=color, linestyle=":", marker=".",
                    label=f"bandwidth bound, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_ticks(ax, [c["prompt_len"] for c in doc["cells"]])
    ax.set_xlabel("prompt length (tokens in the cache when decoding starts)")
    ax.set_ylabel("ms per output token (median, p10-p90)")
    ax.set_title(f"Time per output token: {doc['device']['label']}, {runs_on(doc)}\n"
                 f"bound = bytes read per step / {doc['bandwidth']['gb_per_s']['median']:.1f} GB/s measured",
                 fontsize=10)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# -- files ------------------------------------------------------------------------------------------------


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


NO_MATPLOTLIB = "matplotlib is not installed: no PNG plots (pip install 'k2deploy[bench]')"


def write_result(doc: dict, out: Path) -> dict[str, Path]:
    """Writes everything under out/<device slug>/; returns {what: path}. Without matplotlib: no PNGs, a note."""
    folder = Path(out) / doc["device"]["slug"]
    folder.mkdir(parents=True, exist_ok=True)
    plots = have_matplotlib()
    if not plots and NO_MATPLOTLIB not in doc["notes"]:
        doc["notes"].append(NO_MATPLOTLIB)
    paths = {"json": folder / RESULT_FILE, "schema": folder / SCHEMA_FILE, "csv": folder / CSV_FILE}
    paths["json"].write_text(json.dumps(doc, indent=2) + "\n")
    paths["schema"].write_text(json.dumps(SCHEMA, indent=2) + "\n")
    write_csv(doc, paths["csv"])
    if plots:
        paths["per_layer_png"] = folder / PER_LAYER_PNG
        paths["tpot_png"] = folder / TPOT_PNG
        plot_per_layer(doc, paths["per_layer_png"])
        plot_tpot(doc, paths["tpot_png"])
    return paths


# -- the table --------------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i < 1 else "---:" for i in range(len(header))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def cell_rows(doc: dict) -> tuple[list[str], list[list[str]]]:
    base = doc["settings"]["baseline"]
    header = ["batch x prompt", "TTFT ms", "TPOT ms", "tok/s stream", "tok/s batch", "prefill tok/s",
              "bound ms", "TPOT/bound"]
    if base != "none":
        header += [f"{base} TTFT x", f"{base} TPOT x"]
    rows = []
    for cell in doc["cells"]:
        row = [f"{cell['batch']} x {cell['prompt_len']}", show(cell["ttft_ms"], 0), show(cell["tpot_ms"], 1),
               _fmt(cell["stream_tokens_per_s"]["median"], 2), _fmt(cell["batch_tokens_per_s"]["median"], 2),
               _fmt(cell["prefill_tokens_per_s"]["median"], 0), _fmt(cell["bound"]["ms"], 2),
               _fmt(cell["bound"]["ratio"], 1, "x")]
        if base != "none":
            b = cell["baseline"] or {}
            row += [_fmt(b.get("ttft_ratio"), 2, "x"), _fmt(b.get("tpot_ratio"), 2, "x")]
        rows.append(row)
    return header, rows


def format_result(doc: dict, markdown: bool = False) -> str:
    mem, bw = doc["memory"], doc["bandwidth"]["gb_per_s"]
    header, rows = cell_rows(doc)
    lines = [
        f"device     {doc['device']['label']} ({doc['device']['slug']}); {runs_on(doc)}, "
        f"{doc['threads'] or 'default'} threads"
        + (f", decode {doc['decode_kernels']}" if doc.get("decode_kernels") else ""),
        f"artifact   {doc['artifact']['path']} (manifest sha256 {doc['artifact']['manifest_sha256'][:12]}, "
        f"{doc['artifact']['layers']} layers, {doc['artifact']['kv_cache']} cache)",
        "versions   " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v),
        f"settings   gen-len {doc['settings']['gen_len']}, {doc['settings']['repeats']} repeats after "
        f"{doc['settings']['warmup']} warm-up; baseline {doc['settings']['baseline']}",
        f"memory     weights {mem['weights_bytes'] / 1e6:.1f} MB on disk, +{(mem['weights_rss_bytes'] or 0) / 1e6:.0f} MB "
        f"RSS loaded; KV cache {mem['kv_bytes_per_token']} bytes/token ({mem['kv_bytes_per_token_per_layer']} per "
        f"layer); peak RSS {(mem['peak_rss_bytes'] or 0) / 1e6:.0f} MB"
        + (f"; device memory {mem['device_memory_bytes'] / 1e6:.0f} MB" if mem["device_memory_bytes"] else ""),
        f"bandwidth  {show(bw, 1)} GB/s (numpy copy, same run)",
        "",
        _table(header, rows, markdown),
        "",
        "figures: median (p90, ± half the p10-p90 width relative to the median); x: baseline / ours (>1: ours faster)",
        "decode step by stage, ms (median per step):",
    ]
    for cell in doc["cells"]:
        s = cell["decode_step_ms"]
        layers = " ".join(f"{l['median']:.1f}" for l in s["layers"])
        body = (f"native step (embedding and layers in one call) {s['native_step']['median']:.2f}" if "native_step" in s
                else f"embed {s['embed']['median']:.2f} + layers [{layers}]")
        lines.append(f"  {cell['batch']} x {cell['prompt_len']}: {body} "
                     f"+ head {s['head']['median']:.1f} + sampling {s['sampling']['median']:.2f} + overhead "
                     f"{s['overhead']['median']:.2f} = {cell['breakdown_sum_ratio']:.0%} of the step "
                     f"{s['step']['median']:.1f}; KV cache {cell['kv_cache_bytes_allocated'] / 1e6:.1f} MB")
    for note in doc["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
