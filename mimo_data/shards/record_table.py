"""The records table: every sample's JSON record (the bytes of ``KEY.json``) as one Arrow binary
column in sample order, memory-mapped.

A reader of a remote dataset takes its records from here, so a language rank, which needs
nothing but the records, makes no request per sample, and an encoder rank requests media
bytes only. ``mimo-shard build`` writes the table into the dataset's ``.mimo-cache/``; a remote
reader downloads it once into its local cache (one request). A dataset built without one gets
it derived once from the shards by ranged reads of the JSON members (``ShardReader.prefetch``
coalesces neighbours). A dataset indexed in place (``mimo-shard index``) has no JSON members: its
records are in its ``records.parquet``, which the table is derived from (for every reader, local
ones too). Keyed by the build, as the sample table is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mimo_data.shards import cache, storage
from mimo_data.shards.format import RECORDS_FILE
from mimo_data.shards.index import DatasetError

SCHEMA = pa.schema([("json", pa.large_binary())])
_DERIVE_BATCH = 4096                 # records requested together when deriving the table


def file_name(key: str) -> str:
    return f"records-{key[:19]}.arrow"


class MemberSource(Protocol):
    """What the table is derived from: a dataset's shards read by position
    (``reader.ShardReader``)."""
    directory: str
    index: dict
    table_key: str
    remote: storage.Remote | None

    def __len__(self) -> int: ...

    def prefetch(self, positions: Iterable[int],
                 members: Callable[[str], bool] | None = None) -> None: ...

    def read_member(self, position: int, name: str) -> bytes: ...


def labels(key: str) -> cache.Labels:
    return cache.Labels("records", key.split("-", 1)[1])


class RecordWriter:
    """The records of a build, streamed to ``path`` (an Arrow stream) as they are written;
    ``finish`` makes the table file of them."""

    BATCH = 8192

    def __init__(self, path: str):
        self.path = path
        self._writer = pa.ipc.new_stream(path, SCHEMA)
        self._records: list[bytes] = []

    def add(self, record: bytes) -> None:
        self._records.append(record)
        if len(self._records) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._records:
            self._writer.write_batch(pa.record_batch([pa.array(self._records,
                                                               pa.large_binary())], SCHEMA))
            self._records = []

    def finish(self, folder: str, key: str) -> None:
        """Write the table into ``folder`` under ``key`` and remove the stream."""
        self._flush()
        self._writer.close()
        with pa.memory_map(self.path) as source:
            table = pa.ipc.open_stream(source).read_all()
            cache.write_table(os.path.join(folder, file_name(key)), table, key, labels(key))
        os.remove(self.path)


def from_parquet(parquet) -> pa.Table:
    """The records table of an indexed dataset's ``records.parquet`` (a path or file)."""
    return pq.read_table(parquet, schema=SCHEMA)


def write(parquet: str, folder: str, key: str) -> None:
    """Derive the records table of ``parquet`` and write it into ``folder``."""
    cache.write_table(os.path.join(folder, file_name(key)), from_parquet(parquet), key,
                      labels(key))


def derive(reader: MemberSource) -> pa.Table:
    """The records table of ``reader``'s dataset: from its records.parquet when it has one
    (indexed in place), else read from its shards' JSON members."""
    if RECORDS_FILE in reader.index.get("files", {}):
        return from_parquet(storage.readable(storage.join(reader.directory, RECORDS_FILE),
                                             reader.remote.options if reader.remote else None))
    chunks = []                      # one Arrow array per batch: no Python object per sample
    for first in range(0, len(reader), _DERIVE_BATCH):
        positions = range(first, min(first + _DERIVE_BATCH, len(reader)))
        reader.prefetch(positions, lambda name: name == "json")
        chunks.append(pa.array([reader.read_member(position, "json") for position in positions],
                               pa.large_binary()))
    return pa.Table.from_batches([pa.record_batch([chunk], SCHEMA) for chunk in chunks], SCHEMA)


class RecordTable:
    """Records by position, from the memory-mapped table (no Python object per sample)."""

    def __init__(self, path: str | None, table: pa.Table):
        self.path = path              # None: the table lives in memory (it could not be saved)
        self.arrow = table
        column = cache.column(table, "json")
        _, offsets, data = column.buffers()
        self._offsets = np.frombuffer(offsets, np.int64)[column.offset:] if offsets \
            else np.zeros(1, np.int64)
        self._data = memoryview(data) if data else memoryview(b"")

    @classmethod
    def open(cls, reader: MemberSource, cache_dir: str | None = None) -> RecordTable:
        key = reader.table_key
        table, path = cache.obtain(reader.directory, file_name(key), key, labels(key),
                                   lambda: derive(reader), cache_dir, reader.remote)
        if table.num_rows != len(reader):
            raise DatasetError(f"{reader.directory}: its records table has {table.num_rows} "
                               f"rows for {len(reader)} samples; rebuild the dataset")
        return cls(path, table)

    def __reduce__(self):
        # spawned DataLoader workers map the file again instead of receiving its bytes
        return (RecordTable, (None, self.arrow)) if self.path is None else \
            (_mapped, (self.path,))

    def __getitem__(self, position: int) -> bytes:
        start, stop = self._offsets[position], self._offsets[position + 1]
        return bytes(self._data[start:stop])


def _mapped(path: str) -> RecordTable:
    return RecordTable(path, cache.mapped(path))
