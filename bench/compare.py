"""`k2deploy bench compare DIR [DIR ...]`: one table and one plot across saved results.

Each DIR is a `--out` folder of `k2deploy bench` (holding <device>/bench.json), one device
folder, or a bench.json itself. Nothing is re-run: everything comes from the saved documents.
Rows are (result, batch, prompt length), sorted by device, provider and threads, so that runs
on one type of device sit together.
"""

from __future__ import annotations

from pathlib import Path

from ..core.errors import K2Error
from ..core.json_files import check_version, read_document
from .report import NO_MATPLOTLIB, RESULT_FILE, _fmt, _plain_ticks, _pyplot, _table, have_matplotlib, run_label, runs_on
from .schema import SCHEMA_NAME, SCHEMA_VERSION
from .stats import show

COMPARE_PNG = "compare.png"
COMPARE_MD = "compare.md"


def find_results(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise K2Error(f"{path}: no such file or directory")
    found = sorted(path.glob(RESULT_FILE)) + sorted(path.glob(f"*/{RESULT_FILE}"))
    if not found:
        raise K2Error(f"{path}: holds no {RESULT_FILE} (nor <device>/{RESULT_FILE}); run `k2deploy bench ART --out {path}`")
    return found


def load_result(path: Path) -> dict:
    doc = read_document(path, "missing; run `k2deploy bench ART --out DIR` to make it", "schema", SCHEMA_NAME,
                        "k2deploy bench result")
    check_version(doc, "schema_version", SCHEMA_VERSION, f"{path}: bench result schema",
                  "re-run `k2deploy bench` with this version")
    return doc


def load_results(paths: list[str | Path]) -> list[tuple[Path, dict]]:
    results, seen = [], set()
    for given in paths:
        for file in find_results(given):
            key = file.resolve()
            if key not in seen:
                seen.add(key)
                results.append((file, load_result(file)))
    return sorted(results, key=lambda item: (item[1]["device"]["kind"], item[1]["device"]["label"],
                                             runs_on(item[1]), item[1]["threads"] or 0, str(item[0])))


def labels(results: list[tuple[Path, dict]]) -> list[str]:
    """run_label of each result; where two share one, the folder they were saved under is added."""
    plain = [run_label(doc) for _, doc in results]
    out = []
    for (path, _), label in zip(results, plain):
        if plain.count(label) > 1:
            folder = path.parent.parent if path.parent.name != path.parent.parent.name else path.parent
            label = f"{label} [{folder.name}]"
        out.append(label)
    return out


def compare_rows(results: list[tuple[Path, dict]]) -> tuple[list[str], list[list[str]]]:
    header = ["device / runs on / threads", "artifact", "batch x prompt", "TTFT ms", "TPOT ms", "tok/s batch",
              "prefill tok/s", "GB/s", "TPOT/bound", "baseline TTFT x", "baseline TPOT x"]
    rows = []
    for (_, doc), label in zip(results, labels(results)):
        base = doc["settings"]["baseline"]
        for cell in doc["cells"]:
            b = cell["baseline"] or {}
            rows.append([label, doc["artifact"]["manifest_sha256"][:8],
                         f"{cell['batch']} x {cell['prompt_len']}", show(cell["ttft_ms"], 0), show(cell["tpot_ms"], 1),
                         _fmt(cell["batch_tokens_per_s"]["median"], 2), _fmt(cell["prefill_tokens_per_s"]["median"], 0),
                         _fmt(doc["bandwidth"]["gb_per_s"]["median"], 1), _fmt(cell["bound"]["ratio"], 1, "x"),
                         _fmt(b.get("ttft_ratio"), 2, "x") + (f" {base}" if b else ""),
                         _fmt(b.get("tpot_ratio"), 2, "x") + (f" {base}" if b else "")])
    return header, rows


def format_compare(results: list[tuple[Path, dict]], markdown: bool = False) -> str:
    header, rows = compare_rows(results)
    return _table(header, rows, markdown)


def plot_compare(results: list[tuple[Path, dict]], path: Path) -> None:
    """Time per output token against prompt length: one line per (result, batch), p10-p90 whiskers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 5.0), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^v<>p*"
    for k, ((_, doc), label) in enumerate(zip(results, labels(results))):
        batches = sorted({c["batch"] for c in doc["cells"]})
        for j, batch in enumerate(batches):
            cells = sorted((c for c in doc["cells"] if c["batch"] == batch), key=lambda c: c["prompt_len"])
            tpot = [c["tpot_ms"] for c in cells]
            ax.errorbar([c["prompt_len"] for c in cells], [t["median"] for t in tpot],
                        yerr=[[t["median"] - t["p10"] for t in tpot], [t["p90"] - t["median"] for t in tpot]],
                        color=colors[k % len(colors)], marker=markers[j % len(markers)], capsize=3,
                        linestyle=["-", "--", "-.", ":"][j % 4], label=f"{label}, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _plain_ticks(ax, [c["prompt_len"] for _, doc in results for c in doc["cells"]])
    ax.set_xlabel("prompt length (tokens in the cache when decoding starts)")
    ax.set_ylabel("ms per output token (median, p10-p90)")
    models = sorted({f"{Path(doc['artifact']['path']).name} ({doc['artifact']['manifest_sha256'][:8]})"
                     for _, doc in results})
    ax.set_title("Time per output token, saved results side by side\n" + ", ".join(models), fontsize=10)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_compare(paths: list[str | Path], out: str | Path) -> dict:
    """Loads the results, writes out/compare.md and out/compare.png; returns what it wrote."""
    results = load_results(paths)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = format_compare(results, markdown=True)
    (out / COMPARE_MD).write_text(markdown + "\n")
    plot = None
    if have_matplotlib():
        plot = out / COMPARE_PNG
        plot_compare(results, plot)
    header, rows = compare_rows(results)
    return {"results": [str(p) for p, _ in results], "markdown": str(out / COMPARE_MD),
            "plot": str(plot) if plot else None, "notes": [] if plot else [NO_MATPLOTLIB],
            "table": {"header": header, "rows": rows}, "_results": results}
