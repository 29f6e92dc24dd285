"""``mimo-shard index``: indexing throughput with 1 and 2 workers, and a language rank's start-up
against dataset size on a dataset indexed in place. Prints the command's throughput line per
check and worker count, then the first and later start-up's seconds and memory per size.

Tars in img2dataset's layout (``KEY.jpg`` + ``KEY.txt`` + ``KEY.json``, written by webdataset's
``ShardWriter`` from the corpus photos, cycled) of ``--samples`` samples are indexed with 1 and 2
workers (``--check decode``, the default, and ``header``); the command's own throughput line is
printed, with its per-worker rate over webdataset's own pipeline reading the same tars in this
process (``.decode("pil")`` for decode), measured in the same run. That index is then scaled
to each of ``--sizes`` by hard-linking its tars into more folders and repeating the rows of
its ``samples.parquet`` and ``records.parquet`` (keys renumbered; derived tables written
before the clock starts), and a language rank's start-up (open, first batch;
``bench_scale.measure``) is measured there, first start (token table computed) and later
start (saved).

Target: later start growing by at most 0.5 s per million samples (``bench_scale``'s).

    python tools/bench_index.py [--samples 2000] [--sizes 20000 400000]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

from bench_scale import start_table


def write_tars(corpus: str, samples: int, out: str, per_tar: int = 1000) -> None:
    """``samples`` caption pairs of the corpus photos, img2dataset's layout."""
    import webdataset

    folder = os.path.join(corpus, "images")
    photos = [(name, open(os.path.join(folder, name), "rb").read())
              for name in sorted(os.listdir(folder))]
    os.makedirs(out)
    with webdataset.ShardWriter(os.path.join(out, "%06d.tar"), maxcount=per_tar,
                                verbose=0) as writer:
        for number in range(samples):
            name, data = photos[number % len(photos)]
            key = f"{number:09d}"
            writer.write({"__key__": key, name.rsplit(".", 1)[1]: data,
                          "txt": f"Photo {number}: {name.rsplit('.', 1)[0]}.",
                          "json": {"url": f"https://example.com/{number}/{name}", "key": key,
                                   "status": "success"}})


def index_throughput(tars: str, out: str, workers: int, check: str) -> str:
    """The throughput line of ``mimo-shard index`` on ``tars``."""
    result = subprocess.run([sys.executable, "-m", "mimo_data.shards.cli", "index", tars,
                             "--output", out, "--workers", str(workers), "--check", check,
                             "--no-progress"], capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"mimo-shard index failed:\n{result.stderr[-3000:]}")
    return [line for line in result.stderr.splitlines() if "per worker" in line][-1]


def webdataset_rate(tars: str, decode: bool) -> float:
    """Samples a second of webdataset's own pipeline over the same tars in this process (the
    baseline, run in the same run): every image decoded to RGB by ``.decode("pil")`` (which
    loads and converts it) for ``--check decode``, the samples alone for ``header``."""
    import webdataset

    urls = sorted(os.path.join(tars, name) for name in os.listdir(tars) if name.endswith(".tar"))
    dataset = webdataset.WebDataset(urls, shardshuffle=False, empty_check=False)
    if decode:
        dataset = dataset.decode("pil")
    started = time.perf_counter()
    count = sum(1 for _ in dataset)
    return count / (time.perf_counter() - started)


def scaled_index(base: str, copies: int, out: str) -> str:
    """``base``'s index (indexed in place) repeated ``copies`` times over hard-linked tars."""
    from mimo_data.files import file_sha256
    from mimo_data.shards import record_table, sample_table
    from mimo_data.shards.cache import DATASET_CACHE
    from mimo_data.shards.format import INDEX_FILE, RECORDS_FILE, REPORT_FILE, SAMPLES_FILE
    from mimo_data.shards.index import dumps, read_index

    index = read_index(base)
    table = pq.read_table(os.path.join(base, SAMPLES_FILE))
    records = pq.read_table(os.path.join(base, RECORDS_FILE))
    tars = os.path.join(out, "tars")
    shards, parts = [], []
    rows = table.num_rows
    for copy in range(copies):
        os.makedirs(os.path.join(tars, f"{copy:05d}"))
        for shard in index["shards"]:
            name = f"{copy:05d}/{shard['name']}"
            os.link(os.path.join(index["shard_root"], shard["name"]), os.path.join(tars, name))
            shards.append({**shard, "name": name})
        keys = pa.array([f"{copy * rows + i:09d}" for i in range(rows)])
        names = pa.array([f"{copy:05d}/{s}" for s in table.column("shard").to_pylist()])
        parts.append(table.set_column(0, "key", keys).set_column(1, "shard", names))
    pq.write_table(pa.concat_tables(parts), os.path.join(out, SAMPLES_FILE))
    pq.write_table(pa.concat_tables([records] * copies), os.path.join(out, RECORDS_FILE))
    shutil.copy(os.path.join(base, REPORT_FILE), out)
    index.update(shard_root=tars, shards=shards,
                 totals={"samples": rows * copies, "shards": len(shards),
                         "bytes": index["totals"]["bytes"] * copies},
                 files={name: {"bytes": os.path.getsize(os.path.join(out, name)),
                               "sha256": file_sha256(os.path.join(out, name))}
                        for name in (SAMPLES_FILE, RECORDS_FILE, REPORT_FILE)})
    cache = os.path.join(out, DATASET_CACHE)
    os.makedirs(cache)
    key = sample_table.table_key(index, out)
    sample_table.write(os.path.join(out, SAMPLES_FILE), cache, key)
    record_table.write(os.path.join(out, RECORDS_FILE), cache, key)
    with open(os.path.join(out, INDEX_FILE), "wb") as handle:
        handle.write(dumps(index))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 400_000])
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_index_")
    try:
        tars = os.path.join(work, "tars")
        write_tars(args.corpus, args.samples, tars)
        for check in ("decode", "header"):
            baseline = webdataset_rate(tars, check == "decode")
            print(f"webdataset{'.decode(\'pil\')' if check == 'decode' else ''} in one "
                  f"process: {baseline:.0f} samples/s (load {os.getloadavg()[0]:.1f})")
            for workers in (1, 2):
                line = index_throughput(tars, os.path.join(work, f"index-{check}-{workers}"),
                                        workers, check)
                found = re.search(r"(\d+) records/s", line)          # per worker
                assert found, line
                rate = float(found[1])
                print(f"--check {check} --workers {workers}: {line.split(': ', 1)[1]}; per "
                      f"worker {rate / baseline:.2f}x webdataset's (load "
                      f"{os.getloadavg()[0]:.1f})")
        base = os.path.join(work, "index-decode-1")
        start_table(((size, scaled_index(base, size // args.samples,
                                          os.path.join(work, f"x{size}")))
                     for size in args.sizes), args.config)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
