"""Random access to a built dataset: any sample's JSON or media by byte offset, no tar walk.

Offsets come from ``samples.parquet``; reads are ``os.pread`` on shard files opened lazily per
process (safe across ``fork``: a child reopens its own descriptors). Metadata-only readers read
the JSON member alone and never touch media bytes.
"""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq

from mimo_data.shards.index import DatasetError, read_index
from mimo_data.shards.format import SAMPLES_FILE, ShardRecord


class ShardReader:
    """Samples of one dataset directory, addressed by position in write order."""

    def __init__(self, directory: str):
        self.directory = directory
        self.index = read_index(directory)
        # ParquetFile, not read_table: that imports pyarrow.dataset, ~0.3 s per process start.
        table = pq.ParquetFile(os.path.join(directory, SAMPLES_FILE)).read(
            columns=["key", "shard", "members"])
        self.keys: list[str] = table.column("key").to_pylist()
        self.shards: list[str] = table.column("shard").to_pylist()
        self.members: list[dict] = [{m["name"]: (m["offset"], m["size"]) for m in row}
                                    for row in table.column("members").to_pylist()]
        if len(self.keys) != self.index["totals"]["samples"]:
            raise DatasetError(f"{directory}: {SAMPLES_FILE} has {len(self.keys)} rows, the "
                               f"index says {self.index['totals']['samples']} samples; rebuild")
        self._files: dict[str, int] = {}
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def _fd(self, shard: str) -> int:
        if self._pid != os.getpid():     # first use in this process (e.g. a DataLoader worker)
            self._files, self._pid = {}, os.getpid()
        if shard not in self._files:
            self._files[shard] = os.open(os.path.join(self.directory, shard), os.O_RDONLY)
        return self._files[shard]

    def read_member(self, position: int, name: str) -> bytes:
        """Bytes of member ``name`` (e.g. ``json``, ``img0.jpg``) of the sample at ``position``."""
        offset, size = self.members[position][name]
        data = os.pread(self._fd(self.shards[position]), size, offset)
        if len(data) != size:
            raise DatasetError(f"{self.shards[position]}: short read of {self.keys[position]}."
                               f"{name} ({len(data)} of {size} bytes); run mimo-shard verify")
        return data

    def record(self, position: int) -> ShardRecord:
        """The sample's JSON record (messages, media metadata, source)."""
        return json.loads(self.read_member(position, "json"))

    def media(self, position: int, record: ShardRecord, modalities=None) -> dict[str, bytes]:
        """The bytes of every media item of ``record`` (of ``modalities`` if given), by member."""
        return {item["member"]: self.read_member(position, item["member"])
                for item in record["media"] if modalities is None or item["modality"] in modalities}

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files = {}
