"""Summaries for reports people read: a distribution (min, percentiles, max, mean), a size in
bytes."""

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


def size_text(count: float) -> str:
    """A size in bytes as people read it, in powers of 1024 named so (KiB, MiB, GiB, TiB), as
    ``mimo-shard build --max-shard-bytes`` reads its KB/MB/GB."""
    if count < 1024:
        return f"{count:,.0f} bytes"
    scaled, unit = count / 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if round(scaled, 1) < 1024:     # 1048575 bytes: 1.0 MiB, not 1024.0 KiB
            break
        scaled, unit = scaled / 1024, larger
    return f"{scaled:.1f} {unit}"
