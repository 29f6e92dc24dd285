"""`mimo-inspect`: see masks, token counts and data placement before spending GPU hours.

    mimo-inspect sample DIR --config CFG [--key K | --index I | --random N [--seed S]]
    mimo-inspect report DIR --config CFG [--json OUT] [--html OUT] [--limit N] [thresholds]
    mimo-inspect plan   DIR --config CFG --layout L --global-batch-size B --micro-batch-size M
                        [--balance none|tokens] [--packing] [--json]
    mimo-inspect plan   DIR --config CFG --model MODEL --gpus N --global-batch-size B
                        --micro-batch-size M [--gpu h100|h200|a100] [--json] ...
                        (the layout advisor: needs mimo_train, see docs/inspect.md)
    mimo-inspect plan   DIR --config CFG --model TRAIN.yaml (--layout L | --gpus N) ...
                        (the run's batch sizes, seed and balance)
    mimo-inspect plan   --config CFG --model MODEL --gpus N --clip-seconds S [--fps F]
                        [--clip-size WxH] ...  (the advisor on one clip, no dataset)
    mimo-inspect checkpoint CKPT [--all] [--workers N] [--json]
                        (a training run's checkpoints intact, and what each holds)

Everything runs the training code path (the metadata-only preprocessor) without decoding
media, except the HTML gallery's thumbnails and spectrograms.

Exit status (the same for every mimo CLI):
  0  ok: every check passes
  1  a check or the data failed (one line per failed check on stderr: reason, count, first
     keys), so it can gate a launch in CI; also a damaged or incomplete dataset
  2  usage or config error: bad arguments, a bad config, no such dataset directory
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Only the light checks table here: the tokenizer, torch and pyarrow are imported once the
# arguments are parsed, so that --help answers at once.
from mimo_data.inspect.checks import CHECKS, Thresholds
from mimo_data.arguments import RUN_SEED, SEED, at_least, fraction, Parser, positive, user_path
from mimo_data.errors import listed
from mimo_data.hub import cache_only
from mimo_data.stdout import quiet_when_stdout_closes

_DEFAULTS = Thresholds()


def _given(text: str) -> str:
    """An argparse type: a value that is not empty (``--layout ''``: a variable left unset),
    a path's ``~`` expanded (a compact layout never starts with one)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty")
    return user_path(text)


def _utilisation(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in (0, 1]")
    return value


def _size(text: str) -> tuple[int, int]:
    """An argparse type: ``WIDTHxHEIGHT`` in pixels, each > 0."""
    try:
        width, height = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not WIDTHxHEIGHT (e.g. 1280x720)") from None
    if width <= 0 or height <= 0:
        raise argparse.ArgumentTypeError(f"{text}: each side must be > 0")
    return width, height


class _OneConfig(argparse.Action):
    """``--config`` given once: a second is refused (argparse would keep the last silently)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest, None)
        if given is not None:
            parser.error(f"--config given twice ({given}, {values}): each command reads one "
                         "dataset with one preprocessing config; run it once for each")
        setattr(namespace, self.dest, values)


def _common(parser: argparse.ArgumentParser, directory_help: str | None = None,
            config_default: str | None = None) -> None:
    """The options every command takes (``directory_help``: the dataset is optional, so
    said; ``config_default``: where ``--config`` may be left out, what it then is)."""
    parser.add_argument("directory", type=user_path, metavar="DIR",
                        nargs="?" if directory_help else None,
                        help=directory_help or "dataset (directory or URL) built by "
                        "mimo-shard build")
    parser.add_argument("--config", type=user_path, required=config_default is None, metavar="CFG",
                        action=_OneConfig,
                        help="preprocessing config YAML (the one training uses" +
                        (f"; default: {config_default})" if config_default else ")"))
    parser.add_argument("--no-token-cache", action="store_true",
                        help="tokenize every conversation whole instead of caching the pieces "
                        "between special tokens (slower; the tokens are the same)")
    parser.add_argument("--cache-dir", type=user_path, metavar="CACHE",
                        help="where the dataset's derived tables live when not beside it "
                        "(training's data.cache_dir; MIMO_CACHE_DIR wins over both): a "
                        "read-only dataset's report then reuses training's token table")


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="mimo-inspect", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True,
                                     help="what to do (each has its own --help)")

    s = commands.add_parser("sample", help="one sample's tokens by class, counts and media")
    _common(s)
    which = s.add_mutually_exclusive_group()
    which.add_argument("--key", help="sample key (000000042, or 42; TAR/KEY, or KEY where one "
                       "tar has it, in an index of --keys-per-tar), or the record id the build "
                       "kept")
    which.add_argument("--index", type=int, help="position in the dataset (default 0)")
    which.add_argument("--random", type=positive(int), metavar="N",
                       help="N samples picked at random")
    s.add_argument("--seed", type=int, help="seed of --random (default 0)")
    s.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="ANSI colours: auto (when stdout is a terminal), always, never")

    r = commands.add_parser("report", help="dataset-wide checks; exit 1 if one fails")
    _common(r)
    r.add_argument("--json", type=user_path, metavar="OUT",
                   help="write the report as JSON ('-': stdout)")
    r.add_argument("--html", type=user_path, metavar="OUT",
                   help="write a self-contained HTML report")
    r.add_argument("--limit", type=positive(int), metavar="N", help="only the first N samples")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.add_argument("--recompute", action="store_true",
                   help="inspect every sample even when this dataset and config's saved tables "
                   "are there (a whole-dataset report saves them in DIR/.mimo-cache or "
                   "$MIMO_CACHE_DIR; the next one reads them and takes seconds)")
    r.add_argument("--workers", type=at_least(0), default=1, metavar="N",
                   help="processes inspecting samples (0 or 1: in this one; default 1; "
                   "each runs at about the metadata-only preprocessor's speed)")
    r.add_argument("--gallery-per-check", type=at_least(0), default=6, metavar="N",
                   help="HTML: flagged samples shown per kind of problem (default 6)")
    r.add_argument("--examples", type=at_least(0), default=3, metavar="N",
                   help="HTML: kept samples with media shown as examples (default 3)")
    limits = r.add_argument_group("check limits (defaults: nothing tolerated)")
    for field_name, kind, what in CHECKS.values():
        default = getattr(_DEFAULTS, field_name)
        limits.add_argument("--" + field_name.replace("_", "-"),
                            type=fraction if kind == "fraction" else at_least(0), default=default,
                            metavar="F" if kind == "fraction" else "N",
                            help=f"most {what} allowed, as a "
                            f"{'fraction of the samples' if kind == 'fraction' else 'count'} "
                            f"(default {default})")
    limits.add_argument("--min-trained-token-fraction", type=fraction,
                        default=_DEFAULTS.min_trained_token_fraction, metavar="F",
                        help="least fraction of the kept samples' real tokens that must be "
                        "trained (default 0: not checked)")
    limits.add_argument("--max-skipped-records-fraction", type=fraction,
                        default=_DEFAULTS.max_skipped_records_fraction, metavar="F",
                        help="most records `mimo-shard build` or `index` skipped (missing or "
                        "broken media, malformed records: the dataset's report.json; an "
                        "Energon split.yaml's excludes are not counted), as a fraction of the "
                        "records it read (default "
                        f"{_DEFAULTS.max_skipped_records_fraction})")

    p = commands.add_parser("plan", help="per-rank samples and tokens per step for a layout")
    _common(p, "dataset (directory or URL) built by mimo-shard build (not with --clip-seconds, "
            "whose one clip is the workload)", "with --model TRAIN.yaml, its data.preprocess")
    p.add_argument("--layout", metavar="L", type=_given,
                   help="layout: YAML file or compact string, e.g. 'language=dp2;image=dp1' "
                   "(required without --gpus; with --model and no --gpus, checked against "
                   "mimo-train's rules for that model first; with --gpus, this layout is "
                   "ranked too, or the report says why not: another number of GPUs, or its "
                   "check's error)")
    p.add_argument("--global-batch-size", type=positive(int), metavar="B",
                   help="samples per optimizer step, over all data-parallel ranks (required "
                   "with DIR, unless a training YAML as --model gives its "
                   "train.global_batch_size; with --clip-seconds default 1)")
    p.add_argument("--micro-batch-size", type=positive(int), metavar="M",
                   help="samples per forward pass on one rank (required with DIR, unless a "
                   "training YAML as --model gives its train.micro_batch_size; with "
                   "--clip-seconds default 1)")
    p.add_argument("--seed", type=SEED, help="sample-order seed (default: a training YAML's "
                   f"train.seed as --model, else {RUN_SEED}, train.seed's default)")
    p.add_argument("--epoch", type=int, default=0, help="epoch to plan (default 0)")
    p.add_argument("--balance", choices=("none", "tokens"),
                   help="the loader's data.balance (default: a training YAML's as --model, "
                   "else none); the imbalance of the other setting is shown too")
    p.add_argument("--packing", action="store_true",
                   help="the loader's data.packing: each language DP rank's micro-batch packed "
                   "into sequences of seq_length (--json then lists each micro-batch's "
                   "'sequences'); the packing efficiency is shown with and without it. With a "
                   "training YAML as --model the plan takes the YAML's data.packing "
                   "(--packing against data.packing: false is an error)")
    p.add_argument("--json", action="store_true",
                   help="print the loader's dry run (per-rank, per-step sample keys) as JSON; "
                   "with --gpus, the advisor's ranking")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars on stderr (the token table's, the dry run's)")
    _advisor_arguments(p)

    c = commands.add_parser("checkpoint", help="a training run's checkpoints: their files "
                            "against their manifest, and what each holds (needs mimo_train)")
    c.add_argument("directory", type=user_path, metavar="CKPT",
                   help="a run's checkpoint.dir (checks the step "
                   "its 'latest' names: what a resume loads) or one step_NNNNNNN folder")
    c.add_argument("--all", action="store_true", help="check every step folder of the "
                   "checkpoint.dir")
    c.add_argument("--workers", type=positive(int), default=4, metavar="N",
                   help="threads hashing files (default 4)")
    c.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    for each in (s, r, p, c):
        each.allow_abbrev = False       # a launch gate takes its options' exact names
        each.set_defaults(subcommand=each)  # its own usage for an unknown option
    return parser


def _advisor_arguments(p: argparse.ArgumentParser) -> None:
    """The layout advisor's options (``plan --model M --gpus N``), handed to mimo_train's
    advisor as an ``advice.AdvisorRequest`` (mimo_data never imports mimo_train)."""
    a = p.add_argument_group("layout advisor (needs mimo_train; docs/inspect.md)")
    a.add_argument("--gpus", type=positive(int), metavar="N",
                   help="rank the layouts of the config's modules on N GPUs: memory per rank, "
                   "predicted step time, why")
    a.add_argument("--model", type=user_path, metavar="MODEL",
                   help="the model: a training config YAML (model dims, precision, frozen "
                   "modules), a transformers checkpoint directory or its config.json")
    a.add_argument("--gpu", choices=("h100", "h200", "a100"), default="h100",
                   help="GPU kind for memory and peak throughput (default h100: 79.6 GiB, 989 "
                   "dense bf16 TFLOP/s; h200 140.4 GiB, a100 80.0 GiB)")
    a.add_argument("--gpu-memory-gib", type=positive(float), metavar="GIB",
                   help="memory per GPU (default: the --gpu kind's)")
    a.add_argument("--gpu-tflops", type=positive(float), metavar="TF",
                   help="peak dense TFLOP/s per GPU at the run's precision (default: the "
                   "--gpu kind's)")
    a.add_argument("--gpus-per-node", type=positive(int), default=8, metavar="G",
                   help="GPUs per node (default 8): a module's gradient reduction runs over the "
                   "node's links when its ranks fit in one node, else over the network")
    a.add_argument("--mfu", type=_utilisation, metavar="F",
                   help="assumed model FLOPs utilisation: achieved / peak (default 0.4)")
    a.add_argument("--precision", choices=("bf16", "fp32"),
                   help="weights and activations (default: the training config's, else bf16)")
    a.add_argument("--distributed-optimizer", choices=("both", "yes", "no"), default="both",
                   help="candidates with the distributed optimizer, without, or both (default)")
    a.add_argument("--recompute", choices=("any", "none", "selective", "full"), default="any",
                   help="activation recompute of the candidates (default: any of the three)")
    a.add_argument("--no-sequence-parallel", action="store_true",
                   help="no sequence parallelism with tp > 1 (default: on where tp > 1)")
    a.add_argument("--top", type=positive(int), default=5, metavar="K",
                   help="layouts shown with their reasons (default 5)")
    a.add_argument("--steps", type=positive(int), default=8, metavar="S",
                   help="global steps of the dataset read for the per-step work (default 8)")
    a.add_argument("--fewer-gpus", action="store_true",
                   help="also rank layouts on fewer than N GPUs, the others idle (on with "
                   "--clip-seconds: one clip's tower rank and a language model of tp x cp "
                   "ranks seldom add up to N)")
    a.add_argument("--split-media", action="store_true",
                   help="fan-in layouts with data.split_media: the encoder ranks of a language "
                   "rank each encode a token-balanced part of its micro-batch's media, where "
                   "the trainer allows it (default: as the training YAML says; with "
                   "--clip-seconds both whole and split)")
    a.add_argument("--clip-seconds", type=positive(float), metavar="S",
                   help="no dataset: the work is samples of one clip of S seconds and a short "
                   "prompt (mimo_data/inspect/clip.py), every frame at --fps sampled, sized "
                   "by the preprocessing config's modalities.video")
    a.add_argument("--fps", type=positive(float), metavar="F",
                   help="with --clip-seconds: frames a second the encoder sees (default: the "
                   "config's modalities.video.fps)")
    a.add_argument("--clip-size", type=_size, metavar="WxH",
                   help="with --clip-seconds: the clip's frame size before the processor's "
                   "resize (default 1280x720)")


def _position_of(reader, key: str) -> int | str | None:
    """The position of the sample ``--key`` names: its key, the key ``key`` zero-padded
    (``42`` for ``000000042``), in an index of ``--keys-per-tar`` the one tar's ``TAR/KEY``
    that ends so (padded too; several tars': what to give instead), or the record id the
    build kept (read from samples.parquet's ``id`` column, where one sample has it)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from mimo_data.shards.index import read_samples
    table = reader.table
    found = table.position(key)
    if found is None and key.isdigit() and len(table) and len(key) < len(table.key(0)):
        found = table.position(key.zfill(len(table.key(0))))
    if found is None and reader.index.get("build", {}).get("keys_per_tar") and len(table):
        width = len(table.key(0).rpartition("/")[2])
        ends = {f"/{key}", f"/{key.zfill(width)}" if key.isdigit() else f"/{key}"}
        matches = sorted({p for end in ends
                          for p in pc.indices_nonzero(pc.ends_with(table.keys, end)).to_pylist()})
        if len(matches) > 1:
            return (f"{len(matches)} tars have the key {key!r} "
                    f"({', '.join(table.key(p) for p in matches[:4])}"
                    f"{', ...' if len(matches) > 4 else ''}): give TAR/KEY")
        found = matches[0] if matches else None
    if found is None:
        ids = read_samples(reader.directory, lambda path: pq.read_table(
            path, columns=["id"])).column("id")
        matches = pc.indices_nonzero(pc.fill_null(pc.equal(ids, key), False)).to_pylist()
        found = matches[0] if len(matches) == 1 else None
    return found


def _sample(args, config) -> int:
    import random

    from mimo_data.inspect.sample import format_sample, sample_problems
    from mimo_data.inspect.stats import IndexTable, SampleInspector
    from mimo_data.shards.reader import ShardReader
    if args.seed is not None and args.random is None:
        print("mimo-inspect sample: error: --seed seeds --random: drop it, or pick with "
              "--random N", file=sys.stderr)
        return 2
    reader = ShardReader(args.directory, args.cache_dir)
    # as a run's start-up: shards missing, cut short, or tars indexed in place written again
    # since with other text (what the sample shows is the index's)
    reader.check_shards()
    if args.key is not None:
        position = _position_of(reader, args.key)
        if isinstance(position, str):
            print(f"mimo-inspect sample: error: {position}", file=sys.stderr)
            return 2
        if position is not None:
            positions = [position]
        else:
            table = reader.table
            known = (f"keys {table.key(0)} .. {table.key(len(table) - 1)}" if len(table)
                     else "empty dataset")
            skipped = _skipped_record(args.directory, args.key)
            print(f"mimo-inspect sample: error: no sample with key (or one id) {args.key!r} in "
                  f"{args.directory} ({len(reader)} samples, {known})"
                  + (f": {skipped}" if skipped else ""), file=sys.stderr)
            return 2
    elif args.random is not None:
        positions = sorted(random.Random(args.seed or 0).sample(range(len(reader)),
                                                           min(args.random, len(reader))))
    else:
        positions = [args.index or 0]
    for position in positions:
        if not 0 <= position < len(reader):
            print(f"mimo-inspect sample: error: --index {position} is outside 0..{len(reader) - 1}"
                  f" ({args.directory})", file=sys.stderr)
            return 2
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    inspector = SampleInspector(config, cache_tokens=not args.no_token_cache)
    index = IndexTable(args.directory)
    failed: list[str] = []
    for n, position in enumerate(positions):
        record = reader.record(position)
        stats, sample = inspector(position, record, index)
        if n:
            print()
        print(format_sample(inspector, record, stats, sample, len(reader), color))
        failed.extend(f"mimo-inspect sample: {stats.key}: {problem}"
                      for problem in sample_problems(stats))
    for line in failed:
        print(line, file=sys.stderr)
    return 1 if failed else 0


def _report(args, config, started: float) -> int:
    import json

    from mimo_data.errors import ConfigError
    from mimo_data.files import file_in_the_way
    from mimo_data.inspect.report import build_report, failure_lines, format_report, write_json
    from mimo_data.inspect.stats import SampleInspector
    thresholds = Thresholds(**{name: getattr(args, name)
                               for name in Thresholds.__dataclass_fields__})
    for flag, path in (("--json", args.json), ("--html", args.html)):
        folder = os.path.dirname(os.path.abspath(path)) if path and path != "-" else None
        if folder is not None and (in_the_way := file_in_the_way(folder)):
            raise ConfigError(f"{flag} {path}: {in_the_way} is a file, not a folder; give "
                              "another path")
        if folder is not None and not os.path.isdir(folder):   # before the pass, not after
            raise ConfigError(f"{flag} {path}: its folder {folder} does not exist; create it "
                              "or give another path")
        if folder is not None and os.path.isdir(path):
            raise ConfigError(f"{flag} {path} is a folder: give the file to write (e.g. "
                              f"{os.path.join(path, 'report' + flag.replace('--', '.'))})")
    inspector = SampleInspector(config, cache_tokens=not args.no_token_cache)
    gallery = None
    if args.html:
        from mimo_data.inspect.html import Gallery
        gallery = Gallery(per_check=args.gallery_per_check, examples=args.examples)
    report = build_report(args.directory, inspector, thresholds, limit=args.limit,
                          progress=not args.no_progress, workers=args.workers,
                          on_stats=gallery, reuse=not args.recompute,
                          cache_dir=args.cache_dir, started=started)
    report["config"] = args.config
    said = sys.stderr if args.json == "-" else sys.stdout      # stdout stays the JSON
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if args.json:
            write_json(report, args.json)
            print(f"JSON report: {args.json}", file=said)
    if args.html:
        from mimo_data.inspect.html import write_html
        assert gallery is not None                    # made above when --html is given
        damaged = write_html(report, gallery, args.directory, inspector, args.html,
                             args.config, args.cache_dir)
        print(f"HTML report: {args.html}", file=said)
    else:
        damaged = []
    failures = failure_lines(report) + [f"mimo-inspect report: FAIL damaged_media: {message}"
                                        for message in damaged]
    for line in failures:
        print(line, file=sys.stderr)
    return 1 if failures else 0


# a training YAML's settings the plan takes: option -> (its key there, argparse's name)
RUN_SETTINGS = {"--global-batch-size": ("train.global_batch_size", "global_batch_size"),
                "--micro-batch-size": ("train.micro_batch_size", "micro_batch_size"),
                "--seed": ("train.seed", "seed"), "--balance": ("data.balance", "balance")}


def _take_run_settings(args, run_settings) -> int | None:
    """The run's batch sizes, seed and balance from the training YAML ``args.model`` where
    the options do not give them (``run_settings(path, config) -> {key: value}``, mimo_train's
    reading of it); exit status 2 where an option gives another value, or the YAML cannot be
    read: the plan would be another run's. Its layout is ``--layout``'s where none is given
    (the one the plan draws, or the advisor marks as yours); another is one to compare."""
    try:
        settings = run_settings(args.model, args.config)
    except ValueError as error:
        print(f"mimo-inspect plan: error: {error}", file=sys.stderr)
        return 2
    for option, (key, name) in RUN_SETTINGS.items():
        if option == "--balance" and args.gpus is not None:
            continue                # the advisor's workload is the same under either
        given, theirs = getattr(args, name), settings[key]
        if given is None:
            setattr(args, name, theirs)
            args.taken[option] = key
        elif given != theirs:
            print(f"mimo-inspect plan: error: {option} {given}, and --model {args.model} "
                  f"trains with {key} {theirs}: the plan would count another run; drop "
                  f"{option} (the YAML's is taken) or change the YAML", file=sys.stderr)
            return 2
    if args.layout is None and settings.get("layout"):
        args.layout = settings["layout"]
    if args.directory is not None and (note := _other_data(args, settings)):
        print(f"mimo-inspect plan: note: {note}", file=sys.stderr)
    return None


def _named(args, option: str) -> str:
    """``option`` as the user gave it: the option, or the training YAML's key its value was
    taken from (``_take_run_settings``)."""
    return args.taken.get(option, option)


def _other_data(args, settings: dict) -> str | None:
    """What to say where the training YAML's data is not DIR alone: the plan counts DIR's
    samples, the run draws from its own list (a mix: ``dry_run`` plans it)."""
    from mimo_data.shards.storage import LocationError, canonical
    datasets, weights = settings.get("data.datasets"), settings.get("data.weights")
    if not datasets:
        return None
    try:
        if [canonical(str(d)) for d in datasets] == [canonical(args.directory)]:
            return None
    except LocationError:
        return None                 # a mistyped URL: said where the plan reads it
    mix = f" with data.weights {listed(weights)}" if weights else ""
    return (f"--model {args.model} trains data.datasets {listed(datasets)}{mix}; this plan counts "
            f"{args.directory} alone" + (
                " (`python -m mimo_data.loading.dry_run` plans the mix: its --weights, "
                "--balance and --packing as the run's)"
                if len(datasets) > 1 else ""))


def _plan(args, config, advisor=None, layout_refusal=None, run_settings=None) -> int:
    try:
        from mimo_data.inspect.plan import run_plan
    except ImportError as exc:
        print(f"mimo-inspect plan: not available in this installation ({exc})", file=sys.stderr)
        return 2
    clip = args.clip_seconds is not None
    args.taken = {}     # option -> the training YAML's key its value was taken from
    if not clip and (args.fps is not None or args.clip_size is not None):
        print("mimo-inspect plan: error: --fps and --clip-size go with --clip-seconds",
              file=sys.stderr)
        return 2
    if clip and args.directory is not None:
        print(f"mimo-inspect plan: error: --clip-seconds makes the work one clip: drop DIR "
              f"({args.directory})", file=sys.stderr)
        return 2
    if args.model is not None and args.model.endswith((".yaml", ".yml")) and not clip:
        if run_settings is None:
            return _needs_trainer("--model (a training YAML) needs")
        if (status := _take_run_settings(args, run_settings)) is not None:
            return status
    args.seed = RUN_SEED if args.seed is None else args.seed
    args.balance = args.balance or "none"
    if not clip and (args.directory is None or args.global_batch_size is None or
                     args.micro_batch_size is None):
        print("mimo-inspect plan: error: give DIR, --global-batch-size and --micro-batch-size "
              "(or --clip-seconds S for one clip, with --model M --gpus N)", file=sys.stderr)
        return 2
    if not clip and args.global_batch_size % args.micro_batch_size:    # each > 0: argparse
        print(f"mimo-inspect plan: error: {_named(args, '--global-batch-size')} "
              f"{args.global_batch_size} is not a whole number of micro-batches of "
              f"{_named(args, '--micro-batch-size')} {args.micro_batch_size}"
              + (f" (from --model {args.model})" if args.taken else "") + ": give a global "
              "batch that is a multiple of micro batch × the language module's dp",
              file=sys.stderr)
        return 2
    if args.layout is not None:         # a layout that does not parse: refused as one
        from mimo_data.loading.layout import Layout, LayoutError
        try:
            Layout.parse(args.layout)
        except LayoutError as error:    # a layout file that cannot be read too
            return _refused_layout(args, str(error))
    if args.gpus is None and args.model is not None and args.layout is not None and not clip:
        # one layout checked against the trainer's rules for that model, then drawn as below
        if layout_refusal is None:
            return _needs_trainer("--model (the trainer's rules) needs")
        from mimo_data.inspect.advice import AdvisorRequest
        try:
            reason, packing, split = layout_refusal(AdvisorRequest.from_args(args), config)
        except ValueError as error:            # the model cannot be read
            print(f"mimo-inspect plan: error: {error}", file=sys.stderr)
            return 2
        if packing is not None:                # the run's: the plan drawn below is its
            args.packing = packing
        if reason is not None:
            return _refused_layout(args, reason,
                                   f"mimo-train refuses it for --model {args.model}: ")
        if split:                              # checked, but not drawn rank by rank
            from mimo_data.loading.loader import DataSource
            DataSource([args.directory], config, cache_dir=args.cache_dir,    # DIR is one
                       progress=not args.no_progress)
            why = ("each encoder rank that fans in encodes a part of its language rank's "
                   "media; a per-rank plan draws whole samples to each encoder rank and would "
                   "not be that run's: the layout advisor (--gpus N) counts the parts")
            if args.json:
                json.dump({"layout": _layout_named(args.layout), "valid": True,
                           "split_media": True, "drawn": False, "why": why}, sys.stdout,
                          indent=1)
                print()
            else:
                print(f"layout    {args.layout}: mimo-train takes it for --model {args.model}, "
                      f"which trains with data.split_media: true ({why})")
            return 0
    if args.gpus is None and not clip:
        if args.layout is None:
            print("mimo-inspect plan: error: give --layout L (or --model M --gpus N for the "
                  "layout advisor)", file=sys.stderr)
            return 2
        if args.split_media:        # the per-rank figures below count whole micro-batches
            print("mimo-inspect plan: error: --split-media goes with the layout advisor "
                  "(--model M --gpus N), which counts each encoder rank's part; a --layout "
                  "plan draws whole micro-batches: drop --split-media there (to check a "
                  "layout for a run with data.split_media: true, give its training YAML as "
                  "--model beside --layout)", file=sys.stderr)
            return 2
        code = run_plan(args, config)
        if code == 0 and args.model is None and not args.json:
            print("model     its rules not checked (experts over ep, heads over tp, ...): give "
                  "--model (its config.json or a training YAML) for mimo-train's verdict")
        if code == 0 and args.model is not None and not args.json:
            from mimo_data.loading.layout import Layout
            gpus = Layout.parse(args.layout).world_size
            print(f"memory    per rank and step time for --model: add --gpus {gpus} (the "
                  f"advisor figures this layout and ranks it among the others of {gpus} GPUs)")
        return code
    if advisor is None:
        return _needs_trainer("--model/--gpus (the layout advisor) need")
    if args.gpus is None or args.model is None or args.gpus < 1:
        print("mimo-inspect plan: error: the layout advisor needs both --model M and --gpus N "
              "(N >= 1)", file=sys.stderr)
        return 2
    from mimo_data.inspect.advice import AdvisorRequest
    if clip:
        from mimo_data.inspect.clip import CLIP_SIZE, clip_workload
        video = config.modalities.get("video")
        fps = args.fps if args.fps is not None else video.fps if video is not None else 1.0
        work = clip_workload(config, args.clip_seconds, fps, args.clip_size or CLIP_SIZE,
                             args.global_batch_size or 1, args.micro_batch_size or 1,
                             args.packing)
        return advisor(AdvisorRequest.from_args(args), config, work)
    from mimo_data.inspect.workload import workload
    from mimo_data.loading.layout import Layout, LayoutError
    from mimo_data.loading.loader import DataSource
    layout = Layout.parse(args.layout) if args.layout else None
    try:            # the workload names modules as it does: it must serve the modalities
        if layout is not None:
            layout.check_serves(config.modalities)
    except LayoutError as error:        # the advisor chooses the layout: its own are ranked
        print(f"mimo-inspect plan: note: your layout {args.layout} is not ranked: {error}",
              file=sys.stderr)
        args.layout = layout = None
    source = DataSource([args.directory], config, cache_dir=args.cache_dir,
                        progress=not args.no_progress)
    work = workload(source, config, args.global_batch_size, args.micro_batch_size,
                    layout=layout, seed=args.seed, epoch=args.epoch, steps=args.steps,
                    packing=args.packing)
    return advisor(AdvisorRequest.from_args(args), config, work)


def _skipped_record(directory: str, record_id: str) -> str | None:
    """That the build or index of ``directory`` (a folder or a bucket's) skipped the record
    of ``record_id``, where and why, as its skipped.jsonl says (read line by line): its id, or in
    an index of tars read in place (``TAR:KEY`` locations) its key (``42`` for ``000000042``,
    as ``_position_of`` takes it), or ``TAR/KEY``; where several tars skipped a record of
    that key, it says so and asks for TAR/KEY; None where it names no such record."""
    from mimo_data.shards import storage
    from mimo_data.shards.format import SKIPPED_FILE
    listed = storage.join(directory, SKIPPED_FILE)
    found: list[tuple[str, str]] = []   # (location, what is said of it)
    try:
        if not storage.exists(listed):
            return None
        with storage.local_copy(listed) as path, open(path, encoding="utf-8") as lines:
            for line in lines:
                entry = json.loads(line)
                tar, _, key = str(entry.get("location")).rpartition(":")
                in_place = tar.lower().endswith(".tar")
                said = (f"the index skipped the sample {tar}/{key}" if in_place else
                        f"the build skipped the record of id {record_id!r}") + (
                    f" ({entry['location']}: {entry['reason']}: {entry['detail']})")
                if entry.get("id") == record_id or record_id == f"{tar}/{key}":
                    return said
                if in_place and (record_id == key or record_id.isdigit()
                                 and record_id.zfill(len(key)) == key):
                    found.append((entry["location"], said))
    except (OSError, ValueError, KeyError, AttributeError):   # a damaged list: not said
        return None
    if len(found) > 1:
        places = ", ".join(location for location, _ in found[:4])
        return (f"the index skipped samples of key {record_id!r} in {len(found)} tars "
                f"({places}{', ...' if len(found) > 4 else ''}): give TAR/KEY")
    return found[0][1] if found else None


def _refused_layout(args, reason: str, by: str = "") -> int:
    """Exit status 2 for a refused ``--layout``: said on stderr, and with ``--json`` as a
    plan's refused layout is (``plan.run_plan``) on stdout."""
    if args.json:
        json.dump({"layout": _layout_named(args.layout), "valid": False, "problem": reason},
                  sys.stdout, indent=1)
        print()
    print(f"mimo-inspect plan: error: --layout {args.layout}: {by}{reason}", file=sys.stderr)
    return 2


def _layout_named(text: str) -> str:
    """A layout as ``plan --json`` names it: in full (``Layout``'s form), or as given where it
    does not parse."""
    from mimo_data.loading.layout import Layout, LayoutError
    try:
        return str(Layout.parse(text))
    except LayoutError:
        return text


def _needs_trainer(what: str, command: str = "plan") -> int:
    """Exit status 2, saying that ``what`` (an option and "need(s)") is mimo_train's."""
    print(f"mimo-inspect {command}: error: {what} mimo_train: run the mimo-inspect command of a "
          "full install (mimo_train.inspect_cli), not python -m mimo_data.inspect.cli",
          file=sys.stderr)
    return 2


@quiet_when_stdout_closes
def main(argv: list[str] | None = None, advisor=None, layout_refusal=None,
         run_settings=None, checkpoint=None, preprocess_of=None) -> int:
    """``advisor``: the layout advisor ``plan --model M --gpus N`` calls, ``advisor(request,
    config, workload) -> exit status`` with an ``advice.AdvisorRequest``; ``layout_refusal``:
    why the trainer refuses ``plan --layout L --model M``'s layout and the model's
    ``data.packing`` and ``data.split_media``, ``layout_refusal(request, config) -> (str |
    None, bool | None, bool)``;
    ``run_settings``: a training YAML's batch sizes, seed and balance (``RUN_SETTINGS``'
    keys), ``run_settings(path, config path) -> dict``, ValueError where it cannot be read;
    ``checkpoint``: the ``checkpoint`` subcommand, ``checkpoint(args) -> exit status``;
    ``preprocess_of``: a training YAML's own ``data.preprocess`` (``plan --model TRAIN.yaml``
    without ``--config``), ``preprocess_of(path) -> str | None``, ValueError where the YAML's
    paths cannot be resolved
    (``mimo_train.inspect_cli`` passes mimo_train's; the import runs one way: mimo_data never
    imports mimo_train)."""
    started = time.perf_counter()
    cache_only()
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        words = [word for word in extra if not word.startswith("-")]
        yamls = [word for word in words if word.lower().endswith((".yaml", ".yml"))]
        if yamls and args.command in ("report", "sample", "plan"):
            print(f"mimo-inspect {args.command}: error: {' '.join(yamls)}: it reads one "
                  "preprocessing config, given as --config" + (f" ({args.config})" if args.config
                                                           else "") + ", and one dataset",
                  file=sys.stderr)
            return 2
        if words and len(words) == len(extra) and args.command in ("report", "sample", "plan"):
            print(f"mimo-inspect {args.command}: error: it reads one dataset, "
                  f"{len(words) + 1} were given ({' '.join(words)} too): run it once for each "
                  "(`python -m mimo_data.loading.dry_run` gives a mix's steps as each rank's "
                  "loader delivers them)" + (
                      "; a sample is chosen with --key KEY or --index N"
                      if args.command == "sample" else ""), file=sys.stderr)
            return 2
        args.subcommand.error(f"unrecognized arguments: {' '.join(extra)}")
    try:        # Ctrl-C, while the modules below import or during the work: one line
        return _command(args, started, advisor, layout_refusal, run_settings, preprocess_of,
                        checkpoint)
    except KeyboardInterrupt:
        print(f"mimo-inspect {args.command}: interrupted", file=sys.stderr)
        return 130


def _command(args, started, advisor, layout_refusal, run_settings, preprocess_of,
             checkpoint) -> int:
    if args.command == "checkpoint":          # a training run's: no dataset, no config
        return checkpoint(args) if checkpoint else _needs_trainer("checking checkpoints "
                                                                  "needs", "checkpoint")
    from mimo_data.errors import ConfigError
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_data.preprocess.segment_tokenizer import SegmentCacheError
    from mimo_data.shards.index import DatasetError
    from mimo_data.shards.storage import StorageError
    from mimo_data.worker_pool import WorkerDied
    if args.config is None:                 # plan --model TRAIN.yaml: its own preprocessing
        yaml_model = (args.model or "").endswith((".yaml", ".yml"))
        try:
            own = preprocess_of(args.model) if yaml_model and preprocess_of else None
        except ValueError as unresolved:    # a path of the YAML's that cannot be resolved
            print(f"mimo-inspect plan: error: --model {args.model}: {unresolved}",
                  file=sys.stderr)
            return 2
        if own is None:
            print("mimo-inspect plan: error: --config CFG is required" + (
                f" (--model {args.model} sets no data.preprocess)" if yaml_model else
                " (it may be left out only with --model TRAIN.yaml: its data.preprocess)"),
                file=sys.stderr)
            return 2
        if not os.path.isfile(own):
            print(f"mimo-inspect plan: error: --model {args.model}'s data.preprocess {own} is "
                  "not a file: fix the YAML, or give --config CFG", file=sys.stderr)
            return 2
        args.config = own
    try:
        config = PreprocessConfig.from_yaml(args.config)
        if args.command == "plan":
            return _plan(args, config, advisor, layout_refusal, run_settings)
        return _report(args, config, started) if args.command == "report" else \
            _sample(args, config)
    except DatasetError as exc:     # damaged or incomplete: 1; no such directory: 2
        error, status = str(exc), 2 if exc.missing else 1
    except StorageError as exc:     # the storage kept failing (retried already)
        error, status = str(exc), 1
    except WorkerDied as exc:       # --workers: the OOM killer, a crash
        error, status = str(exc), 1
    except BrokenPipeError:         # the output's reader gone (| head): quiet_when_stdout_closes
        raise
    except (ConfigError, OSError, ValueError, SegmentCacheError) as exc:
        error, status = str(exc), 2
    print(f"mimo-inspect {args.command}: error: {error}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
