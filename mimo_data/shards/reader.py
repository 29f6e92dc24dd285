"""Random access to a built dataset: any sample's JSON or media by byte offset, no tar walk.

Offsets come from the memory-mapped sample table (``sample_table.py``); reads are ``os.pread``
on shard files opened lazily per process (safe across ``fork``: a child reopens its own
descriptors). Metadata-only readers read the JSON member alone and never touch media bytes.
"""

from __future__ import annotations

import json
import os

from mimo_data.shards.format import ShardRecord
from mimo_data.shards.index import DatasetError, read_index
from mimo_data.shards.sample_table import SampleTable


class ShardReader:
    """Samples of one dataset directory, addressed by position in write order."""

    def __init__(self, directory: str, cache_dir: str | None = None):
        self.directory = directory
        self.index = read_index(directory)
        self.table = SampleTable.open(directory, self.index, cache_dir)
        self._files: dict[str, int] = {}
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.table)

    def _fd(self, shard: str) -> int:
        if self._pid != os.getpid():     # first use in this process (e.g. a DataLoader worker)
            self._files, self._pid = {}, os.getpid()
        if shard not in self._files:
            self._files[shard] = os.open(os.path.join(self.directory, shard), os.O_RDONLY)
        return self._files[shard]

    def read_member(self, position: int, name: str) -> bytes:
        """Bytes of member ``name`` (e.g. ``json``, ``img0.jpg``) of the sample at ``position``."""
        offset, size = self.table.members(position)[name]
        shard = self.table.shard(position)
        data = os.pread(self._fd(shard), size, offset)
        if len(data) != size:
            raise DatasetError(f"{shard}: short read of {self.table.key(position)}."
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
