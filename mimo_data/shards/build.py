"""`mimo-shard build`: raw inputs → validated, indexed WebDataset shards.

Everything is written into ``OUTPUT/.staging`` first, moved into place at the end, and
``index.json`` comes last (atomically): a build killed at any point leaves no new index, and
an old dataset it was to replace (``--overwrite``) whole (``swap``). An output URL
(``s3://bucket/prefix``, any fsspec location) is built the same way: staging is a local
temporary directory, each shard is uploaded as soon as it is complete (local disk holds one
shard at a time), the other files follow, and ``index.json`` is the last object written.
The output is claimed first (``claim``): one build or indexing at a time writes it.

The output order, keys and bytes depend only on the inputs and options (not on
``--workers``): workers validate in parallel, results are consumed in task order.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from mimo_data.shards import claim, sample_table, storage
from mimo_data.shards.record_table import RecordWriter
from mimo_data.shards.record_table import file_name as records_file_name
from mimo_data.files import write_atomic
from mimo_data.shards.index import dumps
from mimo_data.modalities import MODALITIES
from mimo_data.modalities.image import DEFAULT_MAX_IMAGE_PIXELS
from mimo_data.shards.validate import RELATIVE_PATHS, MediaPolicy, Prepared, Rejected, prepare
from mimo_data.shards.records import RecordError
from mimo_data.tally import Tally
from mimo_data.shards.format import (CLAIM_FILE, CLAIM_PROBE, FORMAT_NAME, FORMAT_VERSION,
                                    INDEX_FILE, REPORT_FILE, SAMPLES_FILE, SAMPLES_SCHEMA,
                                    SKIPPED_FILE, STAGING_DIR, index_fields, sample_key,
                                    summary_column)
from mimo_data.shards.writer import ShardSet
from mimo_data.modalities.video.frames import MAX_FPS, MIN_FPS
from mimo_data.shards.sources import ParquetTable, SpeechManifest, Task, open_source
from mimo_data.shards.stops import BuildError, OutputFull, StrictStop
from mimo_data.shards import swap, task_stream
from mimo_data.worker_pool import ordered_map


@dataclass
class BuildOptions:
    name: str = "data"
    max_samples_per_shard: int = 5000
    max_shard_bytes: int = 1 << 30
    workers: int = 1
    shuffle: bool = False
    seed: int = 0
    strict: bool = False
    overwrite: bool = False
    media_root: str | None = None
    input_format: str = "auto"
    instruction: str = "Transcribe the audio."
    columns: dict = field(default_factory=dict)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    check: str = "decode"
    progress: bool = True
    markers_first: bool = False   # place a modality's missing markers before the first user text
    frames_fps: float | None = None   # read a video given as a folder of frames, this many a second


# index.json.tmp-PID: left by a build killed inside the atomic write of its index
_OWN_FILE = re.compile(r"^(index\.json(\.tmp-\d+)?|samples\.parquet|report(\.failed)?\.json"
                       r"|skipped\.failed\.jsonl"
                       rf"|\.staging|\.mimo-cache|{re.escape(CLAIM_FILE)}|{re.escape(CLAIM_PROBE)}[0-9a-f]+"
                       r")$")
_SHARD_FILE = re.compile(r"^.+-\d{6}\.tar$")


def _foreign(names: list[str], killed: bool) -> list[str]:
    """Of an output's ``names``, those no build wrote. A tar named as a build's shard is a
    build's only where the output says so: a dataset's index, a swap's staging or sample
    table (a build killed while moving its files in), or a killed build's claim (one killed
    while uploading its shards into a bucket); otherwise it is the user's own (a WebDataset
    folder given as --output), which a build must not remove; so is a skipped list beside
    none of those or a report."""
    built = killed or bool({INDEX_FILE, STAGING_DIR, SAMPLES_FILE} & set(names))
    reported = built or REPORT_FILE in names        # a run's that kept no sample too
    return sorted(n for n in names if not _OWN_FILE.match(n)
                  and not (built and _SHARD_FILE.match(n))
                  and not (reported and n == SKIPPED_FILE))


def _refusal(output: str, foreign: list[str], what: str) -> BuildError:
    shards = any(_SHARD_FILE.match(name) for name in foreign)
    return BuildError(
        f"{output} {what} a build did not write ({', '.join(foreign[:5])}"
        f"{' ...' if len(foreign) > 5 else ''}); use an empty or new "
        f"{'directory' if what.startswith('contains') else 'prefix'}" +
        (": tars made elsewhere are indexed where they are with `mimo-shard index`; a "
         "build's own shards beside no index, staging or claim of a mimo run are removed by "
         "hand" if shards else ""))


def _prepare_output(output: str, overwrite: bool, killed: bool) -> list[str]:
    """Make the claimed folder ``output`` ready for a build (``killed``: a killed run's claim
    was found there); return the names of an old dataset that stays there until the build is
    complete ([]: none)."""
    if os.path.exists(os.path.join(output, INDEX_FILE)) and not overwrite:
        raise BuildError(f"{output} already holds a built dataset; pass --overwrite to replace "
                         "it or choose another --output")
    foreign = _foreign(os.listdir(output), killed)
    if foreign:
        raise _refusal(output, foreign, "contains files")
    return swap.clear_folder(output)


class _SamplesTable:
    """Streams rows of ``samples.parquet`` (SAMPLES_SCHEMA) to disk in batches."""

    BATCH = 8192

    def __init__(self, path: str):
        self._writer = pq.ParquetWriter(path, SAMPLES_SCHEMA)
        self._rows: list[dict] = []

    def add(self, key: str, shard: str, sample: Prepared, members: list[dict]) -> None:
        row = {"key": key, "shard": shard, "id": sample.id, "source": sample.location,
               "members": members, "num_turns": len(sample.messages),
               "text_chars": (len(sample.text) if sample.text is not None else
                              sum(len(m["content"]) for m in sample.messages))}
        for name, modality in MODALITIES.items():
            items = [m for m in sample.media if m["modality"] == name]
            row.update((summary_column(name, field), [m[field] for m in items])
                       for field in modality.summary_fields)
        self._rows.append(row)
        if len(self._rows) >= self.BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=SAMPLES_SCHEMA))
            self._rows = []

    def close(self) -> None:
        self._flush()
        self._writer.close()


# Worker-process state, set once per process by _init_worker (sources hold open-file metadata).
_WORKER: dict = {}


def _init_worker(sources, policy) -> None:
    _WORKER["sources"], _WORKER["policy"] = sources, policy


def _prepare_task(task):
    return prepare(task, _WORKER["sources"][task.source], _WORKER["policy"])


def _prepare_chunk(tasks):
    return [_prepare_task(task) for task in tasks]


def _chunk_records(tasks) -> str:
    return f"records {tasks[0].location} to {tasks[-1].location}"


_CHUNK = 8             # tasks a worker takes at a time
_CHUNKS_PER_WORKER = 4  # chunks in flight per worker: the window of records held at once


def _results(tasks, sources, policy, workers):
    """Prepared/Rejected results in task order, from ``workers`` processes validating while
    this one writes (0 = validate in this process too). ``tasks`` is read lazily (a worker
    is sent its chunks, never the task list), and at most ``_CHUNKS_PER_WORKER`` chunks per
    worker are in flight: memory holds a window of records, whichever side is slower."""
    if workers <= 0:
        _init_worker(sources, policy)
        yield from map(_prepare_task, tasks)
        return
    chunks = iter(lambda: list(itertools.islice(tasks, _CHUNK)), [])
    for done in ordered_map(_prepare_chunk, chunks, workers, workers * _CHUNKS_PER_WORKER,
                            describe=_chunk_records, initializer=_init_worker,
                            initargs=(sources, policy),
                            advice="the build stopped, no index.json written: build again "
                            "with fewer --workers, or --workers 0 to read the records in this "
                            "process and see the failure"):
        yield from done


class _InputCounts:
    """Records read and samples written per input, a result matched to its task by order
    (results come in task order, shuffled or not): the report says what each input gave, and
    an input among several that gave no sample is said at the end of the build."""

    def __init__(self, inputs: list[str]):
        self.inputs = inputs
        self.read = [0] * len(inputs)
        self.written = [0] * len(inputs)
        self._pending: deque[int] = deque()     # the inputs of tasks sent, not yet a result

    def sent(self, tasks: Iterator[Task]) -> Iterator[Task]:
        for task in tasks:
            self.read[task.source] += 1
            self._pending.append(task.source)
            yield task

    def next_result(self) -> int:
        """The input of the next result."""
        return self._pending.popleft()

    def to_list(self) -> list[dict]:
        return [{"input": path, "records_read": read, "samples_written": written}
                for path, read, written in zip(self.inputs, self.read, self.written)]

    def warnings(self) -> list[str]:
        """An input that gave no sample while others did (with one input the build's own
        error says it): an empty file, or records all skipped (another format, a media root
        of another input)."""
        if len(self.inputs) < 2 or not any(self.written):
            return []
        return [f"warning: input {path}: " + (
            "no record in it (an empty file, or an export that failed?)" if not read else
            f"all {read} record(s) skipped (report.json's skipped_by_reason says why, its "
            "inputs what each input gave)")
            for path, read, written in zip(self.inputs, self.read, self.written)
            if not written]


def _media_root_hint(missing: int, read: int, media_root: str | None) -> str:
    """A warning where half the records ``read`` or more were skipped as ``missing_media``
    for a local file not found (``missing`` of them; not URLs): their paths likely relative
    to another folder than the one they are read against."""
    if not missing or 2 * missing < read:
        return ""
    return (f"warning: {missing} of the {read} record(s) read were skipped as missing_media, "
            "their files not found: " + (f"are their media paths relative to --media-root "
                                 f"{media_root}? (skipped.jsonl names each path looked for)"
                                 if media_root else "their media paths are read relative to "
                                 "each input file's folder: where they are relative to "
                                 "another, give it as --media-root"))


def _globbed(inputs: list[str]) -> list[str]:
    """``inputs`` with each glob pattern (quoted, so the shell left it: ``'data/*.parquet'``,
    a hub download's shards; ``**`` spans folders) replaced by the files it matches, sorted
    (the folders it matches and the files of a mimo dataset's folder, an earlier build's
    output, left out: said). BuildError for a file given twice (its records would each be a
    duplicate of themselves)."""
    found: list[str] = []
    for given in inputs:
        if any(c in given for c in "*?[") and not os.path.exists(given):
            files = sorted(p for p in glob.glob(given, recursive=True) if os.path.isfile(p))
            known: dict[str, bool] = {}
            outputs = [p for p in files if _in_a_dataset(p, known)]
            matched = [p for p in files if p not in outputs]
            if outputs:
                print(f"mimo-shard: {given} leaves out {len(outputs)} file(s) of mimo datasets "
                      f"(e.g. {outputs[0]}): a build's output is no input", file=sys.stderr)
            if not matched:
                raise BuildError(f"{given}: matches no file" + (
                    " but a mimo dataset's" if outputs else ""))
            found += matched
        else:
            found.append(given)
    first: dict[str, str] = {}
    for path in found:
        same = first.setdefault(os.path.realpath(path), path)
        if same is not path:
            raise BuildError(f"{path} is given twice" + (f" (first as {same})" if same != path
                                                         else "") +
                             ": each of its records would be read twice; give it once")
    _no_copies(found)
    return found


def _no_copies(paths: list[str]) -> None:
    """BuildError where two of the local files ``paths`` hold the same bytes (a file fetched
    twice, a glob reaching a copy): records without ids would each be read twice, unsaid.
    Only files of one size are hashed."""
    by_size: dict[int, list[str]] = {}
    for path in filter(os.path.isfile, paths):
        if size := os.path.getsize(path):                      # (empty: no records)
            by_size.setdefault(size, []).append(path)
    for same_size in by_size.values():
        seen: dict[str, str] = {}
        for path in same_size if len(same_size) > 1 else ():
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            if digest in seen:
                raise BuildError(f"{path} holds the same bytes as {seen[digest]} (a copy?): each "
                                 "of its records would be read twice; give one (to weight a "
                                 "dataset, training's data.weights do)")
            seen[digest] = path


def _in_a_dataset(path: str, known: dict[str, bool]) -> bool:
    """``path`` lies in a mimo dataset's folder (its index.json beside samples.parquet) or
    below one (``known``: the folders looked at so far)."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in known:
        parent = os.path.dirname(folder)
        known[folder] = all(os.path.isfile(os.path.join(folder, name))
                            for name in (INDEX_FILE, SAMPLES_FILE)) or \
            parent != folder and _in_a_dataset(folder, known)
    return known[folder]


def build(inputs: list[str], output: str, options: BuildOptions,
          storage_options: dict | None = None) -> dict:
    """Build the dataset; return the index. Raises BuildError (nothing is left behind then:
    no new index, so nothing a reader takes for a dataset, and an old dataset as it was). A
    build that writes no sample leaves its report alone (``swap``): no dataset, and its
    output takes the next build as is."""
    if not inputs:
        raise BuildError("no inputs given")
    if output.lower().startswith(("http://", "https://")):
        raise BuildError(f"--output {output}: a dataset is read over HTTP, not written: build "
                         "into a local folder or an object store's URL (s3://, gs://, az://) "
                         "and serve that")
    for flag, value, least in (("--max-samples-per-shard", options.max_samples_per_shard, 1),
                               ("--max-shard-bytes", options.max_shard_bytes, 1),
                               ("--workers", options.workers, 0)):
        if value < least:
            raise BuildError(f"{flag} is {value}: it must be at least {least}")
    if options.frames_fps is not None and not MIN_FPS <= options.frames_fps <= MAX_FPS:
        raise BuildError(f"--frames-fps {options.frames_fps:g}: frames are taken {MIN_FPS:g} "
                         f"to {MAX_FPS:g} a second")
    if options.media_root is not None and not os.path.isdir(options.media_root):
        raise BuildError(f"--media-root {options.media_root} is not a folder here: give the "
                         "folder the records' relative media paths start from")
    inputs = _globbed(inputs)
    sources = [open_source(path, input_format=options.input_format,
                           media_root=options.media_root, instruction=options.instruction,
                           columns=options.columns) for path in inputs]
    # never a flag silently unused
    if options.instruction != BuildOptions.instruction and not any(
            isinstance(source, SpeechManifest) for source in sources):
        raise BuildError("--instruction is the user turn of speech manifests' records, and no "
                         "input is one: a table's transcripts (--caption-column) train with "
                         "the preprocessing config's captions prompt")
    if options.columns and not any(isinstance(source, ParquetTable) for source in sources):
        raise BuildError("the --*-column flags name a Parquet table's columns, and no input "
                         "is one")
    if storage.is_remote(output):
        return _build_remote(inputs, output, sources, options,
                             storage.Remote(output, storage_options))
    output = storage.local_path(output)
    with swap.output_folder(output, f"--output {output}", BuildError), \
            claim.held(output, "mimo-shard build") as held:
        return _build_local(inputs, output, sources, options, held.killed is not None)


def _build_local(inputs, output: str, sources, options: BuildOptions, killed: bool) -> dict:
    old = _prepare_output(output, options.overwrite, killed)
    index, summary, report = swap.write_in_place(
        output, f"--output {output}", old, BuildError,
        lambda staging: _build_into(staging, inputs, sources, options))
    _say_built(index, summary, output, report, bool(old))
    return index


def _prepare_remote_output(remote: storage.Remote, output: str,
                           overwrite: bool, killed: bool) -> list[str]:
    """``_prepare_output`` for the claimed output URL: the same refusals. Returns the names
    of an old dataset that stays until the build is complete ([]: none)."""
    names = remote.names(output)
    if INDEX_FILE in names and not overwrite:
        raise BuildError(f"{output} already holds a built dataset; pass --overwrite to replace "
                         "it or choose another --output")
    foreign = _foreign(names, killed)
    if foreign:
        raise _refusal(output, foreign, "holds objects")
    return swap.clear_prefix(remote, output, names)


def _build_remote(inputs, output: str, sources, options: BuildOptions,
                  remote: storage.Remote) -> dict:
    with ExitStack() as stack:
        # the claim is the first write: a missing bucket, read-only credentials are found
        # before any record is read
        try:
            held = stack.enter_context(claim.held(output, "mimo-shard build", remote))
        except FileNotFoundError as error:      # S3's NoSuchBucket, or no S3 store there
            raise BuildError(f"cannot write to --output {output}: " + storage.bucket_missing(
                output, remote.options, error) + "; create it first, or check the URL and "
                "the endpoint") from None
        return _build_claimed_remote(inputs, output, sources, options, remote, held)


def _build_claimed_remote(inputs, output: str, sources, options: BuildOptions,
                          remote: storage.Remote, held: claim.Claim) -> dict:
    old = _prepare_remote_output(remote, output, options.overwrite, held.killed is not None)
    staging = tempfile.mkdtemp(prefix="mimo-build-")
    shards_to = swap.staged(output) if old else output
    uploaded: list[str] = []

    def upload(path: str) -> None:          # a complete shard: to the bucket, off the disk
        held.confirm()
        uploaded.append(storage.join(shards_to, os.path.basename(path)))
        remote.put(path, uploaded[-1])
        os.remove(path)

    try:
        index, summary = _build_into(staging, inputs, sources, options, upload)
        held.confirm()
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if old and not held.lost:           # (the staged shards of the run that took over)
            _remove_staged(remote, output)
        elif not held.lost:     # beside no index nor claim, a next run could not tell them
            _remove_uploaded(remote, uploaded)      # from the user's own tars
        if isinstance(exc, OSError) and exc.errno in swap.NO_ROOM:
            raise OutputFull(
                f"no room left writing {exc.filename or staging} ({exc.strerror}): a build "
                "into a bucket stages one shard at a time and the tables in a local temporary "
                "folder; set TMPDIR to a folder with room for them (no index was written"
                f"{', the dataset there is as it was' if old else ''})") from None
        raise
    try:
        report = swap.into_prefix(remote, output, staging, index, old)
        if index["totals"]["samples"]:
            held.confirm()                  # (a long swap: still this run's output)
            remote.write(storage.join(output, INDEX_FILE), dumps(index))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _say_built(index, summary, output, report, bool(old))
    return index


def _remove_staged(remote: storage.Remote, output: str) -> None:
    """Remove a failed build's shards from beside the dataset it was to replace, or say
    where they are."""
    try:
        remote.remove(swap.staged(output), recursive=True)
    except OSError as exc:
        print(f"mimo-shard: the failed build's shards are left under {swap.staged(output)} "
              f"({exc}); the next build with --overwrite removes them", file=sys.stderr)


def _remove_uploaded(remote: storage.Remote, uploaded: list[str]) -> None:
    """Remove a failed build's shards from an output that holds no dataset, or say which are
    left."""
    left = []
    for number, url in enumerate(uploaded):
        try:
            remote.remove(url)
        except OSError:         # a store that refuses one (unreachable, say) refuses the rest:
            left = uploaded[number:]        # each try would wait out its retries again
            break
    if left:
        print(f"mimo-shard: the failed build's shards {', '.join(left[:3])}"
              f"{' ...' if len(left) > 3 else ''} are left (the store refused their removal), "
              "and its claim on the prefix likely too: the next build into it, once the claim "
              "lapses (a minute from here, 5 from another host), takes it over and removes "
              "them", file=sys.stderr)


def _say_built(index: dict, summary: str, output: str, report: str, replacing: bool) -> None:
    see = swap.see_report(report, index)
    if replacing and not index["totals"]["samples"]:
        see += f"; the dataset at {output} is as it was"
    print(f"mimo-shard: {summary} in {index['totals']['shards']} shard(s) → {output}{see}",
          file=sys.stderr)


def _duplicate_hint(first_file: str, source: dict) -> str:
    """What to do about a record whose id an earlier record of ``first_file`` has."""
    if first_file != source["file"]:
        return (" in another input: ids are the dataset's, unique across its inputs; where "
                "each input numbers its own records, build each into its own dataset and mix "
                "them in training (data.datasets, with data.weights)")
    if "row" in source:
        return (" (where a table's ids name what its rows share, a sentence read by several "
                "speakers say, give a column that names each row with --id-column)")
    return ""


def _build_into(staging: str, inputs, sources, options: BuildOptions,
                shard_done: Callable[[str], None] | None = None) -> tuple[dict, str]:
    """Write the dataset into ``staging``; return its index (not written: the caller publishes
    the files, then the index) and the build's summary line. ``shard_done`` gets each
    complete shard's path."""
    progress = tqdm(total=task_stream.count(sources), unit="rec", desc="build",
                    disable=not options.progress, file=sys.stderr)

    def set_total(total: int) -> None:
        progress.total = total
        progress.refresh()

    # Read as consumed (after the workers start): no task list, in the workers or here.
    tasks = task_stream.shuffled(sources, options.seed, set_total) if options.shuffle else \
        task_stream.stream(sources)
    policy = MediaPolicy(options.max_image_pixels, options.check,
                         defer_files=options.workers > 0, markers_first=options.markers_first,
                         frames_fps=options.frames_fps)
    # every skip in full beside the report (which names the first few of each reason)
    with open(os.path.join(staging, SKIPPED_FILE), "w", encoding="utf-8") as every_skip:
        report = Tally("records_read", "samples_written", "records_skipped",
                       every_skip=every_skip)
        per_input = _InputCounts(list(inputs))
        not_found = 0               # missing_media skips of local files not found
        shards = ShardSet(staging, options.name, options.max_samples_per_shard,
                          options.max_shard_bytes, shard_done)
        table = _SamplesTable(os.path.join(staging, SAMPLES_FILE))
        records = RecordWriter(os.path.join(staging, "records.arrows"))
        seen_ids = task_stream.IdRegistry()     # hashes, not strings: no object per sample
        for result in _results(per_input.sent(iter(tasks)), sources, policy, options.workers):
            progress.update()
            source = per_input.next_result()
            taken = seen_ids.first(result.id) if isinstance(result, Prepared) and \
                result.id is not None else None
            if isinstance(result, Prepared) and taken is not None:
                result = Rejected("duplicate_id", result.location,
                                  f"id {result.id!r} was already taken by {taken[1]}"
                                  + _duplicate_hint(taken[0], result.source), result.id)
            if isinstance(result, Prepared):
                try:
                    payloads = result.media_bytes()
                except RecordError as exc:
                    result = Rejected(exc.reason, result.location, exc.detail, result.id)
            if isinstance(result, Rejected):
                if options.strict:
                    raise StrictStop(f"{result.location}: {result.reason}: {result.detail} "
                                     "(--strict stops at the first bad record)")
                report.skip(result.reason, result.location, result.detail, result.id)
                not_found += result.reason == "missing_media" and RELATIVE_PATHS in result.detail
                continue
            if result.id is not None:
                seen_ids.add(result.id, result.source)
            key = sample_key(report.kept)
            sample = {"key": key, "id": result.id, "source": result.source,
                      **({"messages": result.messages} if result.kind == "conversation" else
                         {"kind": result.kind, "text": result.text}),
                      "media": result.media}
            members = {"json": json.dumps(sample, ensure_ascii=False).encode("utf-8")}
            members.update((m["member"], data) for m, data in zip(result.media, payloads))
            shard, member_records = shards.add(key, members)
            table.add(key, shard, result, member_records)
            records.add(members["json"])
            report.keep()
            per_input.written[source] += 1
            for name, number in result.counts.items():
                report.count(name, number)
    progress.close()
    shard_list = shards.close()
    table.close()
    write_atomic(os.path.join(staging, REPORT_FILE),
                 dumps(report.to_dict() | {"inputs": per_input.to_list()}))
    for line in per_input.warnings():
        print(line, file=sys.stderr)
    if line := _media_root_hint(not_found, report.seen, options.media_root):
        print(line, file=sys.stderr)
    index = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "name": options.name,
        **index_fields(staging, shard_list, report, (SAMPLES_FILE, REPORT_FILE)),
        "build": {"inputs": list(inputs),
                  **{k: v for k, v in asdict(options).items() if k not in ("progress", "workers",
                                                                           "overwrite")}},
    }
    cache_folder, key = sample_table.write_cache(index, staging)
    records.finish(os.path.join(cache_folder, records_file_name(key)), key)
    return index, report.summary()
