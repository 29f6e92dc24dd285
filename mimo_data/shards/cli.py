"""`mimo-shard`: build, describe and verify indexed WebDataset shards."""

from __future__ import annotations

import argparse
import json
import re
import sys

from mimo_data.shards.build import BuildError, BuildOptions, build
from mimo_data.shards.index import DatasetError
from mimo_data.shards.info import dataset_info, format_info
from mimo_data.modalities.media import DEFAULT_MAX_IMAGE_PIXELS
from mimo_data.shards.sources import SourceError
from mimo_data.shards.verify import verify

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _byte_size(text: str) -> int:
    match = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500000, 512MB or 1GB")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mimo-shard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    b = commands.add_parser("build", help="turn raw datasets into indexed WebDataset shards")
    b.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="LLaVA/ShareGPT .json/.jsonl, .parquet, or speech manifest .jsonl")
    b.add_argument("--output", "-o", required=True, help="dataset directory to create")
    b.add_argument("--name", default="data", help="shard name prefix (default: data)")
    b.add_argument("--max-samples-per-shard", type=int, default=5000)
    b.add_argument("--max-shard-bytes", type=_byte_size, default=1 << 30,
                   help="e.g. 512MB (default 1GB)")
    b.add_argument("--workers", type=int, default=1,
                   help="processes validating media while the main one writes (0: all in one)")
    b.add_argument("--shuffle", action="store_true", help="write records in a seeded order")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--strict", action="store_true",
                   help="stop at the first bad record (exit 1) instead of skipping it")
    b.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    b.add_argument("--media-root", help="resolve relative media paths here "
                   "(default: the folder of the input file)")
    b.add_argument("--input-format", choices=("auto", "llava", "manifest", "parquet"),
                   default="auto")
    b.add_argument("--instruction", default="Transcribe the audio.",
                   help="user turn for speech-manifest records")
    for role in ("id", "messages", "image", "audio"):
        b.add_argument(f"--{role}-column", help=f"Parquet column holding the {role}"
                       f"{'s' if role in ('image', 'audio') else ''}")
    b.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help="skip images with more pixels (decompression bombs)")
    b.add_argument("--check", choices=("decode", "header"), default="decode",
                   help="decode: walk all media data (default); header: headers and stream "
                   "completeness only (faster, misses corruption inside the data)")
    b.add_argument("--no-progress", action="store_true")

    i = commands.add_parser("info", help="summarize a built dataset")
    i.add_argument("directory")
    i.add_argument("--json", action="store_true", help="machine-readable output")

    v = commands.add_parser("verify", help="re-read and check every shard against the index")
    v.add_argument("directory")
    v.add_argument("--workers", type=int, default=1)
    v.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            columns = {role: getattr(args, f"{attr}_column") for role, attr in
                       (("id", "id"), ("conversation", "messages"), ("images", "image"),
                        ("audios", "audio")) if getattr(args, f"{attr}_column")}
            options = BuildOptions(
                name=args.name, max_samples_per_shard=args.max_samples_per_shard,
                max_shard_bytes=args.max_shard_bytes, workers=args.workers,
                shuffle=args.shuffle, seed=args.seed, strict=args.strict,
                overwrite=args.overwrite, media_root=args.media_root,
                input_format=args.input_format, instruction=args.instruction, columns=columns,
                max_image_pixels=args.max_image_pixels, check=args.check,
                progress=not args.no_progress)
            build(args.inputs, args.output, options)
        elif args.command == "info":
            info = dataset_info(args.directory)
            print(json.dumps(info, indent=2) if args.json else format_info(info))
        else:
            problems = verify(args.directory, args.workers, progress=not args.no_progress)
            for problem in problems:
                print(f"verify: {problem}", file=sys.stderr)
            if problems:
                print(f"mimo-shard verify: FAILED, {len(problems)} problem(s) in "
                      f"{args.directory}", file=sys.stderr)
                return 1
            print(f"mimo-shard verify: OK, {args.directory}")
    except (BuildError, SourceError, DatasetError) as exc:
        print(f"mimo-shard {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
