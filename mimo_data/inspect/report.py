"""``mimo-inspect report``: dataset-wide checks on what training will get, metadata only.

Every sample goes through ``SampleInspector`` (the metadata-only preprocessor plus independent
checks, see ``inspect_stats``). The report gives distributions (trained-token fraction, sequence
length, tokens per media item) and the samples that fail a check, by key. Checks and their
default limits (flags of the CLI); a demanding default, since the report gates a launch:

==========================  =================================================  ==============
check                       a sample is counted when                           default limit
==========================  =================================================  ==============
zero_trained                it has no trained token (e.g. prompt only)          fraction 0
dropped                     the preprocessor drops it (any reason)              fraction 0
truncated                   trailing turns are removed to fit ``seq_length``    fraction 0
empty_answer_turns          it trains an empty (or whitespace) answer beside    fraction 0
                            answers with text: its end of turn alone, teaching
                            the model to answer that turn with nothing (all
                            empty: dropped as ``empty_answers``)
reasoning_dropped           its chat template leaves some answers' reasoning    fraction 1
                            out and writes later ones' (Qwen3's, Qwen3.5's:     (reported,
                            before the last user query, as at inference);       off)
                            their text trains
unclosed_think              it trains an answer whose last <think> has no       fraction 0
                            </think> after it: the template writes it as text,
                            teaching the model to open a think block it never
                            closes
trailing_turns              it ends on turns after its last answer (a user's,   fraction 1
                            a tool's): context that trains nothing, often a     (reported,
                            final answer lost in conversion                     off)
template_failures           the template cannot render / round-trip it          count 0
marker_mismatches           its media markers ≠ its media list                  count 0
placeholder_mismatches      modality tokens in input_ids ≠ counts from metadata count 0
index_mismatches            its media list ≠ its row of samples.parquet         count 0
loss_mask_coverage          an assistant content character is not trained, or   count 0
                            a user/system one (or an answer's weighted 0) is
                            (located in the decoded tokens; an answer's
                            reasoning and its text apart where the template
                            takes them apart, its think tags its own)
trained_token_fraction      (dataset) trained / real tokens of kept samples     min 0 (off)
kept_samples                (dataset) fails when no sample is kept              always on
skipped_records             (dataset, first) records ``mimo-shard build`` or    fraction 0
                            ``index`` skipped, in no shard (index.json's
                            counts, report.json's reasons; an Energon
                            split.yaml's excludes counted apart, not failed)
==========================  =================================================  ==============

Drops are counted under ``dropped`` with their reason *and* under the specific check they
fall in, so allowing a few corrupt samples (``--max-dropped-fraction 0.001``) still fails on
a prompt-only one. Media decoding errors are not visible without media: ``mimo-shard build``
and ``mimo-shard verify`` check those. With ``long_audio: truncate`` the kept samples' clips
over ``max_duration`` are counted with the seconds cut off them (``audio_cut``): no check,
their samples train, on the clip's start and the whole transcript.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
import hashlib
import itertools
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from mimo_data.files import write_atomic
from mimo_data.inspect.checks import CHECKS, Thresholds
from mimo_data.inspect.stats import IndexTable, SampleInspector, SampleStats
from mimo_data.loading.token_table import (Rows, TokenTable, assemble, table_key, table_labels,
                                           table_path)
from mimo_data.modalities.audio import AudioConfig, max_audio_samples
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import TEXT_BATCH
from mimo_data.preprocess.segment_tokenizer import SegmentCachedTokenizer
from mimo_data.shards import cache, storage
from mimo_data.preprocess.record_kinds import trains_as
from mimo_data.shards.format import (RECORD_KINDS, REPORT_FILE, SKIPPED_FILE, SPLIT_EXCLUDED,
                                     ShardRecord, record_origin, summary_column)
from mimo_data.shards.info import skipped_counts
from mimo_data.shards.index import DatasetError, read_samples
from mimo_data.shards.reader import ShardReader
from mimo_data.stats import summary

KEYS_IN_JSON = 100      # keys listed per check in the JSON report (the count is always exact)
KEYS_IN_MESSAGE = 5     # first keys named in a failed check's line
DROP = "drop:"          # flags table: names of drop-reason entries (the others: check names)
UNREADABLE = "unreadable_record"    # a report's own drop: training stops at such a record


@dataclass
class Flagged:
    """Samples counted by one check: (position, key, detail), in dataset order."""
    entries: list[tuple[int, str, str]] = field(default_factory=list)

    def add(self, stats: SampleStats, detail: str) -> None:
        self.entries.append((stats.position, stats.key, detail))

    @property
    def keys(self) -> list[str]:
        return [key for _, key, _ in self.entries]


def _histogram(values, edges) -> list[dict]:
    counts, edges = np.histogram(np.asarray(values, dtype=np.float64), bins=edges)
    return [{"lo": float(lo), "hi": float(hi), "count": int(c)}
            for lo, hi, c in zip(edges, edges[1:], counts)]


def _integer_edges(values, bins: int = 16) -> np.ndarray:
    top = int(np.max(values)) if len(values) else 1
    step = max(1, int(np.ceil((top + 1) / bins)))
    return np.arange(0, top + step + 1, step)


class ReportBuilder:
    """Accumulates per-sample stats into the report: the token table's rows (``Rows``) and the
    samples each check flags. The report's numbers come from the token table, so a report
    rebuilt from saved tables (``from_tables``) is the same report."""

    def __init__(self, inspector: SampleInspector):
        self.inspector = inspector
        self.modalities = list(inspector.config.modalities)
        self.rows = Rows(self.modalities)
        self.drop_reasons: dict[str, Flagged] = {}
        self.flagged = {name: Flagged() for name in CHECKS}
        self.seen = 0
        self.table: TokenTable | None = None

    def add(self, stats: SampleStats) -> None:
        self.seen += 1
        self.rows.add(stats.dropped, stats.detail, stats.length, stats.trained, stats.counted,
                      stats.kind)
        flagged = self.flagged
        if stats.dropped:
            flagged["dropped"].add(stats, f"{stats.dropped}: {stats.detail}")
            self.drop_reasons.setdefault(stats.dropped, Flagged()).add(stats, stats.detail)
            if stats.dropped == "no_trained_tokens":
                flagged["zero_trained"].add(stats, stats.detail)
            if stats.template_failure:
                flagged["template_failures"].add(stats, f"{stats.dropped}: {stats.detail}")
        else:
            if stats.removed_turns:
                flagged["truncated"].add(stats, f"{stats.removed_turns} trailing turn(s) removed")
            if stats.empty_answers:
                flagged["empty_answer_turns"].add(
                    stats, f"{stats.empty_answers} empty answer(s) train their end of turn alone")
            if stats.reasoning_dropped:
                flagged["reasoning_dropped"].add(
                    stats, f"{stats.reasoning_dropped} answer(s) train without their reasoning "
                    "(the template writes later answers' reasoning)")
            if stats.unclosed_think:
                flagged["unclosed_think"].add(
                    stats, f"{stats.unclosed_think} answer(s) hold a <think> with no </think> "
                    "after it")
            if stats.trailing_turns:
                flagged["trailing_turns"].add(
                    stats, f"{stats.trailing_turns} turn(s) after the last answer train nothing")
            if stats.placeholder_mismatch:
                flagged["placeholder_mismatches"].add(stats, stats.describe_placeholders())
            if stats.coverage_failure:
                flagged["loss_mask_coverage"].add(stats, "; ".join(stats.coverage_problems))
        if stats.marker_mismatch:
            flagged["marker_mismatches"].add(stats, stats.describe_markers())
        if stats.index_problems:
            flagged["index_mismatches"].add(stats, "; ".join(stats.index_problems))

    def finish(self) -> tuple[pa.Table, pa.Table]:
        """The token table and the flags table of the samples added."""
        table = assemble([self.rows.arrays()], self.modalities)
        self.table = TokenTable(table, self.modalities)
        entries = [(f"{DROP}{reason}", *entry) for reason, f in self.drop_reasons.items()
                   for entry in f.entries]
        entries += [(name, *entry) for name, f in self.flagged.items() for entry in f.entries]
        flags = pa.table({"name": pa.array([e[0] for e in entries], pa.string()),
                          "position": pa.array([e[1] for e in entries], pa.int64()),
                          "key": pa.array([e[2] for e in entries], pa.string()),
                          "detail": pa.array([e[3] for e in entries], pa.string())})
        return table, flags

    @classmethod
    def from_tables(cls, inspector: SampleInspector, table: TokenTable,
                    flags: pa.Table) -> ReportBuilder:
        """The builder of a whole dataset from its saved token and flags tables."""
        builder = cls(inspector)
        builder.table = table
        builder.seen = len(table)
        for name, position, key, detail in zip(*(flags.column(c).to_pylist() for c in
                                                 ("name", "position", "key", "detail"))):
            target = (builder.drop_reasons.setdefault(name.removeprefix(DROP), Flagged())
                      if name.startswith(DROP) else builder.flagged[name])
            target.entries.append((position, key, detail))
        return builder

    def _kept(self) -> tuple[np.ndarray, np.ndarray]:
        """Lengths and trained tokens of the kept samples (int64)."""
        assert self.table is not None, "finish() first"
        kept = self.table.kept
        return (self.table.tokens[kept].astype(np.int64),
                self.table.trained[kept].astype(np.int64))

    def _media_tokens(self, modality: str) -> tuple[np.ndarray, np.ndarray]:
        """Tokens per item and per sample with items, of the kept samples."""
        assert self.table is not None, "finish() first"
        offsets, values = self.table.item_tokens[modality]
        items = np.diff(offsets)
        kept = self.table.kept
        per_item = values[np.repeat(kept, items)].astype(np.int64)
        with_items = kept & (items > 0)
        per_sample = (np.add.reduceat(values.astype(np.int64), offsets[:-1][with_items])
                      if with_items.any() else np.zeros(0, np.int64))
        return per_item, per_sample

    def _kinds(self) -> dict:
        """Per record kind present, what its samples train as and how many are kept."""
        assert self.table is not None, "finish() first"
        kinds = self.table.kinds
        found = {}
        for code in np.unique(kinds).tolist():
            kind = RECORD_KINDS[code] if code >= 0 else "unknown"
            ours = kinds == code
            found[kind] = {"trains_as": trains_as(kind, self.inspector.config),
                           "samples": int(ours.sum()),
                           "kept": int((ours & self.table.kept).sum())}
        return found

    def checks(self, thresholds: Thresholds, origin: Callable[[int], str] | None = None
               ) -> list[dict]:
        """Each check's result; ``origin``: where the sample at a position was read from
        (named beside its key in the message)."""
        results = []
        total = self.seen
        for name, (limit_name, kind, what) in CHECKS.items():
            flagged = self.flagged[name]
            count = len(flagged.entries)
            limit = getattr(thresholds, limit_name)
            fraction = count / total if total else 0.0
            passed = (fraction <= limit) if kind == "fraction" else (count <= limit)
            result = {"name": name, "passed": passed, "count": count, "of": total,
                      "fraction": fraction, "limit": limit, "limit_kind": kind,
                      "flag": "--" + limit_name.replace("_", "-"), "what": what,
                      "keys": flagged.keys[:KEYS_IN_JSON]}
            if name == "dropped":
                result["by_reason"] = {r: len(f.entries) for r, f in
                                       sorted(self.drop_reasons.items())}
            result["message"] = _check_message(result, flagged, origin)
            results.append(result)
        lengths, trained_tokens = self._kept()
        kept = len(lengths)
        results.append({
            "name": "kept_samples", "passed": kept > 0, "count": kept, "of": total,
            "fraction": kept / total if total else 0.0, "limit": 1, "limit_kind": "min_count",
            "flag": None, "what": "samples training would get", "keys": [],
            "message": f"kept_samples: {kept} of {total} samples would be trained on"
                       + ("" if kept else " (nothing to train on)")})
        real, trained = int(lengths.sum()), int(trained_tokens.sum())
        fraction = trained / real if real else 0.0
        passed = fraction >= thresholds.min_trained_token_fraction
        results.append({
            "name": "trained_token_fraction", "passed": passed, "count": trained, "of": real,
            "fraction": fraction, "limit": thresholds.min_trained_token_fraction,
            "limit_kind": "min_fraction", "flag": "--min-trained-token-fraction",
            "what": "trained tokens among the real (unpadded) tokens of kept samples",
            "keys": [],
            "message": (f"trained_token_fraction: {trained} of {real} real tokens are trained "
                        f"({fraction:.2%}), " + ("at least" if passed else "below") +
                        " --min-trained-token-fraction "
                        f"{thresholds.min_trained_token_fraction:g}")})
        return results

    def to_dict(self, thresholds: Thresholds, origin: Callable[[int], str] | None = None
                ) -> dict:
        config = self.inspector.config
        lengths, trained_tokens = self._kept()
        kept = len(lengths)
        real, trained = int(lengths.sum()), int(trained_tokens.sum())
        fractions = trained_tokens[lengths > 0] / lengths[lengths > 0]
        media = {m: self._media_tokens(m) for m in config.modalities}
        report = {
            "samples": self.seen, "kept": kept, "dropped": self.seen - kept,
            "seq_length": config.seq_length, "length_policy": config.length_policy,
            "mode": config.mode,
            "append_eos": self.inspector.text.eos_appending.to_dict(),
            "kinds": self._kinds(),
            "tokens": {"real": real, "trained": trained,
                       "trained_fraction": trained / real if real else 0.0,
                       "padding": kept * config.seq_length - real,
                       "padding_fraction": (1 - real / (kept * config.seq_length))
                       if kept else 0.0},
            "trained_fraction": {"stats": summary(fractions),
                                 "histogram": _histogram(fractions, np.linspace(0, 1, 11))},
            "sequence_length": {"stats": summary(lengths), "histogram": _histogram(
                lengths, np.linspace(0, config.seq_length, 17).round())},
            "modalities": {m: {"items": len(per_item), "samples": len(per_sample),
                               "tokens": int(per_item.sum()),
                               "tokens_per_item": {
                                   "stats": summary(per_item),
                                   "histogram": _histogram(per_item, _integer_edges(per_item))},
                               "tokens_per_sample": {"stats": summary(per_sample)}}
                           for m, (per_item, per_sample) in media.items()},
            "drop_reasons": {reason: {"count": len(f.entries),
                                      "first": [{"key": k, "detail": d}
                                                for _, k, d in f.entries[:KEYS_IN_MESSAGE]]}
                             for reason, f in sorted(self.drop_reasons.items())},
            "flagged": {name: [{"key": k, "position": p, "detail": d}
                               for p, k, d in f.entries[:KEYS_IN_JSON]]
                        for name, f in self.flagged.items()},
        }
        checks = self.checks(thresholds, origin)
        report["checks"] = checks
        report["passed"] = all(c["passed"] for c in checks)
        report["thresholds"] = asdict(thresholds)
        return report


def _check_message(result: dict, flagged: Flagged,
                   origin: Callable[[int], str] | None = None) -> str:
    kind = result["limit_kind"]
    count, total = result["count"], result["of"]
    if kind == "fraction":
        head = (f"{result['name']}: {count} of {total} samples ({result['fraction']:.2%}) "
                f"{result['what'].removeprefix('samples ')}, "
                + ("within" if result["passed"] else "above") +
                f" {result['flag']} {result['limit']:g}")
    else:
        head = (f"{result['name']}: {count} {result['what']}, "
                + ("within" if result["passed"] else "above") +
                f" {result['flag']} {result['limit']:g}")
    if "by_reason" in result and result["by_reason"]:
        head += " (" + ", ".join(f"{r} {n}" for r, n in result["by_reason"].items()) + ")"
    if count:
        first = flagged.entries[:KEYS_IN_MESSAGE]
        wheres = [origin(position) if origin else "" for position, _, _ in first]
        # the first sample's detail of each kind whole (what to do is at its end: a drop's
        # detail starts with its reason), the others' cut short
        kinds: set[str] = set()
        shown = []
        for where, (_, key, detail) in zip(wheres, first):
            kind = detail.split(":", 1)[0]
            shown.append(f"{key} ({where + ': ' if where else ''}"
                         f"{_short(detail) if kind in kinds else detail})")
            kinds.add(kind)
        head += "; first: " + ", ".join(shown)
    return head


def _short(detail: str, limit: int = 120) -> str:
    """``detail`` cut at a word before ``limit`` characters, marked as cut."""
    return detail if len(detail) <= limit else detail[:limit].rsplit(" ", 1)[0] + " …"


def _read_record(reader: ShardReader, position: int) -> ShardRecord | SampleStats:
    """The record at ``position``, or the stats of a record the loader could not read."""
    try:
        return reader.record(position)
    except (ValueError, UnicodeDecodeError) as exc:      # JSON the loader could not read
        return SampleStats(position, reader.table.key(position), dropped=UNREADABLE,
                           detail=f"the sample's JSON cannot be parsed: {exc}")


def inspect_position(reader: ShardReader, inspector: SampleInspector, index: IndexTable,
                     position: int):
    """(SampleStats, record or None, Sample or None) of the sample at ``position``."""
    record = _read_record(reader, position)
    if isinstance(record, SampleStats):
        return record, None, None
    stats, sample = inspector(position, record, index)
    return stats, record, sample


def inspect_range(reader: ShardReader, inspector: SampleInspector, index: IndexTable,
                  start: int, stop: int):
    """SampleStats of the samples at positions [start, stop), in order, their text prepared
    a batch at a time."""
    for chunk in range(start, stop, TEXT_BATCH):
        positions = range(chunk, min(stop, chunk + TEXT_BATCH))
        records = [_read_record(reader, p) for p in positions]
        readable = [(p, r) for p, r in zip(positions, records)
                    if not isinstance(r, SampleStats)]
        stats = iter(inspector.batch([p for p, _ in readable], [r for _, r in readable], index))
        for record in records:
            yield record if isinstance(record, SampleStats) else next(stats)


# One inspector per worker process, built once by _init_worker.
_WORKER: dict = {}


def _init_worker(directory: str, config, cache_tokens: bool, cache_dir: str | None) -> None:
    import torch
    torch.set_num_threads(1)
    with fewer_gc_passes():
        _WORKER.update(reader=ShardReader(directory, cache_dir), index=IndexTable(directory),
                       inspector=SampleInspector(config, cache_tokens=cache_tokens))


def _inspect_chunk(bounds: tuple[int, int]) -> list[SampleStats]:
    reader, index, inspector = _WORKER["reader"], _WORKER["index"], _WORKER["inspector"]
    with fewer_gc_passes():
        return list(inspect_range(reader, inspector, index, *bounds))


@contextlib.contextmanager
def fewer_gc_passes(young: int = 20_000):
    """Run the cyclic garbage collector's youngest generation every ``young`` allocations
    instead of CPython's 700, and leave the objects that exist before (imported modules, the
    tokenizer: a few hundred thousand) out of its full passes (``gc.freeze``, unless the
    process froze some itself). A report allocates a few dozen short-lived containers per
    sample (JSON records, stats), and reading the index tables a few per sample: with the
    defaults, collections took 25-35% of a report's time (measured on 10k samples). The same
    garbage is collected, later."""
    threshold = gc.get_threshold()
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    gc.set_threshold(max(young, threshold[0]), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


def _parallel_stats(directory: str, inspector: SampleInspector, total: int, workers: int,
                    cache_dir: str | None):
    """SampleStats in dataset order, computed by ``workers`` processes in chunks
    (``worker_pool.ordered_map``: forked from the forkserver, the caller may be threaded)."""
    from mimo_data.worker_pool import ordered_map

    chunk = max(1, min(1000, -(-total // (workers * 4))))
    bounds = ((start, min(start + chunk, total)) for start in range(0, total, chunk))
    cache_tokens = isinstance(inspector.text.backend, SegmentCachedTokenizer)
    for stats_list in ordered_map(
            _inspect_chunk, bounds, workers, 2 * workers, initializer=_init_worker,
            describe=lambda bound: f"samples {bound[0]} to {bound[1] - 1}",
            initargs=(directory, inspector.config, cache_tokens, cache_dir),
            advice="report again with fewer --workers, or --workers 0 to inspect in this "
            "process and see the failure"):
        yield from stats_list


def inspect_dataset(reader: ShardReader, inspector: SampleInspector, *,
                    limit: int | None = None, progress: bool = True, workers: int = 1,
                    on_stats=None, cache_dir: str | None = None) -> ReportBuilder:
    """Run every sample of ``reader`` (the first ``limit``) through the inspector into a
    ReportBuilder, in this process or in ``workers`` processes (which open the dataset with
    ``cache_dir``). ``on_stats(stats)`` sees each sample's stats in dataset order (e.g. to
    pick the HTML gallery)."""
    builder = ReportBuilder(inspector)
    with fewer_gc_passes():
        total = len(reader) if limit is None else min(limit, len(reader))
        if workers > 1 and total > 1:
            stream = _parallel_stats(reader.directory, inspector, total, workers, cache_dir)
        else:
            stream = inspect_range(reader, inspector, IndexTable(reader.directory), 0, total)
        # closed on an error or Ctrl-C: the workers stop now, not at the exit's wait
        with contextlib.closing(stream):
            for stats in tqdm(stream, total=total, desc="mimo-inspect report", unit=" samples",
                              disable=not progress, mininterval=0.5, dynamic_ncols=True):
                builder.add(stats)
                if on_stats:
                    on_stats(stats)
    return builder


def build_report(directory: str, inspector: SampleInspector, thresholds: Thresholds, *,
                 limit: int | None = None, progress: bool = True, workers: int = 1,
                 on_stats=None, cache_dir: str | None = None, reuse: bool = True,
                 started: float | None = None) -> dict:
    """The report dict (see ``ReportBuilder.to_dict``) of a dataset directory.

    A whole-dataset report saves the token table training uses (unless it is there already)
    and the flagged samples beside it; the next report of the same dataset, preprocessing and
    inspection code is made from those tables, without running a sample (unless ``reuse`` is
    False, or with ``on_stats``, which needs every sample's stats). ``started``: the
    command's ``time.perf_counter()`` at its start, from which the report's ``seconds`` count
    (its config's and tokenizer's loading included; default: this call's start)."""
    start = time.perf_counter() if started is None else started
    reader = ShardReader(directory, cache_dir)
    modalities = list(inspector.config.modalities)
    key = table_key(reader, inspector.preprocessor)
    tokens_path = table_path(reader, key, cache_dir)
    flags_key = _flags_key(key)
    flags_path = os.path.join(os.path.dirname(tokens_path), f"report-{flags_key[:24]}.arrow")
    saved = cache.read_table(tokens_path, key)
    builder = None
    # a shard lost or cut short fails the report as it fails the run's start-up (a stat or
    # a listing each): the saved tables describe the shards as they were, and a bucket
    # dataset's samples are inspected from its tables (its records' and media's metadata)
    # without a read of its shards
    try:
        reader.check_shards()
    except DatasetError:
        reader.close()
        raise
    if reuse and limit is None and on_stats is None and saved is not None:
        flags = cache.read_table(flags_path, flags_key)
        if flags is not None:
            builder = ReportBuilder.from_tables(inspector, TokenTable(saved, modalities), flags)
            reader.close()
    reused = builder is not None
    if builder is None:
        try:
            builder = inspect_dataset(reader, inspector, limit=limit, progress=progress,
                                      workers=workers, on_stats=on_stats, cache_dir=cache_dir)
        finally:
            reader.close()
        token_data, flags = builder.finish()
        # Saved for training only when it is what training computes: training stops at an
        # unreadable record, which a report counts.
        if limit is None and UNREADABLE not in builder.drop_reasons:
            if saved is None:
                cache.save_table(tokens_path, token_data, key,
                                 table_labels(reader, inspector.preprocessor))
            cache.save_table(flags_path, flags, flags_key,
                             table_labels(reader, inspector.preprocessor, "report"))
    named = ShardReader(directory, cache_dir)     # the first flagged samples' sources
    try:
        report_dict = builder.to_dict(
            thresholds, lambda position: record_origin(record)
            if isinstance(record := _read_record(named, position), dict) else "")
    finally:
        named.close()
    skipped = skipped_records(directory, reader.index, thresholds)
    report_dict["checks"].insert(0, skipped)
    report_dict["passed"] = report_dict["passed"] and skipped["passed"]
    assert builder.table is not None
    cut = audio_cut(directory, builder.table.kept, inspector.config)
    if cut is not None:
        report_dict["modalities"]["audio"]["cut"] = cut
    seconds = time.perf_counter() - start
    report = {"dataset": directory, "total_samples": len(reader), "limit": limit,
              "workers": workers,
              # how the build checked the media (``--check``): headers only leaves a clip that
              # does not decode to stop training when it is loaded
              "media_check": reader.index.get("build", {}).get("check", "decode"),
              **report_dict, "seconds": seconds,
              "samples_per_second": builder.seen / seconds if seconds else None,
              "tables": {"token_table": tokens_path, "flags": flags_path, "reused": reused}}
    backend = inspector.text.backend
    if isinstance(backend, SegmentCachedTokenizer) and workers <= 1 and not reused:
        report["token_cache"] = {"pieces_cached": backend.hits, "pieces_encoded": backend.misses}
    return report


def skipped_records(directory: str, index: dict, thresholds: Thresholds) -> dict:
    """The check of the records ``mimo-shard build`` or ``index`` skipped before any sample
    was written (``index``: the dataset's index.json): they are in no shard, so no other
    check sees them."""
    built = index.get("report", {})
    read, skipped = int(built.get("records_read", 0)), int(built.get("records_skipped", 0))
    counts = skipped_counts(directory, built)
    # an Energon split.yaml's excludes are the dataset's own choice, counted but not failed
    # (index.json records them; an index before it did, its report.json)
    chosen = counts.pop(SPLIT_EXCLUDED, 0)
    chosen = int(built.get("records_excluded", chosen))
    skipped -= chosen
    limit = thresholds.max_skipped_records_fraction
    fraction = skipped / read if read else 0.0
    passed = fraction <= limit
    reasons = f" ({', '.join(f'{r} {n}' for r, n in counts.items())})" if counts else ""
    first = _first_skipped(directory) if skipped and not passed else ""
    said = (f"skipped_records: {skipped} of {read} records ({fraction:.2%}) skipped by the "
            f"build or index{reasons}, {'within' if passed else 'above'} "
            f"--max-skipped-records-fraction {limit:g}" +
            (f"; {first}" if first else "") +
            (f"; {_where_named(directory)}" if skipped else "") +
            (f"; {chosen} more left out by its split.yaml's excludes" if chosen else "")
            if read else "skipped_records: the dataset's index records no count of the "
            "records its build read (written before it did)")
    return {"name": "skipped_records", "passed": passed, "count": skipped, "of": read,
            "fraction": fraction, "limit": limit, "limit_kind": "fraction",
            "flag": "--max-skipped-records-fraction", "by_reason": counts,
            "excluded_by_split_yaml": chosen, "keys": [],
            "what": "records the build or index skipped (in no shard: skipped.jsonl beside "
                    "the index names them)",
            "message": said}


def _first_skipped(directory: str, shown: int = 3) -> str:
    """``shown`` records the build of ``directory`` skipped, the first of each reason first,
    as its report.json (a small file) names them: where it read each, its id, and why; ""
    where it cannot say."""
    try:
        by_reason = json.loads(storage.read_bytes(storage.join(directory, REPORT_FILE)))[
            "skipped_by_reason"]
        firsts = [[(reason, entry) for entry in by["first"]]
                  for reason, by in by_reason.items() if reason != SPLIT_EXCLUDED]
        first = [each for rank in itertools.zip_longest(*firsts) for each in rank
                 if each is not None][:shown]
        return "e.g. " + ", ".join(
            f"{entry['location']}" + (f" (id {entry['id']})" if "id" in entry else "") +
            f" {reason}" for reason, entry in first) if first else ""
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""


def _where_named(directory: str) -> str:
    """Where the records ``directory``'s build or index skipped are named: every one in its
    skipped.jsonl, or, a dataset written before it (or the list removed), the first five of
    each reason in its report.json."""
    listed = storage.join(directory, SKIPPED_FILE)
    return f"{listed} names each" if storage.exists(listed) else \
        f"{storage.join(directory, REPORT_FILE)} names the first five of each reason"


def audio_cut(directory: str, kept: np.ndarray, config: PreprocessConfig) -> dict | None:
    """The clips of the kept samples (``kept``: one flag per sample from the first) that
    ``long_audio: truncate`` cuts to ``max_duration``, from samples.parquet's durations: how
    many, in how many samples, the seconds cut off, the first samples' keys and clips; None
    unless the config truncates audio."""
    audio = config.modalities.get("audio")
    if not isinstance(audio, AudioConfig) or audio.long_audio != "truncate":
        return None
    limit = max_audio_samples(audio) / audio.sample_rate
    found = {"clips": 0, "samples": 0, "max_duration": limit, "seconds_cut": 0.0, "first": []}
    column = summary_column("audio", "duration")
    names = read_samples(directory, lambda path: pq.read_schema(path).names)
    if column not in names:
        return found                                # a dataset built before audio: no clip
    table = read_samples(directory, lambda path: pq.read_table(
        path, columns=["key", column, *(["source"] if "source" in names else [])])
    ).slice(0, len(kept))
    lists = table.column(column).combine_chunks()
    counts = pc.list_value_length(lists).fill_null(0).to_numpy()
    durations = pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.float64)
    sample_of = np.repeat(np.arange(len(kept)), counts)
    cut = kept[sample_of] & (durations > limit)
    samples = np.unique(sample_of[cut])
    found.update(clips=int(cut.sum()), samples=len(samples),
                 seconds_cut=float((durations[cut] - limit).sum()),
                 first=[{"key": table.column("key")[int(p)].as_py(),
                         "source": table.column("source")[int(p)].as_py()
                         if "source" in names else None,
                         "durations": durations[cut & (sample_of == p)].tolist()}
                        for p in samples[:KEYS_IN_MESSAGE]])
    return found


def cut_line(cut: dict) -> str:
    """``audio_cut`` in words."""
    line = (f"{cut['clips']} clip(s) over max_duration {cut['max_duration']:g} s cut to it "
            f"(long_audio: truncate) in {cut['samples']} sample(s), {cut['seconds_cut']:.1f} s "
            "of audio dropped")
    if cut["clips"]:
        line += ("; each keeps its whole transcript; first: " + ", ".join(
            f"{entry['key']} ({entry['source']}: "
            f"{', '.join(f'{d:.1f} s' for d in entry['durations'])})"
            for entry in cut["first"]))
    return line


def _flags_key(token_key: str) -> str:
    """The flags table depends on the token table's inputs and the inspection code."""
    digest = hashlib.sha256(token_key.encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def format_report(report: dict) -> str:
    """A short text summary of the report for people."""
    def fmt(stats, digits=0):
        if stats is None:
            return "-"
        return "  ".join(f"{k} {stats[k]:.{digits}f}" for k in ("min", "p10", "p50", "p90",
                                                                "max"))
    tokens = report["tokens"]
    lines = [
        f"dataset     {report['dataset']}: {report['samples']} of {report['total_samples']} "
        f"samples inspected, seq_length {report['seq_length']}, {report['length_policy']}",
        *([f"media       built with --check header: no image or clip was decoded, and one "
           "that does not decode stops training when it is loaded; `mimo-shard verify "
           f"{report['dataset']}` decodes every one"]
          if report.get("media_check") == "header" else []),
        f"samples     {report['kept']} kept, {report['dropped']} dropped"
        + (" (" + ", ".join(f"{r} {d['count']}" for r, d in report["drop_reasons"].items()) + ")"
           if report["drop_reasons"] else ""),
        f"tokens      {tokens['real']} real, {tokens['trained']} trained "
        f"({tokens['trained_fraction']:.1%}), padding {tokens['padding_fraction']:.1%} of "
        "the kept samples' seq_length",
        f"kinds       {kinds_line(report['kinds'])}",
        f"end of turn {eos_line(report['append_eos'])}",
        f"length      {fmt(report['sequence_length']['stats'])}",
        f"trained     fraction per sample  {fmt(report['trained_fraction']['stats'], 2)}",
    ]
    for modality, data in report["modalities"].items():
        lines.append(f"{modality:11s} {data['items']} items in {data['samples']} samples, "
                     f"{data['tokens']} tokens; per item {fmt(data['tokens_per_item']['stats'])}")
        if "cut" in data:
            lines.append(f"{'':11s} {cut_line(data['cut'])}")
    lines.append("length histogram (tokens: samples)")
    top = max((b["count"] for b in report["sequence_length"]["histogram"]), default=0)
    for b in report["sequence_length"]["histogram"]:
        bar = "#" * (round(40 * b["count"] / top) if top else 0)
        lines.append(f"  {int(b['lo']):6d}-{int(b['hi']):<6d} {b['count']:7d} {bar}")
    lines.append("checks")
    for check in report["checks"]:
        lines.append(f"  {'PASS' if check['passed'] else 'FAIL'}  {check['message']}")
    rate = report.get("samples_per_second")
    if report["tables"]["reused"]:
        lines.append(f"time        {report['seconds']:.2f} s, from the tables saved by an "
                     "earlier report (--recompute inspects every sample again)")
    elif rate:
        # the whole command's, start-up included: the progress bar's rate is the stream's
        shown = f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"    # not 0 on a few samples
        lines.append(f"time        {report['seconds']:.2f} s in all, {shown} samples/s "
                     "overall (the config's and tokenizer's loading and the summaries "
                     "included)")
    return "\n".join(lines)


def kinds_line(kinds: dict) -> str:
    """The record kinds in words: ``conversation 8 (8 kept), caption 3 as caption (plain)``."""
    return ", ".join(f"{kind} {data['samples']} ({data['kept']} kept)"
                     + (f" as {data['trains_as']}" if data["trains_as"] != kind else "")
                     for kind, data in kinds.items())


def eos_line(appending: dict) -> str:
    """``append_eos`` in words: whether a trained EOS is appended after each answer, and why."""
    action = (f"{appending['token']} appended after each answer (trained)" if appending["on"]
              else "no EOS appended")
    return f"append_eos {str(appending['setting']).lower()}: {action}; {appending['reason']}"


def failure_lines(report: dict) -> list[str]:
    """One line per failed check, for stderr."""
    return [f"mimo-inspect report: FAIL {c['message']}" for c in report["checks"]
            if not c["passed"]]


def write_json(report: dict, path: str) -> None:
    """``report`` as indented JSON at ``path``, whole or not at all (a launch gate reads it)."""
    write_atomic(path, (json.dumps(report, indent=2) + "\n").encode())
