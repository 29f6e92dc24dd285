"""Scale is correctness: the offline tools hold no Python object per sample.

Each test runs a tool in process (``--workers 0``) on N and 4N tiny text-only samples and
checks that tracemalloc's traced peak grows by less than a stated bound per added sample (the
tools' Arrow buffers are outside tracemalloc; the reviewer's RSS figures are in the report
of the fix and in docs/datasets.md). The samples table's write batches (8192 rows) are shrunk so
that the window they hold is the same at N and 4N; the records go straight to files.
"""

from __future__ import annotations

import json
import os
import signal
import tracemalloc

import pytest

from mimo_data.shards import build as build_module
from mimo_data.shards.build import BuildOptions, build

N = 2000


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    monkeypatch.setattr(build_module._SamplesTable, "BATCH", 256)


def _records(count: int):
    for i in range(count):
        yield {"id": f"s{i}", "conversations": [{"from": "human", "value": f"Question {i}?"},
                                                {"from": "gpt", "value": f"Answer {i}."}]}


def _peak(run, *args) -> int:
    """tracemalloc's peak (bytes) while ``run(*args)`` runs."""
    tracemalloc.start()
    try:
        run(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _per_added_sample(tmp_path, make_input, run) -> float:
    peaks = []
    for count in (N, 4 * N):
        path = make_input(tmp_path / f"in{count}", count)
        peaks.append(_peak(run, path, tmp_path / f"out{count}"))
    return (peaks[1] - peaks[0]) / (3 * N)


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

    grown = _per_added_sample(tmp_path, _jsonl, run)
    assert grown < 150, f"mimo-shard build: {grown:.0f} bytes a sample"


def _square(x: int) -> int:
    return x * x


def _square_or_die(x: int) -> int:
    if x == 7:      # as the out-of-memory killer ends a worker
        os.kill(os.getpid(), signal.SIGKILL)
    return x * x


def test_pool_results_are_bounded_by_a_window_and_a_dead_worker_is_an_error():
    # Pool.imap read all its input at once and kept every result until consumed: with a slow
    # writer (build's, index's), results piled up. ordered_map submits `window` ahead.
    from mimo_data.worker_pool import WorkerDied, ordered_map
    pulled = []

    def items():
        for i in range(1000):
            pulled.append(i)
            yield i
    results = ordered_map(_square_or_die, items(), workers=1, window=4)
    assert [next(results) for _ in range(7)] == [i * i for i in range(7)]
    assert len(pulled) <= 7 + 4
    # a multiprocessing.Pool lost a killed worker's item and waited for it forever (a CI run
    # hung 90 minutes on a worker's segfault): the pool breaks, the items in flight are named
    # (10 is submitted after 6 is consumed: the worker may have died on 7 before)
    with pytest.raises(WorkerDied, match=r"\(killed by SIGKILL: most often the out-of-memory "
                       r"killer\) while it had one of [34] item\(s\) in flight: 7, 8, 9(, 10)?$"):
        next(results)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _pid(path: str) -> int:
    with open(path, "w") as file:
        file.write(str(os.getpid()))
    return os.getpid()


def test_a_worker_killed_between_items_is_an_error_not_a_short_result(tmp_path):
    # the one worker is killed after its first item, before the second is handed over: the
    # pool may break before or after that hand-over (a broken pool refused it, and the
    # results ended short, silently), and either way the caller hears of it
    import time

    from mimo_data.worker_pool import WorkerDied, ordered_map
    marker = tmp_path / "pid"

    def items():
        yield str(marker)
        while not marker.exists():      # the worker has written its pid (its result is next)
            time.sleep(0.01)
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGKILL)
        while _alive(pid):
            time.sleep(0.01)
        time.sleep(0.5)     # the executor most likely sees the death before the hand-over
        yield str(tmp_path / "never")
    results = ordered_map(_pid, items(), workers=1, window=1)
    assert next(results) == int(marker.read_text())
    with pytest.raises(WorkerDied, match=r"killed by SIGKILL.*/never"):
        next(results)


def _read(path: str) -> bytes:
    if path.endswith("fifo"):       # the test waits for this worker to reach the FIFO
        with open(path + ".pid", "w") as file:
            file.write(str(os.getpid()))
    with open(path, "rb") as file:      # a FIFO no one writes: blocks forever
        return file.read()


def test_a_consumer_that_stops_early_does_not_wait_for_a_blocked_worker(tmp_path):
    # a --strict stop or a writer's error while a worker is blocked on a read (a hung mount,
    # a FIFO given as a medium): the pool's shutdown waited for that read forever
    import threading
    import time

    from mimo_data.worker_pool import ordered_map
    plain, fifo = tmp_path / "plain", tmp_path / "fifo"
    plain.write_bytes(b"x")
    os.mkfifo(fifo)
    results = ordered_map(_read, [str(plain), str(fifo)], workers=2, window=2)
    assert next(results) == b"x"
    marker = tmp_path / "fifo.pid"
    for _ in range(12000):          # a hang guard (2 minutes): the worker is at the FIFO
        if marker.exists() and marker.read_text():
            break
        time.sleep(0.01)
    reader = int(marker.read_text())
    closing = threading.Thread(target=results.close, daemon=True)
    closing.start()
    closing.join(timeout=120)       # a hang guard: the workers are killed, not awaited
    assert not closing.is_alive(), "closing the pool waited for a worker blocked on a read"
    for _ in range(12000):          # a hang guard: a killed worker is gone in milliseconds
        if not _alive(reader):
            return
        time.sleep(0.01)
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))   # frees it, so the test ends
    raise AssertionError("the worker blocked on the FIFO outlived the pool's close")


def _seen(name: str) -> tuple[str | None, str]:
    return os.environ.get(name), os.getcwd()


def _refuse(detail: str) -> None:
    from mimo_data.shards.records import RecordError
    raise RecordError("bad_record", detail)


def test_a_workers_counted_error_reaches_the_caller_as_itself():
    # CountedError's pickle (Exception's: its args, the detail alone) could not be rebuilt: the
    # pool broke and a skip of a record was reported as a worker killed by the OOM killer
    from mimo_data.shards.records import RecordError
    from mimo_data.worker_pool import ordered_map
    with pytest.raises(RecordError) as raised:
        list(ordered_map(_refuse, ["the detail"], workers=1, window=1))
    assert (raised.value.reason, raised.value.detail) == ("bad_record", "the detail")


def test_pool_workers_see_the_callers_environment_and_folder(tmp_path, monkeypatch):
    # the workers fork from the forkserver, started once a process with the environment and
    # folder of then: a credential or relative path set later must reach them as a fork's would
    from mimo_data.worker_pool import ordered_map
    assert list(ordered_map(_seen, ["MIMO_TEST_SEEN"], workers=1, window=1))[0][0] is None
    monkeypatch.setenv("MIMO_TEST_SEEN", "later")
    monkeypatch.chdir(tmp_path)
    assert list(ordered_map(_seen, ["MIMO_TEST_SEEN"], workers=1, window=1)) == [
        ("later", str(tmp_path))]


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

    def slow_add(self, result):
        if not self.modalities["text_only"]["samples"]:
            time.sleep(2)     # the workers index the other tars meanwhile
        add(self, result)
    monkeypatch.setattr(in_place._Tables, "add", slow_add)

    def run(path, out):
        in_place.index([path], str(out), IndexOptions(workers=2, progress=False))

    grown = _per_added_sample(tmp_path, _tars, run)
    assert grown < 100, f"mimo-shard index: {grown:.0f} bytes a sample"


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

    grown = _per_added_sample(tmp_path, make, run)
    assert grown < 100, f"mimo-shard verify: {grown:.0f} bytes a sample"


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
