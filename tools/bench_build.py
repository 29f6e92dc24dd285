"""Benchmark `mimo-shard build` against a plain `webdataset.ShardWriter` in the same run; prints
each one's samples/s and MB/s and the ratio to the plain writer.

Both write the same records: the sample corpus's image/audio conversation records replicated to
``--records`` (media already encoded, so neither re-encodes). The plain writer reads each media
file and writes it with the record's JSON, nothing else; the build also normalizes, validates
(per ``--check``), indexes and hashes. Prints samples/s, MB/s and the ratio to the plain writer.

    python tools/bench_build.py [--records 2000] [--corpus assets/corpus]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import webdataset

from mimo_data.shards.build import BuildOptions, build


def _media_records(corpus: str) -> list[dict]:
    """Corpus JSONL/JSON records that carry media, with absolute media paths."""
    records = []
    for name in ("llava.jsonl", "llava.json"):
        path = os.path.join(corpus, name)
        with open(path) as handle:
            rows = ([json.loads(line) for line in handle if line.strip()]
                    if name.endswith(".jsonl") else json.load(handle))
        for row in rows:
            media = {}
            for field in ("image", "images", "audio", "audios"):
                if field in row:
                    values = row[field] if isinstance(row[field], list) else [row[field]]
                    media[field] = [os.path.abspath(os.path.join(corpus, v)) for v in values]
            if media:
                records.append({**row, **media})
    return records


def _replicate(records: list[dict], count: int, path: str) -> None:
    with open(path, "w") as out:
        for i in range(count):
            record = dict(records[i % len(records)], id=f"r{i}")
            out.write(json.dumps(record) + "\n")


def _plain_writer(jsonl: str, directory: str, max_count: int) -> int:
    """The baseline: webdataset.ShardWriter with the same media bytes and the record JSON."""
    written = 0
    with webdataset.ShardWriter(os.path.join(directory, "plain-%06d.tar"), maxcount=max_count,
                                verbose=0) as sink:
        with open(jsonl) as lines:
            for i, line in enumerate(lines):
                record = json.loads(line)
                sample = {"__key__": f"{i:09d}", "json": json.dumps(record).encode()}
                images = record.get("images", record.get("image", []))
                audios = record.get("audios", record.get("audio", []))
                for prefix, paths in (("img", images), ("aud", audios)):
                    for j, media_path in enumerate(paths):
                        with open(media_path, "rb") as media:
                            ext = os.path.splitext(media_path)[1].lstrip(".")
                            sample[f"{prefix}{j}.{ext}"] = media.read()
                sink.write(sample)
                written += 1
    return written


def _checked_build(jsonl: str, out: str, options: BuildOptions, expected: int) -> None:
    written = build([jsonl], out, options)["totals"]["samples"]
    if written != expected:
        raise SystemExit(f"bench: the build wrote {written} of {expected} records; see {out}")


def _bytes_in(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
               if n.endswith(".tar"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs per variant")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="bench_build_")
    try:
        jsonl = os.path.join(work, "records.jsonl")
        _replicate(_media_records(args.corpus), args.records, jsonl)

        def timed(run) -> tuple[float, int]:
            best, size = float("inf"), 0
            for _ in range(args.repeats):
                out = tempfile.mkdtemp(dir=work)
                start = time.perf_counter()
                run(out)
                best = min(best, time.perf_counter() - start)
                size = _bytes_in(out)
                shutil.rmtree(out)
            return best, size

        variants: dict[str, Callable[[str], object]] = {
            "plain webdataset.ShardWriter": lambda out: _plain_writer(jsonl, out, 1000)}
        for check in ("header", "decode"):
            for workers in (0, 1, 2):
                options = BuildOptions(max_samples_per_shard=1000, workers=workers, check=check,
                                       progress=False, overwrite=True)
                variants[f"mimo-shard build --check {check} --workers {workers}"] = (
                    functools.partial(_checked_build, jsonl, options=options,
                                      expected=args.records))
        results = {name: timed(run) for name, run in variants.items()}

        base_time = results["plain webdataset.ShardWriter"][0]
        print(f"{args.records} records ({_bytes_in_records(jsonl) / 1e6:.1f} MB of media), "
              f"best of {args.repeats}, {os.cpu_count()} CPUs")
        print(f"{'variant':50s} {'samples/s':>10s} {'MB/s':>8s} {'ratio':>7s}")
        for name, (seconds, size) in results.items():
            print(f"{name:50s} {args.records / seconds:10.0f} {size / 1e6 / seconds:8.1f} "
                  f"{base_time / seconds:6.2f}x")
    finally:
        shutil.rmtree(work)


def _bytes_in_records(jsonl: str) -> int:
    total = 0
    with open(jsonl) as lines:
        for line in lines:
            record = json.loads(line)
            for field in ("image", "images", "audio", "audios"):
                values = record.get(field, [])
                for path in values if isinstance(values, list) else [values]:
                    total += os.path.getsize(path)
    return total


if __name__ == "__main__":
    main()
