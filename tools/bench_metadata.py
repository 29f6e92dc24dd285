"""Benchmark the language rank's metadata path against a fixed baseline, in the same run; prints
each one's samples/s and the ratio language rank / baseline.

On the sample corpus replicated to ``--samples`` (as ``bench_loader.py``), layout
``language=dp1;image=dp1;audio=dp1``, in micro-batches of ``--micro-batch-size``:

- baseline: each record read from the shards (``ShardReader.record``), then transformers' own
  ``apply_chat_template(messages, tokenize=True)`` and the ids padded into a micro-batch
  (``pad_sequence``): code mimo does not change, so its rate moves only with the machine;
- language rank (rank 0): ``build_loader``, metadata-only (records → chat template → tokens,
  markers expanded, masks → collated micro-batches with their metadata).

Runs alternate (noise from other tenants of the machine hits both alike); prints the medians
of ``--repeat`` runs and the ratio language / baseline. The ratio is the figure to compare
across commits: a slip of the language path shows as a drop of it on any machine
(``docs/benchmarks.md`` has its history). Both run in one process, one torch thread.

    python tools/bench_metadata.py [--samples 1000] [--repeat 9] [--dataset DIR]

``--dataset``: a dataset built already (e.g. by a first run's ``--keep``), to compare commits on
the same shards: ``PYTHONPATH=<old checkout>:tools python tools/bench_metadata.py --dataset D``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch.nn.utils.rnn import pad_sequence

from mimo_data.loading.loader import DataSource, build_loader
from replicate_corpus import replicated_dataset

LAYOUT = "language=dp1;image=dp1;audio=dp1"
LANGUAGE_RANK = 0


def language_rank(source: DataSource, micro: int, global_batch: int) -> Callable[[], int]:
    """One epoch of the language rank's loader; the samples it gave."""
    def run() -> int:
        loader = build_loader(source, None, LAYOUT, LANGUAGE_RANK, 3, global_batch, micro,
                              seed=0)
        assert loader is not None                  # the language rank needs data
        samples = sum(len(metadata["keys"]) for _, metadata in loader)
        loader.close()
        return samples
    return run


def baseline(source: DataSource, micro: int) -> Callable[[], int]:
    """Every record through the tokenizer's own chat template, padded in micro-batches."""
    tokenizer = source.metadata.text.tokenizer
    reader = source.readers[0]
    pad = source.metadata.text.pad_token_id

    def run() -> int:
        ids: list[torch.Tensor] = []
        for position in range(len(reader)):
            record = reader.record(position)
            ids.append(torch.tensor(tokenizer.apply_chat_template(
                record["messages"], tokenize=True, return_dict=True)["input_ids"]))
            if len(ids) == micro:
                pad_sequence(ids, batch_first=True, padding_value=pad)
                ids = []
        return len(reader)
    return run


def measure(runs: dict[str, Callable[[], int]], repeat: int) -> dict[str, float]:
    """Median samples/s of each run, ``repeat`` times, interleaved."""
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeat):
        for name, run in runs.items():
            start = time.perf_counter()
            samples = run()
            rates[name].append(samples / (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml")
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--dataset", help="a built dataset to use instead of replicating")
    parser.add_argument("--keep", help="replicate into this folder and keep it")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)      # as in a DataLoader worker: one process is one core
    work = args.keep or tempfile.mkdtemp(prefix="bench_metadata_")
    try:
        dataset = args.dataset or replicated_dataset(args.corpus, args.samples, work, shards=8)
        source = DataSource(dataset, args.config)
        runs = {"baseline (apply_chat_template)": baseline(source, args.micro_batch_size),
                "language rank": language_rank(source, args.micro_batch_size,
                                               args.global_batch_size)}
        for run in runs.values():                  # warm: skeletons, token caches
            run()
        rates = measure(runs, args.repeat)
    finally:
        if not args.keep:
            shutil.rmtree(work)
    print(f"{len(source.readers[0])} samples, micro batch {args.micro_batch_size}, global batch "
          f"{args.global_batch_size}; medians of {args.repeat} interleaved runs")
    for name, rate in rates.items():
        print(f"{name:32s} {rate:8.0f} samples/s")
    ratio = rates["language rank"] / rates["baseline (apply_chat_template)"]
    print(f"language rank / baseline: {ratio:.2f}x")


if __name__ == "__main__":
    main()
