"""Benchmark ``mimo-inspect report`` against the metadata-only Preprocessor, on one core; prints
each pass's samples/s and its ratio to the preprocessor.

The sample corpus is replicated to ``--samples`` (default 10,000) samples. Every copy's
assistant answers get the copy number, so no two conversations are the same text (a cache of
whole conversations or answers would otherwise make the replicated corpus look faster than real
data); prompts, system prompts and template text repeat as they do in real datasets.
``--modalities text+image`` (default) keeps the text-only and image records, the case the
issue's target (>= 5k samples/s) is about; ``all`` keeps the audio records too.

Passes over the same dataset, in the same process, pinned to one CPU, one torch thread:
- baseline: ``preprocess_dataset`` with the metadata-only Preprocessor (what language ranks run);
- report: ``build_report`` (every check, piece-cached tokenization);
- report --no-token-cache: the same with whole-conversation tokenization;
- tokenizer alone: only the tokenizer's batch calls on the text pieces the report encodes
  (the texts rendered beforehand), the floor under any report on this path.
The modes run in ``--rounds`` interleaved rounds, each with a new tokenizer and an empty piece
cache; prints each mode's best samples/s, every round's, and the ratios to the baseline.

    python tools/bench_inspect.py [--samples 10000] [--modalities text+image|all] [--cpu 0]
                                  [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from mimo_data.inspect.report import Thresholds, build_report
from mimo_data.inspect.stats import SampleInspector
from mimo_data.preprocess.preprocessor import TEXT_BATCH, Preprocessor, preprocess_dataset
from mimo_data.preprocess.segment_tokenizer import SegmentCachedTokenizer
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.tally import Tally
from mimo_data.shards.reader import ShardReader
from replicate_corpus import replicated_dataset




def _new_pieces(reader: ShardReader, text) -> list[list[str]]:
    """Per chunk of TEXT_BATCH samples, the text pieces not seen before (what one text_batch
    encodes)."""
    seen, chunks = set(), []
    for chunk in range(0, len(reader), TEXT_BATCH):
        batch = []
        for position in range(chunk, min(len(reader), chunk + TEXT_BATCH)):
            rendered = text.render(text.kinds.roles(reader.record(position)))[0]
            for piece in text.backend._split(rendered):
                if piece and piece not in seen:
                    seen.add(piece)
                    batch.append(piece)
        chunks.append(batch)
    return chunks


def _round(dataset: str, reader: ShardReader, config: PreprocessConfig) -> tuple[dict, str]:
    """One pass of each mode, each with a new tokenizer and an empty piece cache; seconds by
    mode, and a line on what the reports found."""
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
        reports[name] = build_report(dataset, inspector, Thresholds(), progress=False,
                                     reuse=False)
        seconds[name] = time.perf_counter() - start
    # The floor set by the tokenizer itself: the same new pieces the report encodes, in the
    # same batches and calls, with nothing around them (texts rendered beforehand, untimed).
    floor = Preprocessor(config, with_media=False).text
    pieces = _new_pieces(reader, floor)
    assert isinstance(floor.backend, SegmentCachedTokenizer)   # the report's (cached) path
    tokenizer, summed = floor.backend.backend, floor.backend._token_lengths is not None
    start = time.perf_counter()
    for batch in pieces:     # as the report calls it: no offsets for ASCII (summed) pieces
        tokenizer.encode_batch_fast([piece for piece in batch if summed and piece.isascii()],
                                    add_special_tokens=False)
        tokenizer.encode_batch([piece for piece in batch if not (summed and piece.isascii())],
                               add_special_tokens=False)
    seconds["tokenizer alone (new pieces)"] = time.perf_counter() - start
    same = all(reports["report"][k] == reports["report --no-token-cache"][k]
               for k in ("tokens", "sequence_length", "modalities", "flagged"))
    return seconds, (f"preprocessor: {tally.summary()}; report == report --no-token-cache: "
                     f"{same}; checks passed: {reports['report']['passed']}; token pieces "
                     f"cached/encoded: {reports['report']['token_cache']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml")
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--modalities", choices=("text+image", "all"), default="text+image")
    parser.add_argument("--cpu", type=int, default=0, help="CPU to pin to (-1: no pinning)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="passes of every mode, interleaved (a shared machine swings)")
    args = parser.parse_args()
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    torch.set_num_threads(1)
    config = PreprocessConfig.from_yaml(args.config)
    work = tempfile.mkdtemp(prefix="bench_inspect_")
    try:
        def images_only(r):
            return all(m["modality"] == "image" for m in r["media"])
        dataset = replicated_dataset(args.corpus, args.samples, work, unique_answers=True,
                                     keep=None if args.modalities == "all" else images_only)
        reader = ShardReader(dataset)
        n = len(reader)
        rounds = [_round(dataset, reader, config) for _ in range(args.rounds)]
        pinned = f"CPU {args.cpu}" if args.cpu >= 0 else "not pinned"
        print(f"{n} samples ({args.modalities}, {args.config}), one process, {pinned}, "
              f"{args.rounds} rounds (each mode's best time; every round in brackets)")
        best = {name: min(seconds[name] for seconds, _ in rounds) for name in rounds[0][0]}
        base = best["preprocessor (metadata-only)"]
        for name, value in best.items():
            each = ", ".join(f"{n / seconds[name]:.0f}" for seconds, _ in rounds)
            print(f"{name:30s} {n / value:8.0f} samples/s  {base / value:5.2f}x the preprocessor"
                  f"  [{each}]")
        print(rounds[-1][1])
        print("target: report >= 5000 samples/s on a text+image dataset")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
