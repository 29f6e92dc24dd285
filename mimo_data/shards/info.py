"""`mimo-shard info`: what a dataset holds, from index.json and samples.parquet only."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from mimo_data.shards import storage
from mimo_data.shards.index import read_index
from mimo_data.shards.format import SAMPLES_FILE
from mimo_data.stats import summary

_SIDE_BUCKETS = (0, 256, 512, 1024, 2048)            # longest image side, pixels
_DURATION_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # audio clip duration, seconds


def _histogram(values, edges) -> dict[str, int]:
    labels = [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])] + [f">={edges[-1]}"]
    counts = np.bincount(np.searchsorted(edges, values, side="right") - 1,
                         minlength=len(edges)) if len(values) else [0] * len(edges)
    return {label: int(count) for label, count in zip(labels, counts)}  # type: ignore[call-overload]


def dataset_info(directory: str) -> dict:
    """Totals, per-modality counts and image-size / audio-duration distributions."""
    index = read_index(directory)
    table = pq.read_table(storage.readable(storage.join(directory, SAMPLES_FILE)),
                          columns=["image_width", "image_height", "audio_duration"])
    widths = np.array([w for row in table.column("image_width").to_pylist() for w in row])
    heights = np.array([h for row in table.column("image_height").to_pylist() for h in row])
    durations = [d for row in table.column("audio_duration").to_pylist() for d in row]
    longest = np.maximum(widths, heights) if len(widths) else widths
    return {
        "name": index["name"], "directory": directory, **index["totals"],
        "modalities": index["modalities"], "report": index["report"],
        "image": {"width": summary(widths), "height": summary(heights),
                  "megapixels": summary(widths * heights / 1e6) if len(widths) else None,
                  "longest_side_histogram": _histogram(longest, _SIDE_BUCKETS)},
        "audio": {"duration_s": summary(durations), "total_hours": sum(durations) / 3600,
                  "duration_histogram_s": _histogram(durations, _DURATION_BUCKETS)},
    }


def _fmt(stats: dict | None, unit: str = "") -> str:
    if stats is None:
        return "-"
    return (f"min {stats['min']:g}{unit}  p50 {stats['p50']:g}{unit}  p90 {stats['p90']:g}{unit}"
            f"  max {stats['max']:g}{unit}")


def format_info(info: dict) -> str:
    """The info dict as a short human-readable text."""
    mods, report = info["modalities"], info["report"]
    lines = [
        f"dataset   {info['name']}  ({info['directory']})",
        f"samples   {info['samples']}  in {info['shards']} shard(s), {info['bytes'] / 1e6:.1f} MB",
        f"build     {report['records_read']} records read, {report['records_skipped']} skipped",
        f"images    {mods['image']['items']} in {mods['image']['samples']} samples",
        f"audio     {mods['audio']['items']} clips in {mods['audio']['samples']} samples, "
        f"{info['audio']['total_hours'] * 60:.1f} min",
        f"text-only {mods['text_only']['samples']} samples",
        f"width     {_fmt(info['image']['width'], 'px')}",
        f"height    {_fmt(info['image']['height'], 'px')}",
        "longest side  " + "  ".join(f"{k}: {v}" for k, v in
                                    info["image"]["longest_side_histogram"].items()),
        f"duration  {_fmt(info['audio']['duration_s'], 's')}",
        "duration  " + "  ".join(f"{k}s: {v}" for k, v in
                                info["audio"]["duration_histogram_s"].items()),
    ]
    return "\n".join(lines)
