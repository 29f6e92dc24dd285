"""Random access to a built dataset: any sample's JSON or media by byte offset, no tar walk.

Offsets come from the memory-mapped sample table (``sample_table.py``). A local dataset is read
with ``os.pread`` on shard files opened lazily per process (safe across ``fork``: a child
reopens its own descriptors). Metadata-only readers read the JSON member alone and never touch
media bytes.

A dataset indexed in place (``mimo-shard index``) has its shards under its index's
``shard_root``, elsewhere than the index (a local directory or a URL): they are read there, and
its records always come from the records table (its tars hold no ``KEY.json``).

Remote shards (``storage.py``) are read by ranged requests. Records come from the records
table (``record_table.py``, memory-mapped locally): no request per sample. Media bytes come in
runs: ``prefetch`` plans, for the samples it is given, one range per run of neighbouring
samples of a shard (their members are consecutive in the tar), issues them on a bounded thread
pool and returns at once; ``read_member`` then takes its bytes from the run. A member nobody
prefetched is one ranged request of its own.

Every member read is checked against the crc32 samples.parquet records (zlib's crc32 runs at
GB/s, far below the cost of decoding; ``tools/bench_preprocess.py`` measures it): changed bytes
inside a JPEG decode without a warning, so without the check they would train silently. A
mismatch is read once more (a transient fault of the storage), then stops the reader with the
shard, sample and member.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sys
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa

from mimo_data.shards import cache, storage
from mimo_data.shards.format import INDEXED_VERSION, RECORDS_FILE, ShardRecord
from mimo_data.shards.index import (DatasetError, check_complete, index_bytes, parse_index,
                                    remake, shard_root)
from mimo_data.shards.record_table import RecordTable
from mimo_data.shards.sample_table import SampleTable, build_digest, table_key

_CHECKED_AT_ONCE = 256             # samples ``_check_samples`` prefetches at a time
MAX_GAP = 256 << 10                # bytes between two spans still fetched as one request
MAX_RUN = 16 << 20                 # bytes of one request at most
THREADS = 8                        # requests in flight per reader and process
KEEP_BATCHES = 4                   # prefetched batches held (older ones are dropped unread)


class ShardReader:
    """Samples of one dataset (a directory or URL), addressed by position in write order."""

    def __init__(self, directory: str, cache_dir: str | None = None,
                 storage_options: dict | None = None):
        self.directory = directory
        self.cache_dir = cache_dir
        self.remote = storage.Remote(directory, storage_options) \
            if storage.is_remote(directory) else None
        data = index_bytes(directory, storage_options)
        self.index = parse_index(directory, data)
        check_complete(directory, self.index, storage_options)
        # sha256 of index.json's bytes: what tables computed from the dataset are keyed by
        self.index_digest = hashlib.sha256(data).digest()
        self.table_key = table_key(self.index, directory, self.remote)   # the build's key
        self.table = SampleTable.open(directory, self.index, self.table_key, cache_dir,
                                      self.remote)
        self.shard_root = shard_root(directory, self.index)
        self.shard_remote = storage.Remote(self.shard_root, storage_options) \
            if storage.is_remote(self.shard_root) else None
        self._files: dict[str, int] = {}
        self._pid: int | None = None
        self._pool: ThreadPoolExecutor | None = None
        # position -> (its run's bytes, the run's first byte offset)
        self._runs: dict[int, tuple[Future[bytes], int]] = {}
        self._batches: collections.deque[list[int]] = collections.deque()
        indexed = RECORDS_FILE in self.index.get("files", {})   # no KEY.json in its tars
        self.records = RecordTable.open(self, cache_dir) \
            if self.remote or self.shard_remote or indexed else None

    def __len__(self) -> int:
        return len(self.table)

    def check_shards(self) -> None:
        """DatasetError naming every shard that is missing or not of the size the index says
        (cut short, replaced), so that a run stops at start-up, not when it first reads one:
        one listing of a remote shard root, a ``stat`` per local shard; ``RangesIgnored``
        where an HTTP server serves them whole (``Remote.check_ranges``). A shard written
        again since (tars indexed in place, whose text a run reads from the index: its version
        differs, its size not) has its samples' text checked against the index
        (``_check_text``)."""
        names = [shard["name"] for shard in self.index["shards"]]
        found = storage.look_up(self.shard_root, names, self.shard_remote)
        if self.shard_remote is not None and names[0] in found:
            # every read is a range of a shard: one tried
            self.shard_remote.check_ranges(storage.join(self.shard_root, names[0]),
                                           found[names[0]][0])
        problems = [f"{shard['name']} missing" if shard["name"] not in found else
                    f"{shard['name']} holds {found[shard['name']][0]} bytes, the index says "
                    f"{shard['bytes']}" for shard in self.index["shards"]
                    if shard["name"] not in found or found[shard["name"]][0] not in (
                        None, shard["bytes"])]
        if problems:
            more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise DatasetError(f"{self.shard_root}: shard {'; '.join(problems[:3])}{more}: run "
                               f"`mimo-shard verify {self.directory}`, then restore the shards "
                               f"or {remake(self.index)}")
        self._check_text({name: found[name][1] for name in
                          storage.rewritten(self.index["shards"], found)})

    def _check_text(self, versions: dict[str, str | None]) -> None:
        """Read every member but the media of each sample of the tars ``versions`` names
        (written again since their indexing, at the same size: a caption edited, or only
        copied), checked against its crc32 (``read_member``: DatasetError naming the sample and
        member that changed): the text a run reads from the index is the tars'. The media are
        checked as they are read. A check passed is kept in the cache as a table of the tars
        and versions it read (``checked-KEY.arrow``): a copy is read once, not at every
        start-up."""
        if not versions:
            return
        key = hashlib.sha256(json.dumps([self.index_digest.hex(), self.shard_root,
                                         sorted(versions.items())]).encode()).hexdigest()
        labels = cache.Labels("checked", build_digest(self.index, self.directory, self.remote),
                              about=f"the text of {len(versions)} tar(s) read since indexed")

        checked: list[bool] = []

        def check(path: str) -> None:
            # (called again where the cache takes no table: then written elsewhere alone)
            if not checked:
                self._check_tars(versions)
                checked.append(True)
            cache.write_table(path, pa.table({"tar": list(versions), "version": list(
                versions.values())}), key, labels)
        cache.obtain(self.directory, f"checked-{key[:16]}.arrow", key, labels, check,
                     self.cache_dir)

    def _check_tars(self, versions: dict[str, str | None]) -> None:
        """Every member but the media of the samples of the tars ``versions`` names, read and
        checked, said on stderr."""
        wanted = set(versions)          # (a tar of no kept sample has no id in the table)
        ids = [i for i, name in enumerate(self.table.shard_names) if name in wanted]
        positions = np.flatnonzero(np.isin(self.table.shard_ids, ids)).tolist()
        named = ", ".join(sorted(versions)[:3]) + (
            f" and {len(versions) - 3} more" if len(versions) > 3 else "")
        if positions:
            tars, their = (f"{len(versions)} tars were", "their") if len(versions) > 1 else \
                ("1 tar was", "its")
            print(f"mimo: {self.directory}: {tars} written again since {their} indexing "
                  f"({named}; a copy?): reading {their} {len(positions)} samples' text to "
                  "check it against the index's, once", file=sys.stderr, flush=True)
        self._check_samples(positions)

    def _check_samples(self, positions: list[int]) -> None:
        """Every member but the media of the samples at ``positions``, read and checked."""
        for start in range(0, len(positions), _CHECKED_AT_ONCE):
            chunk = positions[start:start + _CHECKED_AT_ONCE]
            media = [{item["member"] for item in self.record(p)["media"]} for p in chunk]
            named = set().union(*media)
            # a remote shard's: a few requests, not one a member, without the media (the
            # function is called within prefetch, before ``named`` changes)
            self.prefetch(chunk, lambda name: name not in named)  # noqa: B023
            for position, theirs in zip(chunk, media):
                for name in self.table.members(position):
                    if name not in theirs:
                        self.read_member(position, name)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}, "_pid": None, "_pool": None, "_runs": {},
                "_batches": collections.deque()}

    def _this_process(self) -> None:
        if self._pid != os.getpid():     # first use in this process (e.g. a DataLoader worker)
            self._files, self._pid, self._pool = {}, os.getpid(), None
            self._runs, self._batches = {}, collections.deque()

    def _fd(self, shard: str) -> int:
        self._this_process()
        if shard not in self._files:
            self._files[shard] = os.open(os.path.join(storage.local_path(self.shard_root),
                                                      shard), os.O_RDONLY)
        return self._files[shard]

    def _read(self, shard: str, offset: int, size: int) -> bytes:
        if self.shard_remote is not None:
            return self.shard_remote.read_range(storage.join(self.shard_root, shard), offset,
                                                size)
        data = os.pread(self._fd(shard), size, offset)
        if len(data) != size:
            raise storage.ShortObject(f"{storage.join(self.shard_root, shard)}: cut short, "
                                      f"{len(data)} of {size} bytes at byte {offset}")
        return data

    def prefetch(self, positions: Iterable[int],
                 members: Callable[[str], bool] | None = None) -> None:
        """Start reading the members of the samples at ``positions`` (those whose name
        ``members`` accepts, all when None) of remote shards; a no-op for local ones.
        The last ``KEEP_BATCHES`` calls' bytes are held until read."""
        if self.shard_remote is None:
            return
        self._this_process()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="mimo-read")
        spans = []
        for position in sorted(set(positions) - set(self._runs)):
            chosen = [(offset, offset + size) for name, (offset, size, _) in
                      self.table.members(position).items() if members is None or members(name)]
            if chosen:
                spans.append((self.table.shard(position), min(s for s, _ in chosen),
                              max(e for _, e in chosen), position))
        batch: list[int] = []
        for shard, start, end, run_positions in _runs(spans):
            url = storage.join(self.shard_root, shard)
            future = self._pool.submit(self.shard_remote.read_range, url, start, end - start)
            for position in run_positions:
                self._runs[position] = (future, start)
            batch += run_positions
        if batch:
            self._batches.append(batch)
        while len(self._batches) > KEEP_BATCHES:
            for position in self._batches.popleft():
                self._runs.pop(position, None)

    def read_member(self, position: int, name: str) -> bytes:
        """Bytes of member ``name`` (e.g. ``json``, ``img0.jpg``) of the sample at ``position``,
        checked against their recorded crc32 (DatasetError when they differ twice)."""
        offset, size, crc32 = self.table.members(position)[name]
        shard = self.table.shard(position)
        self._this_process()
        run = self._runs.get(position)
        data = None
        try:
            if run is not None:
                future, start = run
                data = future.result()[offset - start:offset - start + size]
            for _attempt in range(2):
                if data is None or len(data) != size:
                    data = self._read(shard, offset, size)
                if crc32 < 0 or zlib.crc32(data) == crc32:
                    return data
                data = None
        except FileNotFoundError:
            raise DatasetError(f"{storage.join(self.shard_root, shard)}: missing (the dataset "
                               f"is incomplete); run `mimo-shard verify {self.directory}`, then "
                               f"restore the shard or {remake(self.index)}") from None
        except storage.ShortObject as exc:
            key = self.table.key(position)
            raise DatasetError(f"{exc} (sample {key} member {key}.{name}); run `mimo-shard "
                               f"verify {self.directory}`, then restore the shard or "
                               f"{remake(self.index)}") from None
        key = self.table.key(position)
        raise DatasetError(
            f"{storage.join(self.shard_root, shard)}: sample {key} member {key}.{name}: its "
            f"bytes changed since "
            f"{'its indexing' if self.index.get('version') == INDEXED_VERSION else 'the build'}"
            f" (crc32 differs from samples.parquet, read twice); "
            f"run `mimo-shard verify {self.directory}` to list every damaged member, then "
            f"restore the shard from its source or {remake(self.index)}")

    def record(self, position: int) -> ShardRecord:
        """The sample's JSON record (messages, media metadata, source)."""
        if self.records is not None:
            return json.loads(self.records[position])
        return json.loads(self.read_member(position, "json"))

    def media(self, position: int, record: ShardRecord, modalities=None) -> dict[str, bytes]:
        """The bytes of every media item of ``record`` (of ``modalities`` if given), by member."""
        return {item["member"]: self.read_member(position, item["member"])
                for item in record["media"] if modalities is None or item["modality"] in modalities}

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files = {}
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._runs, self._batches = {}, collections.deque()


def _runs(spans: list[tuple[str, int, int, int]]) -> list[tuple[str, int, int, list[int]]]:
    """``(shard, start, end, positions)`` requests covering ``spans`` (``(shard, start, end,
    position)`` sorted by position): neighbours in a shard merge while the gap between them is
    at most MAX_GAP and the request at most MAX_RUN bytes."""
    runs: list[tuple[str, int, int, list[int]]] = []
    for shard, start, end, position in sorted(spans, key=lambda span: (span[0], span[1])):
        if runs:
            last_shard, last_start, last_end, positions = runs[-1]
            if last_shard == shard and 0 <= start - last_end <= MAX_GAP \
                    and end - last_start <= MAX_RUN:
                positions.append(position)
                runs[-1] = (shard, last_start, end, positions)
                continue
        runs.append((shard, start, end, [position]))
    return runs
