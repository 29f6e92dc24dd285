"""The sample table: every sample's key, shard and member byte ranges as flat columns that
every process memory-maps (Arrow IPC), so opening a dataset costs no Python object per sample
and its pages are shared by all ranks of a machine.

It is derived from ``samples.parquet`` (compressed, for tools; reading it builds objects) and
keyed by that file's sha256 from ``index.json``. ``mimo-shard build`` writes it; a dataset built
before gets it on first use (``cache.py`` says where it goes), with a message.

Columns: ``key`` (string), ``shard`` (int32 id into the ``mimo.shards`` list in the schema
metadata), ``members`` (list of ``{name: int16 id into mimo.members, offset, size, crc32}`` in
tar order; crc32 -1 where samples.parquet has none: datasets built before it was recorded).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from mimo_data.shards import cache, storage
from mimo_data.shards.format import SAMPLES_FILE
from mimo_data.files import file_sha256
from mimo_data.shards.index import DatasetError

TABLE_VERSION = 2                    # 2: members' crc32


def build_digest(index: dict, directory: str, remote: storage.Remote | None = None) -> str:
    """The dataset build's fingerprint: samples.parquet's sha256 (from the index). Every table
    derived from the dataset is labelled with it (``cache.Labels.dataset``)."""
    recorded = index.get("files", {}).get(SAMPLES_FILE, {}).get("sha256")
    if recorded:
        return recorded
    parquet = storage.join(directory, SAMPLES_FILE)
    return hashlib.sha256(remote.read(parquet)).hexdigest() if remote else file_sha256(parquet)


def table_key(index: dict, directory: str, remote: storage.Remote | None = None) -> str:
    """What the sample table is computed from: the build's samples.parquet."""
    return f"v{TABLE_VERSION}-{build_digest(index, directory, remote)}"


def labels(key: str) -> cache.Labels:
    return cache.Labels("samples", key.split("-", 1)[1])


def file_name(key: str) -> str:
    return f"samples-{key[:19]}.arrow"


def from_parquet(parquet: str | IO[bytes]) -> pa.Table:
    """The sample table of ``samples.parquet`` (vectorized: no Python object per sample)."""
    source = pq.ParquetFile(parquet).read(columns=["key", "shard", "members"])
    shards = pc.dictionary_encode(source.column("shard")).combine_chunks()
    members = source.column("members").combine_chunks()
    flat = members.flatten()
    names = pc.dictionary_encode(flat.field("name"))
    if len(names.dictionary) > np.iinfo(np.int16).max:
        raise DatasetError(f"{parquet}: {len(names.dictionary)} distinct member names")
    crc32 = pc.fill_null(flat.field("crc32"), -1) if flat.type.get_field_index("crc32") >= 0 \
        else pa.array(np.full(len(flat), -1, np.int64))
    entries = pa.StructArray.from_arrays(
        [names.indices.cast(pa.int16()), flat.field("offset"), flat.field("size"),
         crc32.cast(pa.int64())], names=["name", "offset", "size", "crc32"])
    # 64-bit offsets: keys and member entries of hundreds of millions of samples fit
    table = pa.table({"key": source.column("key").combine_chunks().cast(pa.large_string()),
                      "shard": shards.indices.cast(pa.int32()),
                      "members": pa.LargeListArray.from_arrays(
                          members.offsets.cast(pa.int64()), entries)})
    return table.replace_schema_metadata({
        b"mimo.shards": json.dumps(shards.dictionary.to_pylist()).encode(),
        b"mimo.members": json.dumps(names.dictionary.to_pylist()).encode()})


def write(parquet: str, folder: str, key: str) -> None:
    """Derive the sample table of ``parquet`` and write it into ``folder``."""
    cache.write_table(os.path.join(folder, file_name(key)), from_parquet(parquet), key,
                      labels(key))


class SampleTable:
    """The memory-mapped sample table of one dataset: numpy views, one Arrow string column."""

    def __init__(self, path: str | None, table: pa.Table):
        self.path = path            # None: the table lives in memory (it could not be saved)
        self.arrow = table
        metadata = table.schema.metadata
        self.shard_names: list[str] = json.loads(metadata[b"mimo.shards"])
        self.member_names: list[str] = json.loads(metadata[b"mimo.members"])
        self.keys = cache.column(table, "key")
        self.shard_ids = cache.column(table, "shard").to_numpy()
        members = cache.column(table, "members")
        self.member_starts = members.offsets.to_numpy()
        values = members.values
        self.member_name_ids = values.field("name").to_numpy()
        self.member_offsets = values.field("offset").to_numpy()
        self.member_sizes = values.field("size").to_numpy()
        self.member_crcs = values.field("crc32").to_numpy()

    @classmethod
    def open(cls, directory: str, index: dict, key: str, cache_dir: str | None = None,
             remote: storage.Remote | None = None) -> SampleTable:
        """The table of ``directory`` for ``key`` (``table_key``), derived first when missing,
        stale or damaged."""
        parquet = storage.join(directory, SAMPLES_FILE)
        table, path = cache.obtain(
            directory, file_name(key), key, labels(key),
            lambda: from_parquet(storage.readable(parquet, remote.options if remote else None)),
            cache_dir, remote)
        if table.num_rows != index["totals"]["samples"]:
            raise DatasetError(f"{directory}: {SAMPLES_FILE} has {table.num_rows} rows, the "
                               f"index says {index['totals']['samples']} samples; rebuild")
        return cls(path, table)

    def __reduce__(self):
        # A process that receives the table (spawned DataLoader workers) maps the file again
        # instead of receiving a copy of its columns.
        if self.path is None:
            return SampleTable, (None, self.arrow)
        return _mapped, (self.path,)

    def __len__(self) -> int:
        return len(self.shard_ids)

    def key(self, position: int) -> str:
        return self.keys[position].as_py()

    def position(self, key: str) -> int | None:
        """Position of the sample with ``key``, None if there is none."""
        found = pc.index(self.keys, key).as_py()
        return None if found < 0 else found

    def shard(self, position: int) -> str:
        return self.shard_names[self.shard_ids[position]]

    def members(self, position: int) -> dict[str, tuple[int, int, int]]:
        """``{member name: (byte offset, size, crc32 or -1)}`` of the sample at ``position``."""
        start, stop = self.member_starts[position], self.member_starts[position + 1]
        return {self.member_names[n]: (int(o), int(s), int(c)) for n, o, s, c in zip(
            self.member_name_ids[start:stop], self.member_offsets[start:stop],
            self.member_sizes[start:stop], self.member_crcs[start:stop])}

    def shard_sizes(self) -> tuple[int, ...]:
        """Samples per shard, in write order."""
        cuts = np.flatnonzero(np.diff(self.shard_ids)) + 1
        return tuple(np.diff(np.concatenate([[0], cuts, [len(self)]])).tolist()) \
            if len(self) else ()


def _mapped(path: str) -> SampleTable:
    return SampleTable(path, cache.mapped(path))
