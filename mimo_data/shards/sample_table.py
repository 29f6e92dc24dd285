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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mimo_data.shards import cache, column_files, storage
from mimo_data.shards.format import SAMPLES_FILE
from mimo_data.files import file_sha256, parquet_batches
from mimo_data.shards.index import DatasetError, damaged_samples, remake

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


def write(parquet: str, folder: str, key: str) -> None:
    """Derive the sample table of ``parquet`` and write it into ``folder``."""
    derive(parquet, os.path.join(folder, file_name(key)), key)


def write_cache(index: dict, staging: str) -> tuple[str, str]:
    """Make the cache folder of the dataset being written in ``staging`` and write its sample
    table there; return the folder and the table's key (its other tables take the key too)."""
    folder = os.path.join(staging, cache.DATASET_CACHE)
    os.mkdir(folder)
    key = table_key(index, staging)
    write(os.path.join(staging, SAMPLES_FILE), folder, key)
    return folder, key


def derive(parquet: str, path: str, key: str) -> None:
    """Derive the sample table of ``parquet`` and write it to ``path``, a Parquet batch at a
    time: no copy of the table is held (``column_files``)."""
    with column_files.Streams(path) as streams:
        keys, shard_ids = streams.binary("key"), streams.fixed("shard", np.int32)
        member_ends = streams.ends("members")
        fields = {"name": streams.fixed("name", np.int16),
                  **{field: streams.fixed(field, np.int64)
                     for field in ("offset", "size", "crc32")}}
        shards: dict[str, int] = {}          # name -> id, in order of first appearance
        members: dict[str, int] = {}
        for batch in parquet_batches(parquet, ["key", "shard", "members"]):
            keys.add(batch.column("key"))
            shard_ids.add(_ids(batch.column("shard"), shards))
            listed = batch.column("members")
            member_ends.add(listed.offsets.to_numpy())
            flat = listed.flatten()
            fields["name"].add(_ids(flat.field("name"), members))
            if len(members) > np.iinfo(np.int16).max:
                raise DatasetError(f"{parquet}: over {np.iinfo(np.int16).max} distinct member "
                                   "names")
            fields["offset"].add(flat.field("offset").to_numpy())
            fields["size"].add(flat.field("size").to_numpy())
            fields["crc32"].add(  # -1 where samples.parquet has none: built before it was recorded
                pc.fill_null(flat.field("crc32"), -1).to_numpy()
                if flat.type.get_field_index("crc32") >= 0 else np.full(len(flat), -1))
        entries = pa.StructArray.from_arrays(
            [column_files.array(streams, column, pa.int16() if name == "name" else pa.int64())
             for name, column in fields.items()], names=list(fields))
        # 64-bit offsets: keys and member entries of hundreds of millions of samples fit
        table = pa.table({
            "key": column_files.binary_array(streams, keys, pa.large_string()),
            "shard": column_files.array(streams, shard_ids, pa.int32()),
            "members": pa.LargeListArray.from_arrays(
                column_files.offsets_array(streams, member_ends), entries)})
        cache.write_table(path, table.replace_schema_metadata({
            b"mimo.shards": json.dumps(list(shards)).encode(),
            b"mimo.members": json.dumps(list(members)).encode()}), key, labels(key))


def _derive_copy(parquet: str, remote: storage.Remote | None, path: str, key: str) -> None:
    """``derive`` of a local samples.parquet, or of a remote one's temporary download."""
    with storage.local_copy(parquet, remote.options if remote else None) as local:
        try:
            derive(local, path, key)
        except pa.ArrowInvalid as error:        # its footer or a page cut short, or changed
            raise damaged_samples(parquet, error) from None


def _ids(names: pa.Array, ids: dict[str, int]) -> np.ndarray:
    """The id of each of ``names`` in ``ids``, where a name not seen before gets the next."""
    encoded = pc.dictionary_encode(names)
    mapping = np.array([ids.setdefault(name, len(ids))
                        for name in encoded.dictionary.to_pylist()], np.int64)
    return mapping[encoded.indices.to_numpy()] if len(mapping) else np.zeros(0, np.int64)


class SampleTable:
    """The memory-mapped sample table of one dataset: numpy views, one Arrow string column."""

    def __init__(self, path: str | None, table: pa.Table):
        self.path = path            # None: it could not be saved (a removed file, mapped)
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
            lambda target: _derive_copy(parquet, remote, target, key),
            cache_dir, remote)
        if table.num_rows != index["totals"]["samples"]:
            raise DatasetError(f"{directory}: {SAMPLES_FILE} has {table.num_rows} rows, the "
                               f"index says {index['totals']['samples']} samples; "
                               f"{remake(index)}")
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
