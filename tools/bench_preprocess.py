"""Benchmark preprocessing per worker process on the sample corpus replicated to >= 2k samples;
prints each mode's samples/s, their ratios and the crc32 check's cost.

Three passes over the same shards, in the same run, one process with one torch thread, repeated
``--rounds`` times (interleaved; each mode's best time is reported):
- decode-only baseline: read the media, open, decode and resize images to the size the
  processor uses, decode and resample audio; no tokenization, no features, nothing else;
- full mode: the Preprocessor with media (tokens, masks, patches, log-mels);
- metadata-only mode: the Preprocessor without media (what language ranks run).
Prints samples/s and the ratios full / decode-only and metadata-only / full. Then the cost of
the reader's crc32 check of every member (``ShardReader.read_member``, in all three passes):
zlib's crc32 over every member's bytes, read beforehand, against the decode-only pass.

    python tools/bench_preprocess.py [--samples 2000] [--rounds 3] \\
        [--config configs/preprocess.yaml]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import zlib

import torch
from PIL import Image

from mimo_data.modalities.audio import decode_audio
from mimo_data.modalities.image import decode_image
from mimo_data.preprocess.preprocessor import Preprocessor, preprocess_dataset
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.tally import Tally
from mimo_data.shards.reader import ShardReader
from mimo_data.modalities.image import image_resized_size
from replicate_corpus import replicated_dataset




def _decode_only(reader: ShardReader, config: PreprocessConfig) -> None:
    images, audio = config.modalities["image"], config.modalities["audio"]
    for position in range(len(reader)):
        record = reader.record(position)
        for item in record["media"]:
            data = reader.read_member(position, item["member"])
            if item["modality"] == "image":
                image = decode_image(data, item["orientation"], images)
                image.resize(image_resized_size(image.width, image.height, images),
                             Image.Resampling.BICUBIC)
            else:
                decode_audio(data, audio)


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = PreprocessConfig.from_yaml(args.config)
    torch.set_num_threads(1)   # as in a DataLoader worker: one process is one core
    work = tempfile.mkdtemp(prefix="bench_preprocess_")
    try:
        reader = ShardReader(replicated_dataset(args.corpus, args.samples, work))
        full, meta = Preprocessor(config), Preprocessor(config, with_media=False)
        runs = {"decode-only": lambda: _decode_only(reader, config),
                "full": lambda: sum(1 for _ in preprocess_dataset(reader, full, Tally())),
                "metadata-only": lambda: sum(1 for _ in preprocess_dataset(reader, meta, Tally()))}
        # Rounds of the three passes, interleaved; each mode's best time counts (the least
        # disturbed by whatever else the machine runs), the per-round ratios show the spread.
        rounds = [{name: _timed(run) for name, run in runs.items()} for _ in range(args.rounds)]
        best = {name: min(r[name] for r in rounds) for name in runs}
        tally = Tally()
        sum(1 for _ in preprocess_dataset(reader, meta, tally))
        n = len(reader)
        print(f"{n} samples ({args.config}), one process, best of {args.rounds} rounds; "
              f"preprocessor: {tally.summary()}")
        for name, value in best.items():
            print(f"{name:14s} {n / value:9.0f} samples/s")
        spread = sorted(r["decode-only"] / r["full"] for r in rounds)
        print(f"full / decode-only:    {best['decode-only'] / best['full']:.2f}x  "
              f"(rounds: {', '.join(f'{x:.2f}' for x in spread)}; target >= 0.85)")
        spread = sorted(r["full"] / r["metadata-only"] for r in rounds)
        print(f"metadata-only / full:  {best['full'] / best['metadata-only']:.1f}x  "
              f"(rounds: {', '.join(f'{x:.1f}' for x in spread)}; target >= 20)")
        members = [reader.read_member(position, name) for position in range(n)
                   for name in reader.table.members(position)]
        check = min(_timed(lambda: [zlib.crc32(data) for data in members])
                    for _ in range(args.rounds))
        print(f"crc32 of every member ({sum(map(len, members)) / 1e6:.0f} MB): "
              f"{check / best['decode-only']:.1%} of the decode-only pass")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
