"""What a dataset's caches hold, and which of it is superseded (``mimo-shard cache``).

A derived table is superseded, and never read again, when:

- it was derived from another build of the dataset (its ``dataset`` label is not the current
  samples.parquet's sha256: the dataset was rebuilt in place);
- a newer table of the same kind and purpose exists for the current build in the same
  directory (the code, a library or a format changed since, and the table was computed again
  under a new key);
- it carries no labels and is not the current sample table (an earlier mimo wrote it, under a
  key this version no longer computes);
- it does not open (damaged: it would be computed again), or it is a temporary file older than
  ``STALE_TEMPORARY_S`` (a write that was interrupted).

Everything else is current, and kept. A table for a preprocessing config nobody uses any more
looks current here (only its users know): ``--remove`` leaves it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pyarrow as pa

from mimo_data.shards import cache
from mimo_data.shards.index import read_index
from mimo_data.shards.sample_table import build_digest, file_name
from mimo_data.shards.sample_table import table_key as sample_table_key

STALE_TEMPORARY_S = 3600             # a temporary file this old is no write in progress
CURRENT = "current"


@dataclass(frozen=True)
class Entry:
    path: str
    size: int
    kind: str                        # a Labels.kind, or "?" when unknown
    about: str
    status: str                      # CURRENT, or why the file is superseded

    @property
    def superseded(self) -> bool:
        return self.status != CURRENT


def directories(dataset: str, cache_dir: str | None = None) -> list[str]:
    """The cache directories of ``dataset`` that exist: its own and the one in ``cache_dir``
    (``MIMO_CACHE_DIR`` first, then the default cache)."""
    root = cache.environment_cache() or cache_dir
    candidates = [os.path.join(dataset, cache.DATASET_CACHE),
                  cache.external_directory(dataset, root)]
    return [path for i, path in enumerate(candidates)
            if os.path.isdir(path) and path not in candidates[:i]]


def entries(dataset: str, cache_dir: str | None = None) -> list[Entry]:
    """Every file in ``dataset``'s cache directories, with its status."""
    index = read_index(dataset)
    build = build_digest(index, dataset)
    sample_table = file_name(sample_table_key(index, dataset))
    # (path, size, modified, labels, verdict): a verdict decided without labels, or ""
    found: list[tuple[str, int, float, cache.Labels | None, str]] = []
    for directory in directories(dataset, cache_dir):
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                stat = os.stat(path)
                found.append((path, stat.st_size, stat.st_mtime, *_read_labels(path)))
    newest: dict[tuple[str, str, str], float] = {}      # per directory: each is a cache
    for path, _, modified, labels, verdict in found:
        if labels and not verdict and labels.dataset == build:
            group = (os.path.dirname(path), labels.kind, labels.purpose)
            newest[group] = max(newest.get(group, modified), modified)
    result = []
    for path, size, modified, labels, verdict in found:
        if verdict:
            status = verdict
        elif labels is None:
            status = CURRENT if os.path.basename(path) == sample_table else \
                "written by an earlier mimo under a key this version does not compute"
        elif labels.dataset != build:
            status = "derived from an earlier build of the dataset"
        elif modified < newest[(os.path.dirname(path), labels.kind, labels.purpose)]:
            status = ("a newer table replaced it (the code, a library or the format changed "
                      "since)")
        else:
            status = CURRENT
        kind = labels.kind if labels else ("samples" if os.path.basename(path).startswith(
            "samples-") else "?")
        result.append(Entry(path, size, kind, labels.about if labels else "", status))
    return result


def _read_labels(path: str) -> tuple[cache.Labels | None, str]:
    """(labels, "") of a table file; (None, its status) for a temporary or damaged file (a
    recent temporary file is CURRENT: a write in progress, maybe); (None, "") for a table
    written without labels."""
    if ".tmp-" in os.path.basename(path):
        if time.time() - os.path.getmtime(path) < STALE_TEMPORARY_S:
            return None, CURRENT                   # a write in progress, maybe
        return None, "a temporary file left by an interrupted write"
    try:
        with pa.memory_map(path) as source:
            metadata = pa.ipc.open_file(source).schema.metadata or {}
    except (pa.ArrowInvalid, OSError):
        return None, "unreadable (damaged: it would be computed again)"
    return cache.Labels.of(metadata), ""


def remove(superseded: list[Entry]) -> int:
    """Delete the files of ``superseded`` entries; the bytes freed."""
    freed = 0
    for entry in superseded:
        try:
            os.remove(entry.path)
        except FileNotFoundError:          # another process removed it meanwhile
            continue
        freed += entry.size
    return freed
