"""`mimo-shard info`: what a dataset holds, from index.json and samples.parquet (and the
report's reasons for what it skipped)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq

from mimo_data.modalities import MODALITIES
from mimo_data.shards import storage
from mimo_data.shards.index import read_index, read_samples
from mimo_data.stats import size_text
from mimo_data.shards.format import (FAILED_REPORT_FILE, REPORT_FILE, STAGING_DIR,
                                    summary_column)
from mimo_data.stats import summary

_SIDE_BUCKETS = (0, 256, 512, 1024, 2048)            # longest side, pixels
_DURATION_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)  # clip duration, seconds


def _histogram(values, edges) -> dict[str, int]:
    labels = [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])] + [f">={edges[-1]}"]
    counts = np.bincount(np.searchsorted(edges, values, side="right") - 1,
                         minlength=len(edges)) if len(values) else [0] * len(edges)
    return {label: int(count) for label, count in zip(labels, counts)}  # type: ignore[call-overload]


def _modality_stats(values: dict[str, np.ndarray]) -> dict:
    """Distributions of one modality's summary fields: sizes (``width``/``height``: their
    summaries, megapixels, longest side) and durations (summary, total, histogram)."""
    stats: dict = {}
    if "width" in values and "height" in values:
        widths, heights = values["width"], values["height"]
        stats.update(width=summary(widths), height=summary(heights),
                     megapixels=summary(widths * heights / 1e6) if len(widths) else None,
                     longest_side_histogram=_histogram(np.maximum(widths, heights),
                                                       _SIDE_BUCKETS))
    if "duration" in values:
        durations = values["duration"]
        stats.update(duration_s=summary(durations), total_hours=float(durations.sum()) / 3600,
                     duration_histogram_s=_histogram(durations, _DURATION_BUCKETS))
    return stats


def skipped_counts(directory: str, built: dict) -> dict[str, int]:
    """The records the build or index of ``directory`` skipped, by reason (its report.json,
    a small file), where ``built`` (index.json's ``report``) counts any; {} where none, or
    where the report cannot be read (the totals stand; ``verify`` names a damaged report)."""
    if not built.get("records_skipped"):
        return {}
    try:
        skipped = json.loads(storage.read_bytes(storage.join(directory, REPORT_FILE)))
        return {reason: entry["count"] for reason, entry in skipped["skipped_by_reason"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def dataset_info(directory: str) -> dict:
    """Totals, per-modality counts and, per modality, size / duration distributions (of a
    modality its samples.parquet has columns for: a dataset built before it has none)."""
    index = read_index(directory)
    present = set(read_samples(directory, lambda path: pq.read_schema(path).names))
    columns = {(name, field): summary_column(name, field) for name, modality in
               MODALITIES.items() for field in modality.summary_fields}
    columns = {key: column for key, column in columns.items() if column in present}
    table = read_samples(directory, lambda path: pq.read_table(
        path, columns=list(columns.values())))
    values: dict[str, dict[str, np.ndarray]] = {}
    for (name, field), column in columns.items():
        flat = table.column(column).combine_chunks().flatten()
        values.setdefault(name, {})[field] = flat.to_numpy(zero_copy_only=False).astype(
            np.float64)
    report = dict(index["report"])
    counts = skipped_counts(directory, report)
    if counts:
        report["skipped_counts"] = counts
    # an index of tars read where they are: where (its tars are not beside it)
    root = {"shard_root": index["shard_root"]} if index.get("shard_root") else {}
    return {"name": index["name"], "directory": directory, **index["totals"], **root,
            "modalities": index["modalities"], "report": report,
            "beside": [name for name in (FAILED_REPORT_FILE, STAGING_DIR)
                       if storage.exists(storage.join(directory, name))],
            **{name: _modality_stats(fields) for name, fields in values.items()}}


# what a later run left beside the dataset (``swap``), as ``format_info`` says it
_BESIDE = {FAILED_REPORT_FILE: "the report of a later build with --overwrite that kept no "
                               "sample (this dataset stayed as it was; its skipped records "
                               "listed in skipped.failed.jsonl)",
           STAGING_DIR: "a later build's files (running, or it failed or was killed: the next "
                        "build with --overwrite removes them)"}


def _fmt(stats: dict | None, unit: str = "") -> str:
    """A summary's min, p50, p90 and max, each to two decimals (a percentile between two
    durations: 6.99701 s as 7 s)."""
    if stats is None:
        return "-"
    return "  ".join(f"{name} {round(stats[name], 2):g}{unit}"
                     for name in ("min", "p50", "p90", "max"))


def format_info(info: dict) -> str:
    """The info dict as a short human-readable text."""
    mods, report = info["modalities"], info["report"]
    lines = [
        f"name      {info['name']}" + ("" if "shard_root" in info else
                                         " (--name: its shards' prefix)") +
        f"  ({info['directory']})",
        f"samples   {info['samples']}  in {info['shards']} shard(s), {size_text(info['bytes'])}",
        *([f"tars      {info['shard_root']} (indexed where they are; mimo-shard verify checks "
           "they are there as indexed)"] if "shard_root" in info else []),
        f"{'indexed' if 'shard_root' in info else 'build':<9} {report['records_read']} "
        f"record{'s' if report['records_read'] != 1 else ''} "
        f"read, {report['records_skipped']} skipped"
        + (" (" + ", ".join(f"{reason} {count}" for reason, count in
                            report["skipped_counts"].items()) + ")"
           if report.get("skipped_counts") else "")
        + (f", {report['members_ignored']} tar member(s) ignored (links, or of no sample)"
           if report.get("members_ignored") else ""),
    ]
    if report.get("counts"):        # what the samples hold that the build read (format.py)
        lines.append("holds     " + ", ".join(f"{name.replace('_', ' ')}: {number}"
                                              for name, number in report["counts"].items()))
    for name, counts in mods.items():
        if not counts["samples"]:                      # a modality the dataset does not hold
            continue
        if name == "text_only":
            lines.append(f"text-only {counts['samples']} sample"
                         f"{'s' if counts['samples'] != 1 else ''}")
            continue
        stats = info.get(name, {})
        total = "" if "total_hours" not in stats else \
            f", {stats['total_hours'] * 60:.1f} min" if stats["total_hours"] >= 1 / 60 else \
            f", {stats['total_hours'] * 3600:.1f} s"
        lines.append(f"{name:<9} {counts['items']} items in {counts['samples']} samples{total}")
        if "width" in stats:
            lines += [f"  width     {_fmt(stats['width'], 'px')}",
                      f"  height    {_fmt(stats['height'], 'px')}",
                      "  longest side  " + "  ".join(
                          f"{k}: {v}" for k, v in stats["longest_side_histogram"].items())]
        if "duration_s" in stats:
            lines += [f"  duration  {_fmt(stats['duration_s'], 's')}",
                      "  duration  " + "  ".join(
                          f"{k}s: {v}" for k, v in stats["duration_histogram_s"].items())]
    lines += [f"beside    {name}: {_BESIDE[name]}" for name in info.get("beside", [])]
    return "\n".join(lines)
