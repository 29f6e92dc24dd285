"""A dataset of the sample corpus's records repeated to any size, for the benchmarks.

The corpus is built once into ``WORK/once``; its records are written to a JSONL with their
media as files (so the builder reads real files), ``samples`` records long, and built.
"""

from __future__ import annotations

import itertools
import json
import os

from mimo_data.shards.build import BuildOptions, build
from mimo_data.shards.reader import ShardReader

CORPUS_INPUTS = ("llava.json", "llava.jsonl", "conversations.parquet", "speech.parquet",
                 "speech_manifest.jsonl")


def replicated_dataset(corpus: str, samples: int, work: str, *, keep=None,
                       unique_answers: bool = False, shards: int | None = None,
                       inputs: tuple[str, ...] = CORPUS_INPUTS, kind=None) -> str:
    """Build and return a dataset directory of ``samples`` corpus records (cycled in order).

    ``keep(record) -> bool`` selects which corpus records are cycled; ``unique_answers``
    prefixes each copy's assistant turns with its number (no two texts alike); ``shards``
    splits the result into about that many shards; ``inputs``: the corpus's files read
    (``video.jsonl`` too: its clips); ``kind(record) -> str``: the kept records taken in
    turn from each kind (images, clips: both in the first micro-batches), else in order.
    """
    # absolute: the media paths written into the JSONL are read relative to its folder
    work = os.path.abspath(work)
    # the corpus built once per set of inputs (a work folder reused with others builds again)
    once = os.path.join(work, "once" if inputs == CORPUS_INPUTS else "once-" + "-".join(inputs))
    if not os.path.isdir(once):
        build([os.path.join(corpus, name) for name in inputs], once,
              BuildOptions(progress=False, workers=0))
    reader = ShardReader(once)
    positions = [i for i in range(len(reader)) if keep is None or keep(reader.record(i))]
    if kind is not None:
        kinds: dict[str, list[int]] = {}
        for i in positions:
            kinds.setdefault(kind(reader.record(i)), []).append(i)
        positions = [i for turn in itertools.zip_longest(*kinds.values()) for i in turn
                     if i is not None]
    media_dir = os.path.join(work, "media")
    os.makedirs(media_dir, exist_ok=True)
    jsonl = os.path.join(work, f"replicated-{samples}.jsonl")
    with open(jsonl, "w") as out:
        for i in range(samples):
            position = positions[i % len(positions)]
            record = reader.record(position)
            paths: dict[str, list[str]] = {}
            for item in record["media"]:
                path = os.path.join(media_dir, f"{record['key']}.{item['member']}")
                if not os.path.exists(path):
                    with open(path, "wb") as media:
                        media.write(reader.read_member(position, item["member"]))
                paths.setdefault(item["modality"], []).append(path)
            messages = [dict(m, content=f"(Copy {i}.) {m['content']}")
                        if unique_answers and m["role"] == "assistant" else m
                        for m in record["messages"]]
            out.write(json.dumps({"id": f"r{i}", "messages": messages,
                                  "images": paths.get("image", []),
                                  "audios": paths.get("audio", []),
                                  "videos": paths.get("video", [])}) + "\n")
    dataset = os.path.join(work, f"replicated-{samples}")
    options = BuildOptions(progress=False, check="header", overwrite=True)
    if shards:
        options.max_samples_per_shard = max(1, samples // shards)
    build([jsonl], dataset, options)
    os.remove(jsonl)
    return dataset
