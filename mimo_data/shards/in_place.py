"""`mimo-shard index`: existing WebDataset or Energon shards indexed where they are.

The tars and their layout come from ``tar_sources``. Each tar is read once (``tar_walk``: every
member's data offset, size and crc32, the file's size and sha256), each sample's members become
a mimo record by its layout (``layouts``; Energon's ``field_map``: ``energon``), each medium is
probed as ``mimo-shard build`` probes it, and the dataset's files are written into the output
directory: ``samples.parquet`` (its ``shard`` column names tars relative to the index's
``shard_root``), ``records.parquet`` (the records: the tars hold no mimo ``KEY.json``),
``report.json``, the derived tables in ``.mimo-cache/`` and, last and atomically, ``index.json``
(format version 2: ``shard_root`` says where the tars are). Nothing is ever written beside the
tars, which may be read-only or in object storage.

Tars are indexed in ``--workers`` processes, one tar per task, results consumed in tar order, so
the files are byte-identical whatever the number of workers. Bad samples are counted by reason
in ``report.json`` and left out; a truncated tar keeps the samples it holds completely.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from mimo_data.stats import size_text
from mimo_data.files import parquet_batches, write_atomic
from mimo_data.modalities import MODALITIES, MediaError
from mimo_data.shards import cache, claim, energon, sample_table, storage, swap
from mimo_data.shards.format import (CLAIM_FILE, FAILED_REPORT_FILE, FAILED_SKIPPED_FILE,
                                    FORMAT_NAME, INDEX_FILE, INDEXED_VERSION, RECORDS_FILE,
                                    REPORT_FILE, SAMPLES_FILE, SAMPLES_SCHEMA, SKIPPED_FILE,
                                    SPLIT_EXCLUDED, STAGING_DIR, VIDEOS_ROTATED, index_fields,
                                    summary_column)
from mimo_data.shards.index import dumps
from mimo_data.shards.layouts import LAYOUT_WORDS, LAYOUTS, MemberMap, detect, synthesize
from mimo_data.shards import record_table
from mimo_data.worker_pool import ordered_map
from mimo_data.shards.records import RecordError
from mimo_data.shards.stops import StrictStop
from mimo_data.shards.tar_sources import (DETECT_SAMPLES, IndexInputError, IndexOptions,
                                          Source, open_tar, output_given_as_source, resolve,
                                          members_apart, say, split_keys, tar_version)
from mimo_data.shards.tar_walk import NotATarError, Walked, walk
from mimo_data.tally import FIRST_LOCATIONS, Tally

_BATCH = 8192                 # rows written to samples.parquet / records.parquet at a time
_OWN = {INDEX_FILE, SAMPLES_FILE, RECORDS_FILE, REPORT_FILE, FAILED_REPORT_FILE,
        FAILED_SKIPPED_FILE, STAGING_DIR, cache.DATASET_CACHE, CLAIM_FILE}


@dataclass
class ShardResult:
    """What indexing one tar gave (sent from a worker to the writer)."""
    name: str
    rows: list[dict] = field(default_factory=list)
    records: list[bytes] = field(default_factory=list)
    skips: list[tuple[str, str, str]] = field(default_factory=list)   # reason, where, detail
    members_aside: list[tuple[str, str, str]] = field(default_factory=list)   # of no sample
    walked: Walked = field(default_factory=Walked)
    samples: int = 0                  # samples the tar holds (kept or not)
    seconds: float = 0.0
    version: str | None = None        # the tar's as it was opened (``storage.version``)
    # what the rows hold that the report counts (``Synthesized.counts``), by the report's name
    counts: Counter[str] = field(default_factory=Counter)


# ---------------------------------------------------------------------------- one tar

@dataclass(frozen=True)
class _Job:
    root: str
    name: str
    mapping: MemberMap
    check: str
    max_image_pixels: int
    storage_options: dict | None
    excluded: frozenset[str] = frozenset()      # keys split.yaml excludes from this tar
    first: str = ""               # the tar the layout was detected from ("": given, not checked)
    keys_per_tar: bool = False    # a sample's key is TAR/KEY (Energon's name of a sample)


def _sample(job: _Job, key: str, members: dict, result: ShardResult) -> None:
    """Index one sample of ``job``'s tar into ``result`` (a row and a record, or a skip)."""
    where = f"{job.name}:{key}"
    data = {suffix: member.data for suffix, member in members.items()}
    try:
        made = synthesize(data, job.mapping, key)
        media = []
        for modality, member in made.media:
            try:
                meta = MODALITIES[modality].probe(data[member], job.check, job.max_image_pixels)
            except MediaError as exc:
                raise RecordError.of_media(exc, f"member {key}.{member}") from None
            media.append({"modality": modality, "member": member, "bytes": len(data[member]),
                          **meta})
    except RecordError as exc:
        result.skips.append((exc.reason, where, exc.detail))
        return
    if rotated := sum(1 for item in media if item.get("rotation")):
        result.counts[VIDEOS_ROTATED] += rotated
    named = f"{job.name}/{key}" if job.keys_per_tar else key      # the dataset's key
    record: dict[str, Any] = {"key": named, "id": made.fields.pop("id"),
              "source": {"file": job.name, "key": key, **made.source}, **made.fields,
              "media": media}
    messages: list[dict] = record.get("messages", [])
    row = {"key": named, "shard": job.name, "id": record["id"], "source": where,
           "members": [{"name": suffix, "offset": m.offset, "size": m.size, "crc32": m.crc32}
                       for suffix, m in members.items()],
           "num_turns": len(messages),
           "text_chars": len(record["text"]) if "text" in record else
           sum(len(m["content"]) for m in messages)}
    for name, kind in MODALITIES.items():
        items = [item for item in media if item["modality"] == name]
        row.update((summary_column(name, f), [item[f] for item in items])
                   for f in kind.summary_fields)
    result.rows.append(row)
    result.counts.update(made.counts)
    result.records.append(json.dumps(record, ensure_ascii=False).encode("utf-8"))


def index_shard(job: _Job) -> ShardResult:
    """Index one tar: its samples' rows and records, its skips, its size and sha256."""
    location = storage.join(job.root, job.name)

    def attempt() -> ShardResult:
        started = time.perf_counter()
        result = ShardResult(job.name)
        keys: set[str] = set()
        head: list[dict[str, bytes]] = []          # the first samples, for the layout's check
        runs: dict[str, set[frozenset[str]]] = {}  # their keys' runs of members
        try:
            with open_tar(location, job.storage_options) as tar:
                result.version = tar_version(tar, location)
                for sample in walk(tar, result.walked, location):
                    result.samples += 1
                    if job.first and len(head) < DETECT_SAMPLES:
                        head.append({suffix: m.data for suffix, m in sample.members.items()})
                        runs.setdefault(sample.key, set()).add(frozenset(sample.members))
                        if len(head) == DETECT_SAMPLES:
                            _check_layout(job, head, runs)
                    if sample.key in job.excluded:
                        result.skips.append((SPLIT_EXCLUDED, f"{job.name}:{sample.key}", "its "
                                             f"{job.name}/{sample.key} is in the Energon "
                                             "folder's .nv-meta/split.yaml exclude list"))
                        continue
                    if sample.duplicates:
                        result.skips.append(("duplicate_member", f"{job.name}:{sample.key}",
                                             f"members {sample.duplicates} repeat a suffix of "
                                             "the sample (suffixes are lowercased, as webdataset "
                                             "reads them); rename or remove them"))
                        continue
                    if sample.key in keys:
                        result.skips.append(("duplicate_key", f"{job.name}:{sample.key}",
                                             "the key occurs twice in the tar (not one after "
                                             "the other); the first is kept, unless it is "
                                             "left out for a reason counted apart: a "
                                             "sample's members are read one after "
                                             "the other, as webdataset reads them, so write "
                                             "each sample's members together"))
                        continue
                    keys.add(sample.key)
                    _sample(job, sample.key, sample.members, result)
        except FileNotFoundError:
            raise IndexInputError(f"{location}: no such tar") from None
        except NotATarError as exc:
            raise IndexInputError(f"{location}: {exc}") from None
        if job.first and len(head) < DETECT_SAMPLES:
            _check_layout(job, head, runs)
        if result.walked.truncated:
            cut = result.walked.cut_key
            result.skips.append(("truncated_tar", f"{job.name}:{cut}" if cut else job.name,
                                 f"{result.walked.truncated}; the samples before are kept, "
                                 f"the one being read{f' ({cut})' if cut else ''} is left out"))
        result.members_aside += [
            ("stray_member", f"{job.name}:{name}", "a macOS metadata file (._*), no data"
             if os.path.basename(name).startswith("._") else "a member without a suffix "
             "(KEY.ext) belongs to no sample") for name in result.walked.stray]
        result.members_aside += [
            ("link_member", f"{job.name}:{name}", f"{name} is {link}: a link holds no data of "
             "its own (webdataset skips it too), so its sample lacks that member. GNU tar "
             "stores a file's second name as a hard link: write the tar with "
             "--hard-dereference (symbolic links: -h)") for name, link in result.walked.links]
        if result.walked.trailing is not None:
            end, data_at = result.walked.trailing
            result.members_aside.append((
                "trailing_data", job.name, f"the tar's end-of-archive block at byte {end} is "
                f"followed by data at byte {data_at} (of {result.walked.bytes}): tars joined "
                "with `cat`? Neither tar nor webdataset reads past that block, so none of it is "
                "indexed: join tars with `tar --concatenate`, or index them as separate tars"))
        result.seconds = time.perf_counter() - started
        return result
    if storage.is_remote(location):
        return storage.Remote(location, job.storage_options).retried(f"reading {location}",
                                                                     attempt)
    return attempt()


def _check_counts(source: Source, walked: dict[str, int]) -> None:
    """Say which tars hold another number of samples than ``energon prepare`` counted (the
    tar changed or was cut short since): the index is of the tars as they are now."""
    differ = [f"{name}: {walked[name]}, it says {source.counts[name]}" for name in walked
              if name in source.counts and source.counts[name] != walked[name]]
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        say(f"warning: {len(differ)} tar(s) hold another number of samples than "
            f"{source.counts_file} says "
            f"({'; '.join(differ[:3])}{more}): changed or cut short since `energon prepare`? "
            "They are indexed as they are now; Energon's own loader would read them by its "
            "counts")


def _check_layout(job: _Job, head: list[dict[str, bytes]],
                  runs: dict[str, set[frozenset[str]]]) -> None:
    """IndexInputError where ``job``'s tar's first samples (``runs``: their keys' runs of
    members) are of another layout than the one detected from the first tar's (a
    conversation tar read as caption pairs would be skipped whole, each sample without its
    caption), or show its members of one key apart (``members_apart``: each member would be
    skipped alone), as the first tar's are checked (lone members where its first
    ``DETECT_SAMPLES`` are all so)."""
    # lone members said only of a full head: a short tar's one sample may lack its caption
    apart = members_apart(head if len(head) == DETECT_SAMPLES else [], split_keys(runs),
                          job.mapping.layout, job.mapping.json)
    if apart:
        raise IndexInputError(f"{storage.join(job.root, job.name)}: {apart}")
    found = detect(head, job.mapping.json)
    if found is not None and found != job.mapping.layout:
        raise IndexInputError(
            f"{storage.join(job.root, job.name)}: its samples are {LAYOUT_WORDS[found]}, and "
            f"those of {job.first}, which the layout was detected from, "
            f"{LAYOUT_WORDS[job.mapping.layout]}: index the tars of each layout alone and "
            "train on the indexes together (data.datasets: [A, B]), or give --layout to read "
            "every tar as one")


def _results(jobs: list[_Job], workers: int) -> Iterator[ShardResult]:
    """Each tar's result in tar order, from ``workers`` processes (0: this one). One tar per
    worker in flight: a writer slower than the workers holds a few tars' rows, not a pile of
    them (``Pool.imap`` kept every finished result until it was consumed)."""
    if workers <= 0:
        yield from map(index_shard, jobs)
        return
    yield from ordered_map(index_shard, jobs, workers, workers,
                           describe=lambda job: f"tar {job.name}",
                           advice="no index written: index again with fewer --workers, or "
                           "--workers 0 to index in this process and see the failure")


# ------------------------------------------------------------------------------ output

def _named(output: str, given: bool) -> str:
    """The output folder as messages name it: the option given, or the cache's folder."""
    return f"--output {output}" if given else f"the index folder {output} (no --output given)"


def _prepare_output(output: str, named: str, options: IndexOptions, source: Source,
                    storage_options: dict | None) -> list[str]:
    """Make the claimed folder ``output`` ready for an indexing of ``source``; return the
    names of an old index that stays there until the new one is complete ([]: none)."""
    names = set(os.listdir(output))
    if INDEX_FILE in names and not options.overwrite:
        raise IndexInputError(f"{named} already holds an index"
                              f"{_changed(output, source, options, storage_options)}")
    indexed = bool({INDEX_FILE, STAGING_DIR, SAMPLES_FILE, REPORT_FILE} & names)  # a user's
    foreign = sorted(n for n in names if n not in _OWN          # list, beside none, stays
                     and not n.startswith(INDEX_FILE + ".tmp")
                     and not (indexed and n == SKIPPED_FILE))
    if foreign:
        raise IndexInputError(f"{output} holds files an index did not write "
                              f"({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}); "
                              "use an empty or new directory")
    return swap.clear_folder(output)


class _Tables:
    """samples.parquet and records.parquet written as results come; modality counts."""

    def __init__(self, folder: str):
        self._samples = pq.ParquetWriter(os.path.join(folder, SAMPLES_FILE), SAMPLES_SCHEMA)
        self._records = pq.ParquetWriter(os.path.join(folder, RECORDS_FILE),
                                         record_table.SCHEMA)
        self._rows: list[dict] = []
        self._jsons: list[bytes] = []

    def add(self, result: ShardResult) -> None:
        self._rows += result.rows
        self._jsons += result.records
        if len(self._rows) >= _BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._samples.write_table(pa.Table.from_pylist(self._rows, schema=SAMPLES_SCHEMA))
            self._records.write_table(pa.table([pa.array(self._jsons, pa.large_binary())],
                                               schema=record_table.SCHEMA))
            self._rows, self._jsons = [], []

    def close(self) -> None:
        self._flush()
        self._samples.close()
        self._records.close()


def _stop_strict(reason: str, where: str, detail: str) -> None:
    """``--strict``: StrictStop at a record skipped (no index is written)."""
    raise StrictStop(f"{where}: {reason}: {detail} (--strict stops at the first bad record)")


def _drop_duplicate_keys(staging: str, report: Tally, source: Source,
                         storage_options: dict | None) -> Counter[str]:
    """Keep the first sample of each key across tars (a key twice in one tar is caught while
    walking it); the others are counted ``duplicate_key`` and what they held taken out of the
    report's counts. The keys are never held whole: a 64-bit hash of each (8 bytes a sample,
    sorted once) finds the few candidates, whose keys are then compared themselves; the tables
    are rewritten a batch at a time where there are duplicates. Returns the samples dropped
    from each tar."""
    path = os.path.join(staging, SAMPLES_FILE)
    hashes = _key_hashes(path)
    ordered = np.sort(hashes)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    del ordered
    if not len(repeated):
        return Counter()
    candidates = np.flatnonzero(np.isin(hashes, repeated))
    first: dict[str, tuple[int, str]] = {}      # key -> the kept sample's position and tar
    keep = np.ones(len(hashes), bool)
    for position, (key, shard) in zip(candidates.tolist(), _keys_at(path, candidates)):
        if first.setdefault(key, (position, shard))[0] != position:
            keep[position] = False
    del hashes
    if keep.all():                  # hashes alike, keys not (one chance in ~10^19 a pair)
        return Counter()
    dropped = _keep_rows(path, keep, SAMPLES_SCHEMA)
    dropped_records = _keep_rows(os.path.join(staging, RECORDS_FILE), keep, record_table.SCHEMA)
    report.kept -= len(dropped)
    report.seen -= len(dropped)
    for name, number in _counts_of(dropped, dropped_records.column("json"), source,
                                   storage_options).items():
        report.count(name, -number)
    advice = ("where the tars number their samples each on their own (keys alike in every "
              "tar), index them with --keys-per-tar (each sample's key read as TAR/KEY); tars "
              "of separate downloads that number keys alike: index each alone and train on the "
              "indexes together, data.datasets: [A, B]")

    def skips() -> Iterator[tuple[str, str]]:
        """Each dropped sample's location and detail, read a batch at a time (tars that each
        number from 0 drop nearly all); the advice in the first few (report.json's) alone."""
        said = 0
        for batch in dropped.select(["shard", "key"]).to_batches():
            for shard, key in zip(*(column.to_pylist() for column in batch.columns)):
                detail = f"the key occurs in an earlier tar too ({first[key][1]}), whose " \
                    "sample is kept"
                yield f"{shard}:{key}", detail + (f": {advice}" if said < FIRST_LOCATIONS
                                                  else "")
                said += 1
    report.skip_many("duplicate_key", len(dropped), skips())
    return Counter(dropped.column("shard").to_pylist())


def _key_hashes(path: str) -> np.ndarray:
    """The 64-bit BLAKE2b hash of each key of the samples table ``path``, read a batch at a
    time (hand-written: Arrow has no hash kernel that pyarrow exposes)."""
    hashes = np.empty(pq.ParquetFile(path).metadata.num_rows, np.uint64)
    at = 0
    for batch in parquet_batches(path, ["key"]):
        keys = batch.column(0).to_pylist()
        hashes[at:at + len(keys)] = [
            int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
            for key in keys]
        at += len(keys)
    return hashes


def _keys_at(path: str, positions: np.ndarray) -> list[tuple[str, str]]:
    """The keys and tars of the samples table ``path`` at the sorted ``positions`` (few)."""
    found: list[tuple[str, str]] = []
    at = 0
    for batch in parquet_batches(path, ["key", "shard"]):
        inside = pa.array(positions[(positions >= at) & (positions < at + batch.num_rows)] - at)
        found += zip(batch.column(0).take(inside).to_pylist(),
                     batch.column(1).take(inside).to_pylist())
        at += batch.num_rows
    return found


def _keep_rows(path: str, keep: np.ndarray, schema: pa.Schema) -> pa.Table:
    """Rewrite the Parquet file ``path`` with its rows where ``keep`` is set, a batch at a
    time; return the others (few: the duplicates)."""
    dropped, at = [], 0
    with pq.ParquetWriter(f"{path}.kept", schema) as writer:
        for batch in parquet_batches(path):
            mask = pa.array(keep[at:at + batch.num_rows])
            at += batch.num_rows
            writer.write_batch(batch.filter(mask))
            dropped.append(batch.filter(pc.invert(mask)))
    os.replace(f"{path}.kept", path)
    return pa.Table.from_batches(dropped, schema)


def _counts_of(dropped: pa.Table, records: pa.ChunkedArray, source: Source,
               storage_options: dict | None) -> Counter[str]:
    """What the ``dropped`` samples (with their ``records``) had added to the report's counts
    (``ShardResult.counts``): their rotated videos, from the records, and what ``synthesize``
    counts, of their members read again from the tars (duplicates are few)."""
    counts: Counter[str] = Counter()
    remote = storage.Remote(source.root, storage_options) \
        if storage.is_remote(source.root) else None        # one client for all the reads
    for row, record in zip(dropped.select(["key", "shard", "members"]).to_pylist(),
                           records.to_pylist()):
        location = storage.join(source.root, row["shard"])
        data = {m["name"]: _read(remote, location, m["offset"], m["size"])
                for m in row["members"]}
        counts.update(synthesize(data, source.mapping, row["key"]).counts)
        counts[VIDEOS_ROTATED] += sum(1 for item in json.loads(record)["media"]
                                      if item.get("rotation"))
    return counts


def _read(remote: storage.Remote | None, location: str, offset: int, size: int) -> bytes:
    """``size`` bytes at ``offset`` of the tar at ``location`` (a URL read through
    ``remote``, else a path)."""
    if remote is not None:
        return remote.read_range(location, offset, size)
    with open(storage.local_path(location), "rb") as tar:
        return os.pread(tar.fileno(), size, offset)


def index(sources: list[str], output: str | None, options: IndexOptions,
          storage_options: dict | None = None) -> dict:
    """Index the tars of ``sources`` into ``output`` (None: ``cache.index_folder``); return the
    index. Raises IndexInputError (nothing is left behind then: no index.json). Where it keeps
    no sample it leaves its report alone, as a build does: no dataset, and its output takes the
    next indexing as is."""
    if options.workers < 0:
        raise IndexInputError("--workers must be at least 0")
    if options.layout not in ("auto", "energon", *LAYOUTS):
        raise IndexInputError(f"--layout {options.layout}: use auto, pairs, conversation, "
                              "documents or energon")
    if output is None:
        output_given_as_source(sources, storage_options)
    elif storage.is_remote(output):           # before it is made absolute: ./s3:/bucket
        raise IndexInputError(f"--output {output}: the index goes to a local directory (the "
                              "tars may be at a URL); copy the finished index into the bucket "
                              "to train from it there")
    source = resolve(sources, options, storage_options)
    if storage.is_remote(source.root):    # an index read in place is read by ranges: one tried
        try:
            storage.Remote(source.root, storage_options).check_ranges(
                storage.join(source.root, source.shards[0]))
        except storage.RangesIgnored as error:
            raise IndexInputError(str(error)) from None
    given = output is not None
    if output is None:
        output = cache.index_folder(sources, storage_options)
        say(f"no --output: the index goes to {output}")
    output = os.path.abspath(storage.local_path(output))
    named = _named(output, given)
    if not storage.is_remote(source.root) and \
            os.path.commonpath([output, source.root]) == source.root:
        raise IndexInputError(f"{named} lies inside the shards' folder {source.root}: "
                              "nothing is written beside the shards; choose another directory")
    with swap.output_folder(output, named, IndexInputError), \
            claim.held(output, "mimo-shard index"):
        return _index_claimed(source, output, named, options, storage_options)


def _settings(source: Source, options: IndexOptions) -> dict[str, Any]:
    """How an indexing reads its tars, as its index.json's ``build`` records it: the members
    of each sample and the options that change what is indexed."""
    return {"members": asdict(source.mapping),
            **{k: v for k, v in asdict(options).items()
               if k not in ("progress", "workers", "overwrite", "name")}}


def _changed(output: str, source: Source, options: IndexOptions,
             storage_options: dict | None) -> str:
    """What an index already in ``output`` is, said against the tars of ``source`` read with
    ``options``, and what to do."""
    try:
        with open(os.path.join(output, INDEX_FILE)) as f:
            old = json.load(f)
        held = {shard["name"] for shard in old["shards"]}
        root = old["shard_root"]
        built = old["build"]
    except (OSError, ValueError, KeyError, TypeError):
        return "; pass --overwrite to index again, or give another --output"
    again = "pass --overwrite to index them again, or give another --output"
    if root != source.root:
        return f" of other tars (those at {root}); {again}"
    added, gone = sorted(set(source.shards) - held), sorted(held - set(source.shards))
    now = _settings(source, options)
    members = now.pop("members")
    # the options given, else the members found (the same options on changed tars); an
    # option an older index does not record was its default then; --strict changes nothing
    # where the indexing skipped nothing
    defaults = _settings(source, IndexOptions())
    then = {key: built.get(key, defaults[key]) for key in now}
    if not (old.get("report") or {}).get("records_skipped"):
        then["strict"] = now["strict"]
    differ = [f"{key} {then[key]!r} then, {value!r} now" for key, value in now.items()
              if then[key] != value] or [
        f"member {key} {value!r} then, {members[key]!r} now"
        for key, value in (built.get("members") or {}).items()
        if key in members and value != members[key]]
    if not added and not gone and differ:
        return (f" of these tars read another way ({'; '.join(differ)}); {again}")
    if not added and not gone:
        remote = storage.Remote(source.root, storage_options) \
            if storage.is_remote(source.root) else None
        found = storage.look_up(source.root, source.shards, remote)
        rewritten = storage.rewritten(old["shards"], found)
        if rewritten:
            were = "1 was" if len(rewritten) == 1 else f"{len(rewritten)} of them were"
            resized = [shard["name"] for shard in old["shards"] if shard["name"] in rewritten
                       and found[shard["name"]][0] not in (None, shard.get("bytes"))]
            return (f" of these tars, but {were} written again since "
                    f"({', '.join(rewritten[:3])}{' ...' * (len(rewritten) > 3)}): " + (
                        f"{len(resized)} of another size, which a run refuses the index for"
                        if resized else "their text may differ from the index's, which a run "
                        "checks at start-up") + f"; {again}")
        return f" of these tars, read the same way; train from it as it is, {again}"
    changes = [f"{how} {len(names)} tar(s) {which} ({', '.join(names[:3])}"
               f"{' ...' * (len(names) > 3)})"
               for names, how, which in ((added, "have", "it lacks"), (gone, "lack", "it holds"))
               if names]
    return f" of other tars: the sources now {' and '.join(changes)}; {again}"


def _index_claimed(source: Source, output: str, named: str, options: IndexOptions,
                   storage_options: dict | None) -> dict:
    old = _prepare_output(output, named, options, source, storage_options)

    def written(staging: str) -> tuple[dict, tuple]:
        built, summary, rate = _index_into(staging, source, options, storage_options)
        return built, (summary, rate)
    built, (summary, rate), report = swap.write_in_place(output, named, old, IndexInputError,
                                                         written)
    see = swap.see_report(report, built)
    if old and not built["totals"]["samples"]:
        see += f"; the index at {output} is as it was"
    say(f"{summary} in {len(built['shards'])} tar(s) at {source.root} → {output}{see}")
    say(rate)
    return built


def _index_into(staging: str, source: Source, options: IndexOptions,
                storage_options: dict | None) -> tuple[dict, str, str]:
    """Write the dataset's files into ``staging``; return its index (not written), the summary
    line and the throughput line."""
    jobs = [_Job(source.root, name, source.mapping, options.check, options.max_image_pixels,
                 storage_options, energon.excluded_keys(name, source.sample_excludes),
                 source.detected_from, options.keys_per_tar)
            for name in source.shards]
    # every skip in full beside the report (which names the first few of each reason)
    with open(os.path.join(staging, SKIPPED_FILE), "w", encoding="utf-8") as every_skip:
        report = Tally("records_read", "samples_written", "records_skipped",
                       "members_ignored", every_skip)
        tables = _Tables(staging)
        shards: list[dict[str, Any]] = []
        busy, read = 0.0, 0
        progress = tqdm(total=len(jobs), unit="tar", desc="index", disable=not options.progress,
                        file=sys.stderr)
        walked: dict[str, int] = {}       # samples each tar holds
        for result in _results(jobs, options.workers):
            progress.update()
            walked[result.name] = result.samples
            tables.add(result)
            report.keep(len(result.rows))
            for name, number in result.counts.items():
                report.count(name, number)
            if options.strict and result.skips:
                _stop_strict(*result.skips[0])
            for reason, where, detail in result.skips:
                report.skip(reason, where, detail)
            for reason, where, detail in result.members_aside:
                report.set_aside(reason, where, detail)
            shards.append({"name": result.name, "samples": len(result.rows),
                           "bytes": result.walked.bytes, "sha256": result.walked.sha256,
                           **({"version": result.version} if result.version else {})})
            busy += result.seconds
            read += result.walked.bytes
        progress.close()
        _check_counts(source, walked)
        tables.close()
        dropped = _drop_duplicate_keys(staging, report, source, storage_options)
        if options.strict and dropped:
            first = report.skipped["duplicate_key"]["first"][0]
            _stop_strict("duplicate_key", first["location"], first["detail"])
    for shard in shards:                                    # duplicates across tars dropped
        shard["samples"] -= dropped[shard["name"]]
    write_atomic(os.path.join(staging, REPORT_FILE), dumps(report.to_dict()))
    built: dict[str, Any] = {
        "format": FORMAT_NAME, "version": INDEXED_VERSION,
        "name": options.name or storage.name_of(source.root),
        "shard_root": source.root,
        **index_fields(staging, shards, report, (SAMPLES_FILE, RECORDS_FILE, REPORT_FILE)),
        "build": {"command": "index", "inputs": list(source.given or [source.root]),
                  **_settings(source, options)},
    }
    # the split.yaml's own excludes among the skipped (mimo-inspect report's skipped_records
    # counts them apart, report.json read or not)
    if SPLIT_EXCLUDED in report.skipped:
        built["report"]["records_excluded"] = report.skipped[SPLIT_EXCLUDED]["count"]
    if report.aside:
        built["report"]["members_ignored"] = sum(e["count"] for e in report.aside.values())
    cache_folder, key = sample_table.write_cache(built, staging)
    record_table.write(os.path.join(staging, RECORDS_FILE), cache_folder, key)
    workers = max(options.workers, 1)
    rate = (f"{report.seen} records, {size_text(read)} read in {busy:.2f} worker-seconds: "
            f"{report.seen / busy if busy else 0:.0f} records/s and "
            f"{size_text(read / busy if busy else 0)}/s per worker ({workers} worker(s))")
    return built, report.summary(), rate
