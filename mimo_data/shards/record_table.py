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

from mimo_data.files import parquet_batches
from mimo_data.shards import cache, column_files, storage
from mimo_data.shards.format import RECORDS_FILE
from mimo_data.shards.index import DatasetError, remake

SCHEMA = pa.schema([("json", pa.large_binary())])
_DERIVE_BATCH = 4096                 # records requested or read together when deriving the table


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
    """The records of a build, streamed into files beside ``path`` as they are written
    (``column_files``); ``finish`` makes the table file of them with no copy of the records
    held (they are as large as the dataset's JSON)."""

    def __init__(self, path: str):
        self._streams = column_files.Streams(path)
        self._records = self._streams.binary("json")

    def add(self, record: bytes) -> None:
        self._records.append(record)

    def add_all(self, records: pa.Array) -> None:
        """Add each record of ``records`` (binary values; no Python object per record)."""
        self._records.add(records)

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        """An interrupted derivation: the streams removed (``finish`` removes them too)."""
        if kind is not None:
            self._streams.close()

    def finish(self, path: str, key: str) -> None:
        """Write the table to ``path`` under ``key`` and remove the streams."""
        with self._streams:
            column = column_files.binary_array(self._streams, self._records, pa.large_binary())
            cache.write_table(path, pa.Table.from_arrays([column], schema=SCHEMA), key,
                              labels(key))


def write(parquet: str, folder: str, key: str) -> None:
    """Derive the records table of ``parquet`` and write it into ``folder``, a Parquet batch at
    a time (no copy of all records held)."""
    path = os.path.join(folder, file_name(key))
    with RecordWriter(path) as records:
        _add_parquet(records, parquet)
        records.finish(path, key)


def _add_parquet(records: RecordWriter, parquet: str) -> None:
    for batch in parquet_batches(parquet, ["json"], _DERIVE_BATCH):
        records.add_all(batch.column(0))


def derive(reader: MemberSource, path: str) -> None:
    """Write the records table of ``reader``'s dataset to ``path``: from its records.parquet
    when it has one (indexed in place), else read from its shards' JSON members, a batch at a
    time (no copy of all records held)."""
    with RecordWriter(path) as records:
        if RECORDS_FILE in reader.index.get("files", {}):
            with storage.local_copy(storage.join(reader.directory, RECORDS_FILE),
                                    reader.remote.options if reader.remote else None) as local:
                _add_parquet(records, local)
        else:
            for first in range(0, len(reader), _DERIVE_BATCH):
                positions = range(first, min(first + _DERIVE_BATCH, len(reader)))
                reader.prefetch(positions, lambda name: name == "json")
                for position in positions:
                    records.add(reader.read_member(position, "json"))
        records.finish(path, reader.table_key)


class RecordTable:
    """Records by position, from the memory-mapped table (no Python object per sample)."""

    def __init__(self, path: str | None, table: pa.Table):
        self.path = path              # None: it could not be saved (a removed file, mapped)
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
                                   lambda target: derive(reader, target), cache_dir,
                                   reader.remote)
        if table.num_rows != len(reader):
            raise DatasetError(f"{reader.directory}: its records table has {table.num_rows} "
                               f"rows for {len(reader)} samples; {remake(reader.index)}")
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
