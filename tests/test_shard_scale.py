"""Scale is correctness: the offline tools hold no Python object per sample.

Each test runs a tool in process (``--workers 0``) on N and 4N tiny text-only samples and
checks that tracemalloc's traced peak (Python objects) and Arrow's peak (its buffers, outside
tracemalloc: a proxy made the default memory pool) grow by less than stated bounds per added
sample (the reviewer's RSS figures are in the report of the fix and in docs/datasets.md). The
samples table's write batches (8192 rows) and Parquet read batches (65,536; 4096 records) are
shrunk so that the window they hold is the same at N and 4N; the records go straight to files.
"""

from __future__ import annotations

import json
import tracemalloc

import pyarrow as pa
import pytest

from mimo_data import files
from mimo_data.shards import build as build_module
from mimo_data.shards import record_table
from mimo_data.shards.build import BuildOptions, build

N = 2000


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    monkeypatch.setattr(build_module._SamplesTable, "BATCH", 256)
    monkeypatch.setattr(files, "PARQUET_BATCH", 256)
    monkeypatch.setattr(record_table, "_DERIVE_BATCH", 256)


def _records(count: int):
    for i in range(count):
        yield {"id": f"s{i}", "conversations": [{"from": "human", "value": f"Question {i}?"},
                                                {"from": "gpt", "value": f"Answer {i}."}]}


_POOLS: list[pa.MemoryPool] = []     # kept alive: buffers made in one return to it when freed


def _peaks(run, *args) -> tuple[int, int]:
    """The peaks (bytes) of tracemalloc and of Arrow's memory pool while ``run(*args)`` runs."""
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    _POOLS.append(pool)
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        run(*args)
        return tracemalloc.get_traced_memory()[1], pool.max_memory()
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(default)


def _per_added_sample(tmp_path, make_input, run) -> tuple[float, float]:
    """Python's and Arrow's growth of the peak a sample from N to 4N samples (bytes)."""
    peaks = []
    for count in (N, 4 * N):
        path = make_input(tmp_path / f"in{count}", count)
        peaks.append(_peaks(run, path, tmp_path / f"out{count}"))
    return ((peaks[1][0] - peaks[0][0]) / (3 * N), (peaks[1][1] - peaks[0][1]) / (3 * N))


def _jsonl(folder, count: int) -> str:
    folder.mkdir()
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(count)))
    return str(path)


@pytest.mark.parametrize("shuffle", [False, True])
def test_build_memory_does_not_grow_per_sample(tmp_path, shuffle):
    # Before the fix: ~640 B/sample (a Task per record, an id -> location dict); now ~60
    # (the ids' 16-byte hashes in a hash table; with --shuffle 24 more: line offsets, order).
    def run(path, out):
        build([path], str(out), BuildOptions(workers=0, progress=False, shuffle=shuffle,
                                          max_samples_per_shard=500))

    grown, arrow = _per_added_sample(tmp_path, _jsonl, run)
    assert grown < 150, f"mimo-shard build: {grown:.0f} bytes a sample"
    # the sample table derived a Parquet batch at a time; read whole: ~96 B/sample here
    assert arrow < 20, f"mimo-shard build: Arrow's peak grew {arrow:.0f} bytes a sample"


def _tars(folder, count: int, per_tar: int = 500) -> str:
    import webdataset
    folder.mkdir()
    records = iter(_records(count))
    for tar in range(count // per_tar):
        with webdataset.TarWriter(str(folder / f"shard-{tar:06d}.tar")) as writer:
            for i in range(tar * per_tar, (tar + 1) * per_tar):
                writer.write({"__key__": f"k{i:09d}", "json": json.dumps(next(records)).encode()})
    return str(folder)


def test_index_memory_does_not_grow_per_sample(tmp_path, monkeypatch):
    # Two workers and a slow writer (2 s at its first tar): before the fix the finished tars'
    # results piled up in the main process, ~630 B a sample here (+1.3 KB at 400k, the
    # reviewer's RSS); now one tar in flight per worker: ~0 (the writer alone: -10 B/sample).
    import time

    from mimo_data.shards import in_place
    from mimo_data.shards.tar_sources import IndexOptions
    monkeypatch.setattr(in_place, "_BATCH", 256)
    add = in_place._Tables.add

    added: list = []                  # the tables (one an indexing) that took a tar, held

    def slow_add(self, result):
        if not any(table is self for table in added):
            added.append(self)
            time.sleep(2)     # the workers index the other tars meanwhile
        add(self, result)
    monkeypatch.setattr(in_place._Tables, "add", slow_add)

    def run(path, out):
        in_place.index([path], str(out), IndexOptions(workers=2, progress=False))

    grown, arrow = _per_added_sample(tmp_path, _tars, run)
    assert grown < 100, f"mimo-shard index: {grown:.0f} bytes a sample"
    # ~106 B/sample: the keys read whole to find a key in two tars (a hash table over them)
    assert arrow < 150, f"mimo-shard index: Arrow's peak grew {arrow:.0f} bytes a sample"

    # A reader of the index without its tables (another cache, a newer table version) derives
    # the sample and records tables a Parquet batch at a time: read whole, ~150 B/sample here
    from mimo_data.shards.reader import ShardReader
    peaks = [_peaks(ShardReader, str(tmp_path / f"out{count}"), str(tmp_path / f"cache{count}"))
             for count in (N, 4 * N)]
    opened = (peaks[1][1] - peaks[0][1]) / (3 * N)
    assert opened < 20, f"deriving the tables: Arrow's peak grew {opened:.0f} bytes a sample"


def test_verify_memory_does_not_grow_per_sample(tmp_path):
    # Before the fix the whole samples.parquet became Python dicts grouped by shard: ~1.5 KB a
    # sample here (~1.9 KB of RSS at 400k); now one shard's rows and a 1024-row batch at a
    # time: ~-75 B/sample (the same window at N and 4N).
    from mimo_data.shards.verify import verify

    def make(folder, count: int) -> str:
        build([_jsonl(folder, count)], str(folder / "shards"),
              BuildOptions(workers=0, progress=False, max_samples_per_shard=500))
        return str(folder / "shards")

    def run(path, out):
        assert verify(path, workers=1, progress=False) == []

    grown, arrow = _per_added_sample(tmp_path, make, run)
    assert grown < 100, f"mimo-shard verify: {grown:.0f} bytes a sample"
    # ~15 B/sample: the shard column read whole to see whether each shard's rows are together
    assert arrow < 50, f"mimo-shard verify: Arrow's peak grew {arrow:.0f} bytes a sample"


def test_a_shuffled_build_of_many_jsonl_files_keeps_few_open(tmp_path, monkeypatch):
    # --shuffle reads its JSONL inputs in turn: each kept its file open (thousands of inputs
    # passed the limit of open files). With at most 2 open, 5 inputs give the same dataset.
    from mimo_data.shards import task_stream
    inputs = []
    for part in range(5):
        path = tmp_path / f"part{part}.jsonl"
        path.write_text("".join(json.dumps({**r, "id": f"p{part}-{r['id']}"}) + "\n"
                                for r in _records(40)))
        inputs.append(str(path))
    built, file = [], task_stream._Lines._file
    for most in (64, 2):
        monkeypatch.setattr(task_stream._Lines, "OPEN", most)
        opened: list[int] = []

        def counted(self, opened=opened):
            handle = file(self)
            opened.append(len(self._handles))
            return handle
        monkeypatch.setattr(task_stream._Lines, "_file", counted)
        out = tmp_path / f"out{most}"
        build(inputs, str(out), BuildOptions(workers=0, progress=False, shuffle=True, seed=3))
        assert max(opened) == min(most, 5)
        built.append({p.name: p.read_bytes() for p in out.iterdir() if p.suffix == ".tar"})
    assert built[0] == built[1] and built[0]
