"""Benchmark ``mimo-inspect plan``'s dry run: the ranks' loaders sharing what each sample's
record and text gave (the plan as it runs) against each rank's loader reading and tokenizing
what it reads itself (``DataSource.share_texts`` left off), in the same run; prints seconds,
the ratio, each pass's ``text_batch`` records and whether the two plans are equal.

The sample corpus's text and image records are replicated to ``--samples`` (default 10,000),
each copy's answers numbered (no two texts alike). Both balances are planned, as the command
plans them; the passes run in ``--rounds`` interleaved rounds, in one process, one torch thread.

    python tools/bench_plan.py [--samples 10000] [--layout 'language=tp2,dp2;image=dp2']
                               [--rounds 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import torch

from mimo_data.inspect.plan import make_plan
from mimo_data.loading.layout import Layout
from mimo_data.loading.loader import DataSource
from mimo_data.preprocess.config import PreprocessConfig
from replicate_corpus import replicated_dataset


def _pass(source: DataSource, config: PreprocessConfig, layout: Layout, args,
          shared: bool) -> tuple[float, int, dict]:
    """One plan: its seconds, the records its ``text_batch`` calls took, the plan."""
    records: list[int] = []
    batch = source.metadata.text_batch

    def counted(given):
        records.append(len(given))
        return batch(given)
    source.metadata.text_batch = counted                      # type: ignore[method-assign]
    share = source.share_texts
    if not shared:                       # every rank's loader on its own, as before sharing
        source.share_texts = lambda capacity: share(0)       # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        _, plan = make_plan(source, config, layout, args)
        return time.perf_counter() - start, sum(records), plan
    finally:
        source.metadata.text_batch, source.share_texts = batch, share  # type: ignore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess_qwen2_vl.yaml")
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--layout", default="language=tp2,dp2;image=dp2")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = PreprocessConfig.from_yaml(args.config)
    layout = Layout.parse(args.layout)
    plan_args = argparse.Namespace(global_batch_size=args.global_batch_size,
                                   micro_batch_size=args.micro_batch_size, seed=0, epoch=0,
                                   balance="none", packing=False, json=False)
    work = tempfile.mkdtemp(prefix="bench_plan_")
    try:
        dataset = replicated_dataset(
            args.corpus, args.samples, work, unique_answers=True,
            keep=lambda r: all(m["modality"] == "image" for m in r["media"]))
        source = DataSource([dataset], config)       # its token table made here, untimed
        seconds: dict[str, list[float]] = {"shared": [], "each rank": []}
        records, plans = {}, {}
        for _ in range(args.rounds):
            for name in seconds:
                took, records[name], plans[name] = _pass(source, config, layout, plan_args,
                                                         shared=name == "shared")
                seconds[name].append(took)
        print(f"{args.samples} samples, {args.layout} ({layout.world_size} ranks), global "
              f"batch {args.global_batch_size}, micro batch {args.micro_batch_size}, both "
              f"balances, {args.rounds} rounds (best; every round in brackets)")
        for name, values in seconds.items():
            print(f"{name:10s} {min(values):7.2f} s  {records[name]:8d} records tokenized  "
                  f"[{', '.join(f'{v:.2f}' for v in values)}]")
        print(f"each rank / shared: {min(seconds['each rank']) / min(seconds['shared']):.2f}x; "
              f"plans equal: {plans['shared'] == plans['each rank']}")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
