"""Arrow columns written a batch at a time into files of their buffers, read back as arrays
over those files memory-mapped: how a derived table of any size is written with no copy of it
in memory.

Written by hand because Arrow's writers do not do this: a table file is what every rank maps
with no copy only when each column is one chunk (one record batch), and Arrow's IPC writer
takes a record batch whole, so a column made of many batches would be held, concatenated,
in memory first. Here each buffer (values, the ends of variable-length items) grows as a
plain file, and the one-batch array is assembled over the files at the end.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import numpy as np
import pyarrow as pa


class Streams:
    """The buffer files of one table in the making, named after a unique temporary file
    beside ``target`` (``TARGET.tmp-XXXX.NAME``: a write interrupted leaves files that
    ``mimo-shard cache`` reports as temporary). ``close`` removes them all."""

    def __init__(self, target: str):
        handle, self.prefix = tempfile.mkstemp(prefix=os.path.basename(target) + ".tmp-",
                                               dir=os.path.dirname(target) or ".")
        os.close(handle)
        self._columns: list[_File] = []
        self._maps: list[pa.MemoryMappedFile] = []

    def fixed(self, name: str, dtype: np.dtype | type) -> Fixed:
        column = Fixed(f"{self.prefix}.{name}", np.dtype(dtype))
        self._columns.append(column)
        return column

    def ends(self, name: str) -> Ends:
        column = Ends(f"{self.prefix}.{name}")
        self._columns.append(column)
        return column

    def binary(self, name: str) -> Binary:
        return Binary(self.ends(f"{name}.ends"), self.fixed(f"{name}.data", np.uint8))

    def buffer(self, column: _File) -> pa.Buffer:
        """``column``'s file, finished and memory-mapped (an empty buffer for an empty file),
        valid until ``close``."""
        column.finish()
        if column.size == 0:
            return pa.py_buffer(b"")
        mapped = pa.memory_map(column.path)
        self._maps.append(mapped)
        return mapped.read_buffer()

    def close(self) -> None:
        """Unmap and remove every file (again: nothing)."""
        for mapped in self._maps:
            mapped.close()
        for column in self._columns:
            column.finish()
        for path in [self.prefix, *(column.path for column in self._columns)]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        self._maps, self._columns = [], []

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *_) -> None:
        self.close()


class _File:
    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "wb")
        self.size = 0                          # bytes written

    def write(self, data: np.ndarray | bytes) -> None:
        view = memoryview(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data)
        self._file.write(view.cast("B"))
        self.size += view.nbytes

    def finish(self) -> None:
        self._file.close()


class Fixed(_File):
    """A column of fixed-width values (one dtype)."""

    def __init__(self, path: str, dtype: np.dtype):
        super().__init__(path)
        self.dtype = dtype

    def add(self, values: np.ndarray) -> None:
        self.write(np.asarray(values, self.dtype))

    def __len__(self) -> int:
        return self.size // self.dtype.itemsize


class Ends(_File):
    """The int64 offsets of variable-length items (bytes of a binary column, entries of a
    list column): starts with the first item's start, 0; each item adds its end."""

    def __init__(self, path: str):
        super().__init__(path)
        self.write(np.zeros(1, np.int64))
        self.total = 0                         # the last item's end

    def add(self, offsets: np.ndarray) -> None:
        """Add the items whose offsets (n + 1 of them, from any start) are ``offsets``."""
        offsets = np.asarray(offsets, np.int64)
        self.write(offsets[1:] - offsets[0] + self.total)
        self.total += int(offsets[-1] - offsets[0])

    def add_one(self, length: int) -> None:
        """Add one item of ``length``."""
        self.total += length
        self.write(self.total.to_bytes(8, sys.byteorder, signed=True))

    def __len__(self) -> int:
        return self.size // 8 - 1


class Binary:
    """A large binary (or large string) column: its ends and its bytes."""

    def __init__(self, ends: Ends, data: Fixed):
        self.ends, self.data = ends, data

    def add(self, values: pa.Array) -> None:
        """Add each value of ``values`` (binary or string; no Python object per value)."""
        large = pa.large_string() if pa.types.is_string(values.type) or \
            pa.types.is_large_string(values.type) else pa.large_binary()
        values = values.cast(large)
        _, offsets, data = values.buffers()
        ends = np.frombuffer(offsets, np.int64)[values.offset:values.offset + len(values) + 1]
        if len(values):
            self.data.add(np.frombuffer(data, np.uint8)[ends[0]:ends[-1]])
        self.ends.add(ends if len(values) else np.zeros(1, np.int64))

    def append(self, value: bytes) -> None:
        """Add one value (a build's record at a time: plain writes, no array made)."""
        self.data.write(value)
        self.ends.add_one(len(value))

    def __len__(self) -> int:
        return len(self.ends)


def array(streams: Streams, column: Fixed, arrow_type: pa.DataType) -> pa.Array:
    """``column`` as one Arrow array over its mapped file."""
    return pa.Array.from_buffers(arrow_type, len(column), [None, streams.buffer(column)])


def binary_array(streams: Streams, column: Binary, arrow_type: pa.DataType) -> pa.Array:
    """``column`` as one large binary or large string array over its mapped files."""
    return pa.Array.from_buffers(arrow_type, len(column),
                                 [None, streams.buffer(column.ends), streams.buffer(column.data)])


def offsets_array(streams: Streams, column: Ends) -> pa.Array:
    """``column``'s offsets (one more than its items) as an int64 array."""
    return pa.Array.from_buffers(pa.int64(), len(column) + 1, [None, streams.buffer(column)])
