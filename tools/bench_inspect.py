"""Benchmark ``mimo-inspect report`` against the metadata-only Preprocessor, on one core.

The sample corpus is replicated to ``--samples`` (default 10,000) samples. Every copy's
assistant answers get the copy number, so no two conversations are the same text (a cache of
whole conversations or answers would otherwise make the replicated corpus look faster than real
data); prompts, system prompts and template text repeat as they do in real datasets.
``--modalities text+image`` (default) keeps the text-only and image records, the case the
issue's target (>= 5k samples/s) is about; ``all`` keeps the audio records too.

Passes over the same dataset, in the same process, pinned to one CPU, one torch thread:
- baseline: ``preprocess_dataset`` with the metadata-only Preprocessor (what language ranks run);
- report: ``build_report`` (every check, piece-cached tokenization);
- report --no-token-cache: the same with whole-conversation tokenization.
Prints samples/s and the ratios to the baseline.

    python tools/bench_inspect.py [--samples 10000] [--modalities text+image|all] [--cpu 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

from mimo_data.build import BuildOptions, build
from mimo_data.inspect_report import Thresholds, build_report
from mimo_data.inspect_stats import SampleInspector
from mimo_data.preprocess import Preprocessor, preprocess_dataset
from mimo_data.preprocess_config import PreprocessConfig
from mimo_data.report import Tally
from mimo_data.shard_reader import ShardReader

CORPUS_INPUTS = ("llava.json", "llava.jsonl", "conversations.parquet", "speech.parquet",
                 "speech_manifest.jsonl")


def _replicated_dataset(corpus: str, samples: int, modalities: str, work: str) -> str:
    """Build the corpus once, then a dataset of its records repeated to ``samples``, each
    copy's answers made unique."""
    once = os.path.join(work, "once")
    build([os.path.join(corpus, name) for name in CORPUS_INPUTS], once,
          BuildOptions(progress=False))
    reader = ShardReader(once)
    records = [reader.record(i) for i in range(len(reader))]
    positions = [i for i, r in enumerate(records)
                 if modalities == "all" or all(m["modality"] == "image" for m in r["media"])]
    jsonl = os.path.join(work, "replicated.jsonl")
    media_dir = os.path.join(work, "media")
    os.makedirs(media_dir)
    with open(jsonl, "w") as out:
        for i in range(samples):
            position = positions[i % len(positions)]
            record = records[position]
            paths = {}
            for item in record["media"]:
                path = os.path.join(media_dir, f"{record['key']}.{item['member']}")
                if not os.path.exists(path):
                    with open(path, "wb") as media:
                        media.write(reader.read_member(position, item["member"]))
                paths.setdefault(item["modality"], []).append(path)
            messages = [dict(m, content=f"(Copy {i}.) {m['content']}")
                        if m["role"] == "assistant" else m for m in record["messages"]]
            out.write(json.dumps({"id": f"r{i}", "messages": messages,
                                  "images": paths.get("image", []),
                                  "audios": paths.get("audio", [])}) + "\n")
    dataset = os.path.join(work, "replicated")
    build([jsonl], dataset, BuildOptions(progress=False, check="header"))
    return dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml")
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--modalities", choices=("text+image", "all"), default="text+image")
    parser.add_argument("--cpu", type=int, default=0, help="CPU to pin to (-1: no pinning)")
    args = parser.parse_args()
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    config = PreprocessConfig.from_yaml(args.config)
    work = tempfile.mkdtemp(prefix="bench_inspect_")
    try:
        dataset = _replicated_dataset(args.corpus, args.samples, args.modalities, work)
        reader = ShardReader(dataset)
        n = len(reader)
        baseline = Preprocessor(config, with_media=False)
        cached = SampleInspector(config)
        uncached = SampleInspector(config, cache_tokens=False)
        tally = Tally()
        start = time.perf_counter()
        for _ in preprocess_dataset(reader, baseline, tally):
            pass
        seconds = {"preprocessor (metadata-only)": time.perf_counter() - start}
        reports = {}
        for name, inspector in (("report", cached), ("report --no-token-cache", uncached)):
            start = time.perf_counter()
            reports[name] = build_report(dataset, inspector, Thresholds(), progress=False)
            seconds[name] = time.perf_counter() - start
        same = all(reports["report"][k] == reports["report --no-token-cache"][k]
                   for k in ("tokens", "sequence_length", "modalities", "flagged"))
        pinned = f"CPU {args.cpu}" if args.cpu >= 0 else "not pinned"
        print(f"{n} samples ({args.modalities}, {args.config}), one process, {pinned}; "
              f"preprocessor: {tally.summary()}")
        base = seconds["preprocessor (metadata-only)"]
        for name, value in seconds.items():
            print(f"{name:30s} {n / value:8.0f} samples/s  {base / value:5.2f}x the preprocessor")
        print(f"report == report --no-token-cache: {same}; checks passed: "
              f"{reports['report']['passed']}; token pieces cached/encoded: "
              f"{reports['report']['token_cache']}")
        print("target: report >= 5000 samples/s on a text+image dataset")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
