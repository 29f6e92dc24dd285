"""Benchmark the layout-aware loader against a plain webdataset pipeline, in the same run; prints
steps/s, samples/s and the main process's CPU time per micro-batch, their ratios, and the
language rank's memory while it iterates.

On the sample corpus replicated to ``--samples`` (shards of samples/8, so webdataset can split
shards over workers), layout ``language=dp1;image=dp1;audio=dp1``:

- plain: ``webdataset.WebDataset`` over the shards → the same full Preprocessor → the same
  Collator in micro-batches, through a DataLoader with 0/1/2 workers (the baseline);
- encoder rank (images, rank 1): ``build_loader`` decoding media, 0/1/2 workers;
- language rank (rank 0): ``build_loader``, metadata-only, 0/1/2 workers.

Prints medians of ``--repeat`` interleaved runs: steps/s, samples/s and the main process's CPU
time per micro-batch (what the training process pays; workers take the rest), the ratios
encoder / plain (target >= 0.9) and
language / encoder (target >= 10), then the language rank's RSS while it iterates a dataset
of ``--rss-samples`` samples (target: flat within 10% from 1k samples to the end), with the
loader build time and RSS over a 1k-sample dataset for comparison. DataLoader workers run one
torch thread each; the main process is set to one thread too (a worker's view).

    python tools/bench_loader.py [--samples 1000] [--repeat 3] [--rss-samples 50000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.utils.data
import webdataset as wds

from mimo_data.preprocess.collate import Collator
from mimo_data.loading.loader import DataSource, build_loader
from mimo_data.process_memory import status_bytes
from mimo_data.preprocess.preprocessor import Preprocessor, SampleDropped
from replicate_corpus import replicated_dataset

LAYOUT = "language=dp1;image=dp1;audio=dp1"
LANGUAGE_RANK, ENCODER_RANK = 0, 1


class _Plain(torch.utils.data.IterableDataset):
    """The baseline: webdataset's tar reader, the same preprocessing and collate."""

    def __init__(self, directory: str, preprocessor: Preprocessor, micro_batch_size: int):
        self.urls = sorted(os.path.join(directory, n) for n in os.listdir(directory)
                           if n.endswith(".tar"))
        self.preprocessor = preprocessor
        self.micro_batch_size = micro_batch_size

    def _samples(self, source):
        for sample in source:
            record = json.loads(sample["json"])
            media = {item["member"]: sample[item["member"]] for item in record["media"]}
            try:
                yield self.preprocessor(record, media)
            except SampleDropped:
                continue

    def __iter__(self):
        pipeline = wds.DataPipeline(wds.SimpleShardList(self.urls), wds.split_by_worker,
                                    wds.tarfile_to_samples(), self._samples,
                                    wds.batched(self.micro_batch_size,
                                                collation_fn=Collator(self.preprocessor),
                                                partial=True))
        return iter(pipeline)


def _as_is(item):
    return item


def _rate(batches) -> tuple[float, float, int, int]:
    """(seconds, main-process CPU seconds, micro-batches, samples) to exhaust ``batches`` (the
    first one not timed: it pays for worker start-up in every pipeline alike)."""
    iterator = iter(batches)
    next(iterator)
    start, cpu = time.perf_counter(), time.process_time()
    count = samples = 0
    for _, metadata in iterator:
        count += 1
        samples += len(metadata["keys"])
    return time.perf_counter() - start, time.process_time() - cpu, count, samples


def throughput(dataset: str, config: str, micro: int, global_batch: int, workers: list[int],
               repeat: int):
    """Every pipeline and worker count ``repeat`` times, interleaved (so that noise from other
    tenants of the machine hits all alike); medians."""
    source = DataSource(dataset, config)
    plain_preprocessor = Preprocessor(source.config, text=source.metadata.text)
    runs: dict[tuple, list] = {}
    for _ in range(repeat):
        for count in workers:
            plain = torch.utils.data.DataLoader(_Plain(dataset, plain_preprocessor, micro),
                                                batch_size=None, num_workers=count,
                                                collate_fn=_as_is)
            runs.setdefault(("plain webdataset", count), []).append(_rate(plain))
            for name, rank in (("encoder rank", ENCODER_RANK), ("language rank", LANGUAGE_RANK)):
                loader = build_loader(source, None, LAYOUT, rank, 3, global_batch, micro, seed=0,
                                      num_workers=count)
                assert loader is not None          # both ranks need data
                runs.setdefault((name, count), []).append(_rate(loader))
                loader.close()
    micro_per_step = global_batch // micro
    print(f"{len(source.readers[0])} samples, layout {LAYOUT}, global batch {global_batch}, "
          f"micro batch {micro}; medians of {repeat} runs")
    print(f"{'pipeline':18s} workers   steps/s  samples/s  main CPU ms/micro-batch")
    rates = {}
    for (name, count), results in runs.items():
        seconds, cpu, batches, samples = (statistics.median(r[i] for r in results)
                                          for i in range(4))
        rates[(name, count)] = samples / seconds
        print(f"{name:18s} {count:7d} {batches / micro_per_step / seconds:9.2f} "
              f"{samples / seconds:10.0f}  {1000 * cpu / batches:10.2f}")
    for count in workers:
        encoder = rates[("encoder rank", count)]
        plain = rates[('plain webdataset', count)]
        print(f"{count} workers: encoder / plain {encoder / plain:.2f}x"
              f" (target >= 0.9), language / encoder "
              f"{rates[('language rank', count)] / encoder:.1f}x (target >= 10)")


def _rss_mb() -> float:
    return status_bytes("VmRSS")["VmRSS"] / 2**20


def rss(small: str, large: str, config: str, micro: int, global_batch: int) -> None:
    for name, dataset in (("1k", small), ("large", large)):
        before = _rss_mb()
        start = time.perf_counter()
        source = DataSource(dataset, config)
        loader = build_loader(source, None, LAYOUT, LANGUAGE_RANK, 3, global_batch, micro,
                              seed=0)
        assert loader is not None                  # the language rank needs data
        print(f"{name} dataset ({len(source.readers[0])} samples): loader built in "
              f"{time.perf_counter() - start:.1f} s (drop decisions included), RSS "
              f"{before:.0f} -> {_rss_mb():.0f} MB")
        if dataset is not large:
            del loader, source
            continue
        consumed, marks = 0, {}
        start = time.perf_counter()
        for _, metadata in loader:
            consumed += len(metadata["keys"])
            for mark in (1000, 10000, 25000):
                if consumed >= mark and mark not in marks:
                    marks[mark] = _rss_mb()
        marks[consumed] = _rss_mb()
        seconds = time.perf_counter() - start
        print(f"language rank RSS while iterating {consumed} samples ({consumed / seconds:.0f} "
              "samples/s): " + ", ".join(f"{m} samples {v:.0f} MB" for m, v in marks.items()))
        if 1000 not in marks:                    # samples dropped by preprocessing
            print(f"RSS growth not measured: the loader gave {consumed} samples, under 1k")
            return
        growth = marks[consumed] / marks[1000] - 1
        print(f"RSS growth from 1k to {consumed} samples: {growth:+.1%} (target within ±10%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rss-samples", type=int, default=50000)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if args.rss_samples < 0 or 0 < args.rss_samples <= 1000 + args.global_batch_size:
        parser.error(f"--rss-samples {args.rss_samples}: give more than 1000 + a global batch "
                     "(the growth is measured from the first 1k samples), or 0 to skip the "
                     "RSS run")
    torch.set_num_threads(1)      # as in a DataLoader worker: one process is one core
    work = tempfile.mkdtemp(prefix="bench_loader_")
    try:
        dataset = replicated_dataset(args.corpus, args.samples, work, shards=8)
        throughput(dataset, args.config, args.micro_batch_size, args.global_batch_size,
                   args.workers, args.repeat)
        if args.rss_samples:
            small = dataset if args.samples == 1000 else replicated_dataset(args.corpus, 1000,
                                                                             work, shards=8)
            large = replicated_dataset(args.corpus, args.rss_samples, work, shards=8)
            rss(small, large, args.config, args.micro_batch_size, args.global_batch_size)
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
