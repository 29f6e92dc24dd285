"""Random access to a built dataset: any sample's JSON or media by byte offset, no tar walk.

Offsets come from the memory-mapped sample table (``sample_table.py``); reads are ``os.pread``
on shard files opened lazily per process (safe across ``fork``: a child reopens its own
descriptors). Metadata-only readers read the JSON member alone and never touch media bytes.

Every member read is checked against the crc32 samples.parquet records (zlib's crc32 runs at
GB/s, far below the cost of decoding; ``tools/bench_preprocess.py`` measures it): changed bytes
inside a JPEG decode without a warning, so without the check they would train silently. A
mismatch is read once more (a transient fault of the storage), then stops the reader with the
shard, sample and member.
"""

from __future__ import annotations

import json
import os
import zlib

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
        """Bytes of member ``name`` (e.g. ``json``, ``img0.jpg``) of the sample at ``position``,
        checked against their recorded crc32 (DatasetError when they differ twice)."""
        offset, size, crc32 = self.table.members(position)[name]
        shard = self.table.shard(position)
        for _attempt in range(2):
            data = os.pread(self._fd(shard), size, offset)
            if len(data) != size:
                raise DatasetError(f"{shard}: short read of {self.table.key(position)}."
                                   f"{name} ({len(data)} of {size} bytes); run mimo-shard "
                                   "verify")
            if crc32 < 0 or zlib.crc32(data) == crc32:
                return data
        key = self.table.key(position)
        raise DatasetError(
            f"{os.path.join(self.directory, shard)}: sample {key} member {key}.{name}: its bytes "
            f"changed since the build (crc32 differs from samples.parquet, read twice); run "
            f"`mimo-shard verify {self.directory}` to list every damaged member, then restore "
            "the shard from its source or rebuild the dataset")

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
