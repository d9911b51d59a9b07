"""Plans side by side: one workload in each --weights format, and layer pipelining beside expert parallelism.

Each plan is summed up by its headline figures, the memory-bandwidth bounds of decode:
  decode_ms_per_token  what a sequence waits per token: pipeline (pp) the stages one after another; expert
                       parallelism (ep) one step, the busiest device's reads plus the all-to-all
  tokens_per_s         pp: batch / the slowest stage where the batch has a sequence for every stage (micro-batches
                       in flight), else batch / decode_ms_per_token; ep: batch / the step time
"""

from __future__ import annotations

from typing import Callable

from .errors import K2Error
from .held_weights import WEIGHTS
from .placement import format_bytes


def headline(info: dict) -> dict:
    """{decode_ms_per_token, tokens_per_s} of a pp or ep plan (see the module doc)."""
    if info["parallel"] == "ep":
        return {"decode_ms_per_token": info["decode_ms_per_token"], "tokens_per_s": info["tokens_per_s"]}
    pipelined = info["batch"] >= len(info["per_device"])
    return {"decode_ms_per_token": info["decode_ms_per_token"],
            "tokens_per_s": info["tokens_per_s"] if pipelined else info["tokens_per_s_in_turn"]}


def _row(run: Callable[[], dict]) -> tuple[dict | None, dict]:
    """(the plan or None, {fits, decode_ms_per_token, tokens_per_s, why}) of one plan that may not fit."""
    try:
        info = run()
    except K2Error as exc:
        return None, {"fits": False, "decode_ms_per_token": None, "tokens_per_s": None, "why": str(exc)}
    return info, {"fits": True, **headline(info), "why": None}


def by_weights(run: Callable[[str], dict], chosen: str, weight_bytes: Callable[[str], int]) -> dict:
    """The plan `run(chosen)`, with "weights_compared": one row per --weights format (its weights' bytes, whether
    it fits, its headline). When the chosen format does not fit: its K2Error, naming the formats that do."""
    rows, plans = [], {}
    for weights in WEIGHTS:
        plans[weights], row = _row(lambda: run(weights))
        rows.append({"weights": weights, "weights_bytes": weight_bytes(weights), **row})
    if plans[chosen] is None:
        mine = next(r for r in rows if r["weights"] == chosen)
        fitting = [f"--weights {r['weights']} ({format_bytes(r['weights_bytes'])})" for r in rows if r["fits"]]
        raise K2Error(mine["why"] + (f"; {' or '.join(fitting)} fits" if fitting else ""))
    return {**plans[chosen], "weights_compared": rows}


def format_by_weights(rows: list[dict]) -> list[str]:
    """The formats table: one line per --weights format."""
    lines = [f"formats     {'weights':<8} {'bytes':>10}  {'fits':<4} {'ms/token':>9} {'tokens/s':>9}"]
    for r in rows:
        figures = (f"{r['decode_ms_per_token']:>9.2f} {r['tokens_per_s']:>9,.0f}" if r["fits"]
                   else f"{'-':>9} {'-':>9}")
        lines.append(f"            {r['weights']:<8} {format_bytes(r['weights_bytes']):>10}  "
                     f"{'yes' if r['fits'] else 'no':<4} {figures}")
    return lines


def pp_vs_ep(run_pp: Callable[[], dict], ep: dict) -> dict:
    """The pipeline plan of the same devices, batch, context and weights beside the expert-parallel one `ep`:
    {pp: row, ep: row}, each {fits, decode_ms_per_token, tokens_per_s, why}."""
    return {"pp": _row(run_pp)[1], "ep": _row(lambda: ep)[1]}


def format_pp_vs_ep(compared: dict, batch: int) -> list[str]:
    """Two lines, pp then ep: latency per token and throughput at `batch`."""
    lines = [f"pp vs ep    {f'at batch {batch}':<22} {'ms/token':>9} {'tokens/s':>9}"]
    for name, label in (("pp", "pp (layers pipelined)"), ("ep", "ep (experts sharded)")):
        r = compared[name]
        figures = (f"{r['decode_ms_per_token']:>9.2f} {r['tokens_per_s']:>9,.0f}" if r["fits"]
                   else f"does not fit: {r['why']}")
        lines.append(f"            {label:<22} {figures}")
    return lines
