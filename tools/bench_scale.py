"""Start-up and memory against dataset size: what one rank pays before its first batch; prints
the start-ups' seconds and memory per size, the token table's and the report's rates, each
against its target.

Datasets: the sample corpus replicated to ``--base`` samples by ``mimo-shard build``
(``replicate_corpus.py``, every copy's answers numbered so that they tokenize as new text), then
scaled to each of ``--sizes`` by hard-linking its shards
``size / base`` times and renumbering the rows of ``samples.parquet`` (the same records again,
so the same per-sample work; the sample table is derived as ``mimo-shard build`` would write it,
before the clock starts). Each measurement runs in a fresh process, so memory and caches start
clean:

- start: a language rank (metadata-only, layout ``language=dp1;image=dp1;audio=dp1``) opens the
  dataset and takes its first batch; first start (no token table: computed in-process) and a
  later one (the table saved by the first). Anonymous memory (``/proc/self/smaps_rollup``)
  before and after, with torch and the tokenizer already loaded; the per-sample figure is the
  slope between the smallest and the largest dataset (fixed costs cancel).
- token table: computed with 1 process and with 2 (DataLoader workers), samples/s.
- report: ``mimo-inspect report`` without its saved tables (2 workers) and with them.

Targets: later start growing by at most 0.5 s per million samples (it hashes each saved table,
sha256 of its columns, and sorts the epoch's order of every sample: vectorized, linear work);
anonymous memory <= 32 bytes per sample; token table with 2 processes >= 1.7x one; report with
the tables >= 50x faster. The machine's load average is printed with each figure.

    python tools/bench_scale.py [--sizes 100000 1000000] [--base 10000]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from replicate_corpus import replicated_dataset

LAYOUT = "language=dp1;image=dp1;audio=dp1"


def scaled_dataset(base: str, copies: int, out: str) -> str:
    """``base``'s shards hard-linked ``copies`` times, its table rows renumbered."""
    from mimo_data.shards import sample_table
    from mimo_data.shards.cache import DATASET_CACHE
    from mimo_data.shards.format import INDEX_FILE, SAMPLES_FILE, sample_key, shard_name
    from mimo_data.files import file_sha256
    from mimo_data.shards.index import dumps, read_index

    index = read_index(base)
    table = pq.read_table(os.path.join(base, SAMPLES_FILE))
    os.makedirs(out)
    names, shards = {}, []
    for copy in range(copies):
        for number, shard in enumerate(index["shards"]):
            name = shard_name(index["name"], copy * len(index["shards"]) + number)
            os.link(os.path.join(base, shard["name"]), os.path.join(out, name))
            names[(copy, shard["name"])] = name
            shards.append({**shard, "name": name})
    rows = table.num_rows
    parts = []
    for copy in range(copies):
        keys = pa.array([sample_key(copy * rows + i) for i in range(rows)])
        shard_column = pa.array([names[(copy, s)] for s in table.column("shard").to_pylist()])
        parts.append(table.set_column(0, "key", keys).set_column(1, "shard", shard_column))
    samples = os.path.join(out, SAMPLES_FILE)
    pq.write_table(pa.concat_tables(parts), samples)
    index.update(shards=shards, totals={"samples": rows * copies, "shards": len(shards),
                                        "bytes": index["totals"]["bytes"] * copies})
    index["files"][SAMPLES_FILE] = {"bytes": os.path.getsize(samples),
                                    "sha256": file_sha256(samples)}
    shutil.copy(os.path.join(base, "report.json"), out)
    with open(os.path.join(out, INDEX_FILE), "wb") as handle:
        handle.write(dumps(index))
    os.makedirs(os.path.join(out, DATASET_CACHE))
    sample_table.write(samples, os.path.join(out, DATASET_CACHE),
                       sample_table.table_key(index, out))
    return out


def anonymous_kb() -> int:
    with open("/proc/self/smaps_rollup") as smaps:
        for line in smaps:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise RuntimeError("no Anonymous line in /proc/self/smaps_rollup")


def child(kind: str, dataset: str, config: str, workers: int) -> dict:
    """One measurement in this (fresh) process."""
    import torch

    from mimo_data.inspect.checks import Thresholds
    from mimo_data.inspect.report import build_report
    from mimo_data.inspect.stats import SampleInspector
    from mimo_data.loading.loader import DataSource, build_loader
    from mimo_data.loading.token_table import compute
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_data.preprocess.preprocessor import Preprocessor
    from mimo_data.shards.reader import ShardReader

    torch.set_num_threads(1)
    preprocess = PreprocessConfig.from_yaml(config)
    if kind == "start":
        # the rank's text encoder (tokenizer loaded, libraries imported) before the baseline,
        # handed to the data source as mimo_train's trainer hands its own: a second tokenizer
        # load inside the span would count its parse's freed buffers, which malloc keeps
        text = Preprocessor(preprocess, with_media=False).text
        before = anonymous_kb()
        start = time.perf_counter()
        source = DataSource(dataset, preprocess, text=text)
        loader = build_loader(source, None, LAYOUT, 0, 3, 32, 4, seed=0)
        assert loader is not None
        next(iter(loader))
        seconds = time.perf_counter() - start
        loader.close()
        return {"seconds": seconds, "anonymous_kb": anonymous_kb() - before}
    if kind == "table":
        reader = ShardReader(dataset)
        preprocessor = Preprocessor(preprocess, with_media=False)
        start = time.perf_counter()
        compute(reader, preprocessor, num_workers=workers)
        return {"seconds": time.perf_counter() - start, "samples": len(reader)}
    start = time.perf_counter()
    report = build_report(dataset, SampleInspector(preprocess), Thresholds(), progress=False,
                          workers=workers)
    return {"seconds": time.perf_counter() - start, "reused": report["tables"]["reused"]}


def measure(kind: str, dataset: str, config: str, workers: int = 0) -> dict:
    load = os.getloadavg()[0]
    result = subprocess.run([sys.executable, __file__, "--child", kind, dataset, config,
                             str(workers)], capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{kind} on {dataset} failed:\n{result.stderr[-3000:]}")
    return {**json.loads(result.stdout.splitlines()[-1]), "load": load}


def forget_tables(dataset: str) -> None:
    """Remove the saved token and report tables (not the sample table: the build writes it)."""
    for path in glob.glob(os.path.join(dataset, ".mimo-cache", "*")):
        if not os.path.basename(path).startswith("samples-"):
            os.remove(path)


def start_table(datasets: Iterable[tuple[int, str]], config: str) -> dict[int, dict]:
    """A language rank's start-up on each (size, dataset), twice (the first computes the
    token table, the later one reads it), printed as a table with the later start's growth a
    million samples (target <= 0.5 s) and its ratio largest / smallest; the later
    measurements by size."""
    starts = {}
    print(f"{'samples':>9s}  {'first start':>12s}  {'later start':>12s}  "
          f"{'anonymous':>10s}  load")
    for size, dataset in datasets:
        first = measure("start", dataset, config)
        later = measure("start", dataset, config)
        starts[size] = later
        print(f"{size:9d}  {first['seconds']:10.1f} s  {later['seconds']:10.2f} s  "
              f"{later['anonymous_kb'] / 1024:7.1f} MB  {first['load']:.1f}, "
              f"{later['load']:.1f}")
    small, large = min(starts), max(starts)
    if small == large:                  # one size: no growth to measure
        return starts
    growth = (starts[large]["seconds"] - starts[small]["seconds"]) * 1e6 / (large - small)
    print(f"later start at {large} / at {small}: "
          f"{starts[large]['seconds'] / starts[small]['seconds']:.2f}x; it grows "
          f"{growth:.2f} s per million samples (target <= 0.5)")
    return starts


# the size below which the start-ups and rates measured are noise (hundredths of a second)
NOISE_FLOOR = 100_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--base", type=int, default=10_000)
    parser.add_argument("--child", nargs=4, metavar=("KIND", "DATASET", "CONFIG", "WORKERS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, dataset, config, workers = args.child
        print(json.dumps(child(kind, dataset, config, int(workers))))
        return
    if args.base < 1 or any(size < args.base or size % args.base for size in args.sizes):
        parser.error(f"--sizes must be multiples of --base ({args.base}): each size is the base "
                     "dataset hard-linked size / base times")
    if len(set(args.sizes)) < 2:
        parser.error("--sizes: give two sizes or more (the figures are slopes between them)")
    if max(args.sizes) < NOISE_FLOOR:
        print(f"note: the largest size, {max(args.sizes)}, is under {NOISE_FLOOR}: its seconds "
              "are within the timer's and the load's noise, so the targets are read at the "
              "default sizes only")
    work = tempfile.mkdtemp(prefix="bench_scale_")
    try:
        base = replicated_dataset(args.corpus, args.base, work, shards=max(1, args.base // 2500),
                                  unique_answers=True)
        datasets = {size: scaled_dataset(base, size // args.base,
                                         os.path.join(work, f"scaled-{size}"))
                    for size in args.sizes}
        for dataset in datasets.values():
            forget_tables(dataset)
        starts = start_table(datasets.items(), args.config)
        small, large = min(starts), max(starts)
        slope = (starts[large]["anonymous_kb"] - starts[small]["anonymous_kb"]) * 1024 / \
            (large - small)
        print(f"anonymous memory per sample (slope {small} -> {large}): {slope:.1f} bytes "
              "(target <= 32)")
        one = measure("table", datasets[small], args.config, 0)
        two = measure("table", datasets[small], args.config, 2)
        rate_one, rate_two = (r["samples"] / r["seconds"] for r in (one, two))
        print(f"token table at {small}: 1 process {rate_one:.0f} samples/s (load "
              f"{one['load']:.1f}), 2 processes {rate_two:.0f} samples/s (load "
              f"{two['load']:.1f}): {rate_two / rate_one:.2f}x (target >= 1.7)")
        forget_tables(datasets[large])
        without = measure("report", datasets[large], args.config, 2)
        with_tables = measure("report", datasets[large], args.config, 2)
        assert not without["reused"] and with_tables["reused"]
        print(f"report at {large}: without tables {without['seconds']:.1f} s (load "
              f"{without['load']:.1f}), with {with_tables['seconds']:.2f} s (load "
              f"{with_tables['load']:.1f}): {without['seconds'] / with_tables['seconds']:.0f}x "
              "(target >= 50)")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
