"""Summaries of a distribution (min, percentiles, max, mean) for reports people read."""

from __future__ import annotations

import numpy as np


def summary(values) -> dict | None:
    """``{min, p10, p50, p90, max, mean}`` of ``values``; None when there are none."""
    if not len(values):
        return None
    array = np.asarray(values, dtype=np.float64)
    p10, p50, p90 = np.percentile(array, [10, 50, 90])
    return {"min": float(array.min()), "p10": float(p10), "p50": float(p50),
            "p90": float(p90), "max": float(array.max()), "mean": float(array.mean())}
