"""`mimo-shard`: build indexed WebDataset shards, index existing ones in place, describe, verify.

Exit status (the same for every mimo CLI):
  0  ok
  1  a check or the data failed: verify found a problem, --strict stopped at a bad record,
     the dataset directory is incomplete or damaged, remote storage failed after retries,
     a worker process died (killed or crashed), another build or indexing is writing the
     output; also, quietly, when standard output's reader has gone (``| head``:
     mimo_data.stdout)
  2  usage or config error: bad arguments, an input that cannot be opened or read as given,
     an output directory in the way, no such dataset directory
  130, 143  stopped by Ctrl-C or SIGTERM (a scheduler's cancel or time limit) as a failed
     run stops: its local files removed (shards it uploaded, the next build removes), its
     output's claim given back
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from mimo_data.arguments import at_least, Parser, user_path
from mimo_data.hub import cache_only
from mimo_data.interrupts import Terminated, sigterm_as_interrupt
from mimo_data.stdout import quiet_when_stdout_closes

# Nothing heavy here: pyarrow, PIL and webdataset (torch) are imported once the arguments are
# parsed, so that --help answers at once. A URL's credentials and endpoint come from the
# environment or the client's config (AWS_* variables, ~/.aws, FSSPEC_S3_* for s3fs).

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# The registered modalities (mimo_data.modalities.MODALITIES, which imports torch): one
# --NAME-column option each.
MEDIA_COLUMNS = ("image", "audio", "video")


def _byte_size(text: str) -> int:
    """Bytes, or KB/MB/GB (powers of 1024, as KiB/MiB/GiB), a fraction allowed (1.5GB)."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 500000, 512MB or 1.5GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _shard_name(text: str) -> str:
    """A shard name prefix: one file name's start (NAME-000000.tar beside the index)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a shard name prefix is letters, digits, '.', '_' and '-', starting with "
            "a letter or digit (the shards are NAME-000000.tar beside the index)")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mimo-shard", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True,
                                     help="what to do (each has its own --help)")

    b = commands.add_parser("build", help="turn raw datasets into indexed WebDataset shards")
    b.add_argument("inputs", type=user_path, nargs="+", metavar="INPUT",
                   help="LLaVA/ShareGPT .json/.jsonl, .parquet, speech manifest .jsonl, "
                   "interleaved documents (OBELICS / MMC4 .jsonl) or caption pairs")
    b.add_argument("--output", "-o", type=user_path, required=True,
                   help="dataset directory or URL (s3://bucket/prefix, any fsspec URL) to create")
    b.add_argument("--name", type=_shard_name, default="data",
                   help="shard name prefix (default: data)")
    b.add_argument("--max-samples-per-shard", type=at_least(1), default=5000,
                   help="start a new shard after this many samples (default 5000)")
    b.add_argument("--max-shard-bytes", type=_byte_size, default=1 << 30,
                   help="e.g. 512MB or 1.5GB, KB/MB/GB being powers of 1024 (default 1GB)")
    b.add_argument("--workers", type=at_least(0), default=1,
                   help="processes validating media while the main one writes (0: all in one; "
                   "default 1)")
    b.add_argument("--shuffle", action="store_true", help="write records in a seeded order")
    b.add_argument("--seed", type=int, help="seed of --shuffle (default 0)")
    b.add_argument("--strict", action="store_true",
                   help="stop at the first bad record (exit 1) instead of skipping it")
    b.add_argument("--overwrite", action="store_true",
                   help="replace an existing dataset once the new one is complete (a failed "
                   "build leaves it whole)")
    b.add_argument("--media-root", type=user_path, help="resolve relative media paths here "
                   "(default: the folder of the input file)")
    b.add_argument("--input-format", choices=("auto", "llava", "manifest", "parquet"),
                   default="auto", help="format of every input (default auto: from the "
                   "file extension); llava: JSON or JSONL records, each a conversation, an "
                   "interleaved document or a caption pair (told apart by its keys)")
    b.add_argument("--instruction", default="Transcribe the audio.",
                   help="user turn for speech-manifest records (default: "
                        "'Transcribe the audio.')")
    for role in ("id", "messages", "texts", "caption", *MEDIA_COLUMNS):
        b.add_argument(f"--{role}-column", help=f"Parquet column holding the {role}"
                       f"{'s' if role in MEDIA_COLUMNS else ''}"
                       + (" (interleaved documents)" if role == "texts" else
                          " (caption pairs)" if role == "caption" else ""))
    b.add_argument("--max-image-pixels", type=at_least(1),
                   help="skip images, and clips of frames, with more pixels (decompression "
                   "bombs; default: Pillow's limit, 89478485)")
    b.add_argument("--check", choices=("decode", "header"), default="decode",
                   help="decode: walk all media data (default); header: headers and stream "
                   "completeness only (faster, misses corruption inside the data)")
    b.add_argument("--markers-first", action="store_true",
                   help="where a record's text has no marker of a modality it has items of, "
                   "put one per item before the first user text (<image>\\n each), as "
                   "InternVL's trainer does (default: marker_mismatch)")
    b.add_argument("--frames-fps", type=float,
                   help="read a video given as a folder of JPEG frames (LLaVA-Hound's, "
                   "TVQA's), the rate they were taken at (LLaVA-Hound: 2, TVQA: 3): stored as "
                   "one clip of those frames (default: such a folder is missing_media)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    x = commands.add_parser(
        "index", help="index existing WebDataset or Energon tars where they are (no rewrite)")
    x.add_argument("sources", type=user_path, nargs="+", metavar="SRC",
                   help="a folder of tars (an Energon dataset folder: its .nv-meta decides), "
                   "tar paths, globs or brace patterns (shard-{000..099}.tar); local or URLs")
    x.add_argument("--output", "-o", type=user_path,
                   help="local directory for the index and its tables "
                   "(default: a folder of the cache, printed); nothing is written beside the tars")
    x.add_argument("--layout", choices=("auto", "pairs", "conversation", "documents", "energon"),
                   default="auto", help="pairs: KEY.jpg + KEY.txt caption pairs (img2dataset); "
                   "conversation: KEY.json with conversations/messages and its media members; "
                   "documents: KEY.json with texts + images lists (OBELICS) and its images; "
                   "energon: the folder's .nv-meta field_map; auto (default): detected")
    x.add_argument("--media-member", "--image-member", dest="media_member",
                   help="pairs: the medium's member suffix, alternatives by commas (jpg,png; "
                   "default: the sample's one media member)")
    x.add_argument("--text-member", default="txt",
                   help="pairs: the caption's member (default txt; json[caption] reads a field)")
    x.add_argument("--json-member", default="json", help="the JSON member: a conversation's, "
                   "a document's, or a pair's metadata kept in each record's source (default json)")
    x.add_argument("--name", help="the dataset's name (default: the tars' folder name)")
    x.add_argument("--workers", type=at_least(0), default=1,
                   help="processes indexing tars in parallel (0: in this one; default 1)")
    x.add_argument("--check", choices=("decode", "header"), default="decode",
                   help="decode: walk all media data (default); header: headers and stream "
                   "completeness only")
    x.add_argument("--max-image-pixels", type=at_least(1),
                   help="skip images, and clips of frames, with more pixels (default: "
                   "Pillow's limit, 89478485)")
    x.add_argument("--markers-first", action="store_true",
                   help="conversations: as build's --markers-first")
    x.add_argument("--keys-per-tar", action="store_true",
                   help="the tars number their samples each on their own (keys alike across "
                   "tars): a sample's key is TAR/KEY, as Energon names it (default: a key "
                   "found in an earlier tar is skipped as duplicate_key)")
    x.add_argument("--split", default="train",
                   help="an Energon folder: the split.yaml split indexed (default train; val "
                   "for a validation set, data.valid)")
    x.add_argument("--strict", action="store_true",
                   help="stop at the first record that would be skipped (exit 1), writing no "
                   "index, instead of skipping it")
    x.add_argument("--overwrite", action="store_true",
                   help="replace an existing index once the new one is complete (a failed "
                   "indexing leaves it whole)")
    x.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    i = commands.add_parser("info", help="summarize a built dataset")
    i.add_argument("directory", type=user_path,
                   help="dataset directory or URL written by mimo-shard build")
    i.add_argument("--json", action="store_true", help="machine-readable output")

    v = commands.add_parser("verify", help="re-read and check every shard against the index")
    v.add_argument("directory", type=user_path,
                   help="dataset directory or URL written by mimo-shard build")
    v.add_argument("--workers", type=at_least(0), default=1,
                   help="processes checking shards in parallel (0 or 1: in this one; "
                   "default 1)")
    v.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    c = commands.add_parser(
        "cache", help="list the tables derived from a dataset (sample table, token tables, "
        "reports) and remove the superseded ones")
    c.add_argument("directory", type=user_path,
                   help="dataset directory or URL written by mimo-shard build")
    c.add_argument("--cache-dir", type=user_path,
                   help="the cache directory training and mimo-inspect were "
                   "given (data.cache_dir / --cache-dir; MIMO_CACHE_DIR wins over it)")
    c.add_argument("--remove", action="store_true",
                   help="delete the superseded files (never a current one)")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


@quiet_when_stdout_closes
def main(argv: list[str] | None = None) -> int:
    cache_only()
    args = _parser().parse_args(argv)
    if args.command == "build" and args.seed is not None and not args.shuffle:
        print("mimo-shard build: error: --seed is the seed of --shuffle: give --shuffle too, "
              "or leave --seed out", file=sys.stderr)
        return 2
    try:
        with sigterm_as_interrupt():    # a build's files removed, its claim given back
            return _main(args)
    except KeyboardInterrupt as stop:   # Ctrl-C: one line, not the traceback of where it was
        # (here, not in _main: a Ctrl-C while _main imports the build's modules is one too)
        terminated = isinstance(stop, Terminated)
        print(f"mimo-shard {args.command}: {'terminated' if terminated else 'interrupted'}" + (
            ": no new index was written (under --overwrite the old dataset stays, unless its "
            "replacement had begun); run it again" if args.command in ("build", "index")
            else ""), file=sys.stderr)
        return 143 if terminated else 130


def _main(args) -> int:
    from mimo_data.worker_pool import WorkerDied
    from mimo_data.shards.index import DatasetError
    # not from build.py: its tar writer imports webdataset, and so torch, which no other
    # command needs
    from mimo_data.shards.sources import SourceError
    from mimo_data.shards.stops import BuildError, OutputFull, StrictStop
    from mimo_data.shards.storage import LocationError, StorageError
    from mimo_data.shards.claim import OutputBusy, OutputUnwritable
    try:
        return _run(args)
    except (StrictStop, OutputFull, OutputBusy) as exc:
        error, status = str(exc), 1
    except (BuildError, SourceError, LocationError, OutputUnwritable) as exc:
        error, status = str(exc), 2
    except DatasetError as exc:     # damaged or incomplete: 1; no such directory: 2
        error, status = str(exc), 2 if exc.missing else 1
    except StorageError as exc:     # the storage kept failing (retried already)
        error, status = str(exc), 1
    except WorkerDied as exc:       # the OOM killer, a crash: the work was not done
        error, status = str(exc), 1
    print(f"mimo-shard {args.command}: error: {error}", file=sys.stderr)
    return status


def _run(args) -> int:
    if args.command == "build":
        from mimo_data.shards.build import BuildOptions, build
        from mimo_data.shards.sources import media_field
        roles = [("id", "id"), ("conversation", "messages"), ("texts", "texts"),
                 ("caption", "caption"),
                 *((media_field(name), name) for name in MEDIA_COLUMNS)]
        columns = {role: getattr(args, f"{attr}_column") for role, attr in roles
                   if getattr(args, f"{attr}_column")}
        limits = ({} if args.max_image_pixels is None
                  else {"max_image_pixels": args.max_image_pixels})
        options = BuildOptions(
            name=args.name, max_samples_per_shard=args.max_samples_per_shard,
            max_shard_bytes=args.max_shard_bytes, workers=args.workers,
            shuffle=args.shuffle, seed=args.seed or 0, strict=args.strict,
            overwrite=args.overwrite, media_root=args.media_root,
            input_format=args.input_format, instruction=args.instruction, columns=columns,
            check=args.check, progress=not args.no_progress,
            markers_first=args.markers_first, frames_fps=args.frames_fps, **limits)
        return _nothing_kept(args.command, build(args.inputs, args.output, options))
    elif args.command == "index":
        from mimo_data.shards.in_place import IndexOptions, index
        indexing = IndexOptions(
            layout=args.layout, media_member=args.media_member, text_member=args.text_member,
            json_member=args.json_member, name=args.name, workers=args.workers,
            check=args.check, overwrite=args.overwrite, progress=not args.no_progress,
            markers_first=args.markers_first, strict=args.strict,
            keys_per_tar=args.keys_per_tar, split=args.split,
            **({} if args.max_image_pixels is None
               else {"max_image_pixels": args.max_image_pixels}))
        return _nothing_kept(args.command, index(args.sources, args.output, indexing))
    elif args.command == "info":
        import json

        from mimo_data.shards.info import dataset_info, format_info
        info = dataset_info(args.directory)
        print(json.dumps(info, indent=2) if args.json else format_info(info))
    elif args.command == "cache":
        return _cache(args)
    else:
        from mimo_data.shards.verify import verify
        problems = verify(args.directory, args.workers, progress=not args.no_progress)
        for problem in problems:
            print(f"verify: {problem}", file=sys.stderr)
        if problems:
            from mimo_data.shards.index import index_bytes, parse_index, remake
            read = parse_index(args.directory, index_bytes(args.directory))   # verify read it
            print(f"mimo-shard verify: FAILED, {len(problems)} problem(s) in "
                  f"{args.directory}: restore what they name from a copy of the dataset, or "
                  f"{remake(read)}", file=sys.stderr)
            return 1
        print(f"mimo-shard verify: OK, {args.directory}")
    return 0


def _nothing_kept(command: str, built: dict) -> int:
    """1 when no sample was written: every record read was skipped, or the inputs held none
    (its report written, no dataset: the work is not done), else 0."""
    read = built["report"]["records_read"]
    ignored = built["report"].get("members_ignored", 0)
    if built["totals"]["samples"] == 0:
        print(f"mimo-shard {command}: error: no sample written, " + (
            f"all {read} record(s) skipped (the report named above says why)" if read else
            f"the tars hold no sample, only {ignored} member(s) ignored (the report named "
            "above says which)" if ignored else
            "the inputs hold no record (an empty file, or an export that failed?)"),
            file=sys.stderr)
        return 1
    return 0


def _cache(args) -> int:
    import json
    from dataclasses import asdict

    from mimo_data.shards.cache_entries import entries, remove
    from mimo_data.shards.storage import is_remote
    from mimo_data.stats import size_text
    if args.cache_dir is not None and not os.path.isdir(args.cache_dir):
        # (a typo would list the dataset's own tables alone: "0 superseded", the cache's kept)
        print(f"mimo-shard cache: error: --cache-dir {args.cache_dir} is "
              f"{'a file' if os.path.exists(args.cache_dir) else 'not there'}: give the cache "
              "folder the runs used (their data.cache_dir or MIMO_CACHE_DIR)", file=sys.stderr)
        return 2
    listed = entries(args.directory, args.cache_dir)
    superseded = [entry for entry in listed if entry.superseded]
    freed = remove(superseded) if args.remove else 0
    if args.json:
        print(json.dumps({"files": [asdict(e) | {"superseded": e.superseded} for e in listed],
                          "removed_bytes": freed}, indent=2))
        return 0
    for entry in listed:
        about = f" ({entry.about})" if entry.about else ""
        print(f"{size_text(entry.size):>11}  {entry.kind:8} {entry.status}{about}\n"
              f"             {entry.path}")
    total = sum(entry.size for entry in superseded)
    print(f"mimo-shard cache: {len(listed)} file(s), {len(superseded)} superseded "
          f"({size_text(total)})" + (f", removed ({size_text(freed)} freed)"
                                       if args.remove else
                                       "; --remove deletes them" if superseded else "")
          + ("; the local cache's (the bucket's own .mimo-cache/ holds the build's tables, "
             "which the next build replaces)" if is_remote(args.directory) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
