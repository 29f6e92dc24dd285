"""Columns written a batch at a time into files (``shards.column_files``) read back as the
arrays the batches make together, for batches that are slices of larger arrays (their
buffers start before them), and the files are gone after, also when the writing fails."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from mimo_data.shards import column_files


def test_sliced_batches_read_back_as_their_concatenation(tmp_path):
    # large strings: a slice of them is kept as it is (a cast to them would copy)
    words = pa.array(["alpha", "", "beta", "gamma", "", "delta", "é"], pa.large_string())
    lists = pa.array([[1, 2], [], [3], [4, 5, 6], [7], [], [8, 9]], pa.list_(pa.int64()))
    batches = [(0, 2), (2, 0), (2, 4), (6, 1)]          # (start, length): one empty
    with column_files.Streams(str(tmp_path / "table.arrow")) as streams:
        text, ends = streams.binary("text"), streams.ends("lists")
        values = streams.fixed("values", np.int64)
        for start, length in batches:
            text.add(words.slice(start, length))
            sliced = lists.slice(start, length)
            ends.add(sliced.offsets.to_numpy())
            values.add(sliced.flatten().to_numpy())
        text.append("ζ".encode())
        read = column_files.binary_array(streams, text, pa.large_string())
        made = pa.LargeListArray.from_arrays(column_files.offsets_array(streams, ends),
                                             column_files.array(streams, values, pa.int64()))
        assert read.to_pylist() == words.to_pylist() + ["ζ"]
        assert made.to_pylist() == lists.to_pylist()
        assert list(tmp_path.iterdir()) != []
    assert list(tmp_path.iterdir()) == []


def test_a_records_table_that_fails_midway_leaves_no_file(tmp_path, monkeypatch):
    """``record_table.write`` of a Parquet file whose read fails after its first batch (a
    disk error, say): the error reaches the caller and the folder holds none of the streams'
    files."""
    import pyarrow.parquet as pq
    import pytest

    from mimo_data.shards import record_table

    parquet = tmp_path / "records.parquet"
    pq.write_table(pa.table({"json": pa.array([b"{}"] * 4, pa.large_binary())}), parquet)
    read = record_table.parquet_batches

    def first_then_fail(*args, **kwargs):
        yield next(iter(read(*args, **kwargs)))
        raise OSError("a read error (test)")

    monkeypatch.setattr(record_table, "parquet_batches", first_then_fail)
    folder = tmp_path / "cache"
    folder.mkdir()
    with pytest.raises(OSError, match="a read error"):
        record_table.write(str(parquet), str(folder), "k" * 16)
    assert list(folder.iterdir()) == []
