"""What `mimo-shard build` reads, in order, without a Python object per record.

``stream`` yields the sources' tasks lazily in file order; ``shuffled`` yields them in the
order ``random.Random(seed).shuffle`` gives the whole task list, holding only 8-byte numbers
per record (a JSONL line's offset and number; a Parquet row's position is computed; a JSON
array is parsed whole, as it is without shuffling, and each record is released once read).
``IdRegistry`` keeps the ids already written as 16-byte hashes in numpy arrays: the duplicate
check without a string per sample.
"""

from __future__ import annotations

import bisect
import codecs
import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from mimo_data.shards.format import location
from mimo_data.shards.sources import ConversationFile, ParquetTable, Task


def stream(sources) -> Iterator[Task]:
    """Every source's tasks in file order, read as they are consumed."""
    for number, source in enumerate(sources):
        yield from source.tasks(number)


class _Lines:
    """Random access to a JSONL file's non-blank lines: their offsets and line numbers. At
    most ``OPEN`` of these files are open at once (a shuffled build reads its inputs in
    turn: thousands of JSONL files would pass the process's limit of open files)."""

    OPEN = 64
    _handles: OrderedDict[str, BinaryIO] = OrderedDict()      # path -> file, least recent first

    def __init__(self, path: str, source: int):
        self.path, self.source = path, source
        self.offsets, self.numbers = array("q"), array("q")
        with open(path, "rb") as lines:
            offset = 0
            for number, line in enumerate(lines, start=1):
                text = line.removeprefix(codecs.BOM_UTF8) if number == 1 else line
                if text.strip():      # as sources._line_tasks: blank lines are no records
                    self.offsets.append(offset)
                    self.numbers.append(number)
                offset += len(line)

    def __len__(self) -> int:
        return len(self.offsets)

    def _file(self) -> BinaryIO:
        handles = self._handles
        if self.path in handles:
            handles.move_to_end(self.path)
        else:
            if len(handles) >= self.OPEN:
                handles.popitem(last=False)[1].close()
            handles[self.path] = open(self.path, "rb")
        return handles[self.path]

    def __getitem__(self, i: int) -> Task:
        file = self._file()
        file.seek(self.offsets[i])
        line, number = file.readline(), self.numbers[i]
        if number == 1:
            line = line.removeprefix(codecs.BOM_UTF8)
        return Task(self.source, line, location(self.path, "line", number), ("line", number))

    def close(self) -> None:
        handle = self._handles.pop(self.path, None)
        if handle is not None:
            handle.close()


class _Array:
    """A JSON array's records (parsed whole: inherent to the format); each is released from
    the list when its task is made (every record is read once)."""

    def __init__(self, source: ConversationFile, number: int):
        self.path, self.source = source.path, number
        self.records: list = source.records()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Task:
        record, self.records[i] = self.records[i], None
        return Task(self.source, record, location(self.path, "index", i), ("index", i))

    def close(self) -> None:
        self.records = []


class _Rows:
    """A Parquet file's rows: (row group, offset) from the groups' cumulative sizes."""

    def __init__(self, source: ParquetTable, number: int):
        self.path, self.source = source.path, number
        self.starts = source.row_group_starts()    # one more than the groups: the total last

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, row: int) -> Task:
        group = bisect.bisect_right(self.starts, row) - 1
        return Task(self.source, (group, row - self.starts[group]),
                    location(self.path, "row", row), ("row", row))

    def close(self) -> None:
        pass


def _access(source, number: int):
    if isinstance(source, ParquetTable):
        return _Rows(source, number)
    if isinstance(source, ConversationFile) and not source.lines:
        return _Array(source, number)
    return _Lines(source.path, number)     # JSONL conversations and speech manifests


def permutation(count: int, seed: int) -> array:
    """``range(count)`` in the order ``random.Random(seed).shuffle`` puts a list of ``count``
    items (the same draws, so the same order), as 8-byte numbers."""
    order = array("q", range(count))
    getrandbits = random.Random(seed).getrandbits
    for i in reversed(range(1, count)):
        bits = (i + 1).bit_length()     # Random._randbelow's draw, as shuffle makes it
        j = getrandbits(bits)
        while j > i:
            j = getrandbits(bits)
        order[i], order[j] = order[j], order[i]
    return order


def shuffled(sources, seed: int, on_total=None) -> Iterator[Task]:
    """The tasks of ``stream(sources)`` in a seeded order: the order of
    ``random.Random(seed).shuffle(list(stream(sources)))``. ``on_total`` gets their number
    once the sources are indexed."""
    parts = [_access(source, number) for number, source in enumerate(sources)]
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + len(part))
    if on_total is not None:
        on_total(starts[-1])
    try:
        for task in permutation(starts[-1], seed):
            part = bisect.bisect_right(starts, task) - 1
            yield parts[part][task - starts[part]]
    finally:
        for part in parts:
            part.close()


def count(sources) -> int | None:
    """The number of tasks when known without reading the records (Parquet metadata)."""
    if all(isinstance(source, ParquetTable) for source in sources):
        return sum(source.row_group_starts()[-1] for source in sources)
    return None


class IdRegistry:
    """The ids of written samples and where each was read: an open-addressing hash table of
    128-bit BLAKE2b hashes (two uint64 arrays) and the first location's (file, number) packed
    in an int64: 24 bytes a slot, 32-64 bytes an id at the 0.375-0.75 load it keeps."""

    _NUMBER_BITS = 44

    def __init__(self, capacity: int = 1 << 12):
        self._files: list[tuple[str, str]] = []     # (path, origin kind) per source seen
        self._file_index: dict[tuple[str, str], int] = {}
        self._size = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self._high = np.zeros(capacity, np.uint64)
        self._low = np.zeros(capacity, np.uint64)
        self._where = np.full(capacity, -1, np.int64)     # -1: an empty slot

    @staticmethod
    def _hash(sample_id: str) -> tuple[int, int]:
        digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=16).digest()
        return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")

    def _slot(self, high: int, low: int) -> int:
        mask = len(self._where) - 1
        slot = low & mask
        where, highs, lows = self._where, self._high, self._low
        while where[slot] != -1 and not (highs[slot] == high and lows[slot] == low):
            slot = (slot + 1) & mask
        return slot

    def first(self, sample_id: str) -> tuple[str, str] | None:
        """The file and the location where ``sample_id`` was first added, or None when it
        was not."""
        slot = self._slot(*self._hash(sample_id))
        packed = int(self._where[slot])
        if packed == -1:
            return None
        path, kind = self._files[packed >> self._NUMBER_BITS]
        return path, location(path, kind, packed & ((1 << self._NUMBER_BITS) - 1))

    def add(self, sample_id: str, source: dict) -> None:
        """Record ``sample_id`` as read at ``source`` (a sample's ``{"file", kind: number}``)."""
        (kind, number), = ((k, v) for k, v in source.items() if k != "file")
        key = (source["file"], kind)
        if key not in self._file_index:
            self._file_index[key] = len(self._files)
            self._files.append(key)
        if (self._size + 1) * 4 > len(self._where) * 3:
            self._grow()
        high, low = self._hash(sample_id)
        slot = self._slot(high, low)
        if self._where[slot] == -1:
            self._size += 1
        self._high[slot], self._low[slot] = high, low
        self._where[slot] = (self._file_index[key] << self._NUMBER_BITS) | number

    def _grow(self) -> None:
        highs, lows, wheres = self._high, self._low, self._where
        self._alloc(len(wheres) * 2)
        mask = len(self._where) - 1
        occupied = np.flatnonzero(wheres != -1)
        for start in range(0, len(occupied), 4096):    # a few thousand Python ints at a time
            for i in occupied[start:start + 4096].tolist():
                high, low = int(highs[i]), int(lows[i])
                slot = low & mask
                while self._where[slot] != -1:
                    slot = (slot + 1) & mask
                self._high[slot], self._low[slot], self._where[slot] = high, low, wheres[i]
