"""Median, p10/p90 and spread of repeated measurements: every figure `k2deploy bench` reports."""

from __future__ import annotations

import math

import numpy as np


def summarize(samples) -> dict | None:
    """samples (any unit) -> {median, p10, p90, min, max, mean, n, spread}; None when there are none.

    spread = (p90 - p10) / median: the width of the middle 80 % relative to the median (0 for
    a single sample). Percentiles interpolate linearly between samples (numpy's default).
    """
    values = np.asarray([float(s) for s in samples if s is not None and math.isfinite(float(s))], dtype=np.float64)
    if values.size == 0:
        return None
    median = float(np.median(values))
    p10, p90 = (float(v) for v in np.percentile(values, [10, 90]))
    return {
        "median": median,
        "p10": p10,
        "p90": p90,
        "min": float(values.min()),
        "max": float(values.max()),
        "mean": float(values.mean()),
        "n": int(values.size),
        "spread": (p90 - p10) / median if median else 0.0,
    }


def ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    """Ratio of two summaries' medians (None when either is missing or the denominator is 0)."""
    if not numerator or not denominator or not denominator["median"]:
        return None
    return numerator["median"] / denominator["median"]


def show(summary: dict | None, digits: int = 1) -> str:
    """'12.3 (p90 14.0, ±8%)': the median, p90 and the spread, for tables."""
    if not summary:
        return "-"
    return f"{summary['median']:.{digits}f} (p90 {summary['p90']:.{digits}f}, ±{summary['spread'] * 50:.0f}%)"
