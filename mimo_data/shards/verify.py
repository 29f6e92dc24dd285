"""`mimo-shard verify`: re-read every shard and check it against the index and sample table.

A remote dataset's files are downloaded one at a time to a temporary local copy and checked
there (one request per file). A dataset indexed in place (``mimo-shard index``) is checked where
its tars are (its ``shard_root``), against its records (``records.parquet``); the tars' samples
that indexing left out (counted in its report) are passed over.

Checks each file's size and sha256, every member's key, name, byte offset, size and crc32
against ``samples.parquet``, and decodes every media item fully, comparing it with its JSON
metadata.
Each tar is read once (``tar_walk.walk``: ``tarfile`` over a reader that hashes what passes, its
sha256 with its members), because webdataset's iterators do not expose member offsets.
A shard whose size or sha256 differs is walked too, to name the sample and member at fault
(``shard NAME: sample KEY member KEY.img0.jpg: ...``): one whose crc32 differs, that no longer
decodes, sits elsewhere than the table says or disagrees with the JSON. (A dataset built before
members had a crc32 has only the decoding to go by.) The sample table is read a shard at a
time (build and index write each shard's rows together), so memory does not grow with it.
"""

from __future__ import annotations

import itertools
import json
import os
import tarfile
from collections import defaultdict
from collections.abc import Iterator

import pyarrow.compute as pc
import pyarrow.parquet as pq
from tqdm import tqdm

from mimo_data.errors import listed
from mimo_data.modalities import MODALITIES, MediaError
from mimo_data.shards import storage
from mimo_data.shards.format import INDEX_FILE, SAMPLES_FILE
from mimo_data.files import file_sha256, parquet_batches
from mimo_data.shards.format import RECORDS_FILE
from mimo_data.worker_pool import ordered_map
from mimo_data.shards.index import index_bytes, parse_index, remake, shard_root
from mimo_data.shards.tar_walk import NotATarError, Sample, Walked, walk

MAX_PROBLEMS_PER_SHARD = 20


def _check_file(path: str, name: str, expected: dict, sha256: str | None = None,
                since: str = "the build") -> list[str]:
    """Problems of the local file (or local copy) at ``path``, named ``name`` (as the index
    names it); ``sha256``: its digest where a walk of it has it already; ``since``: what made
    the index (the build, or the tars' indexing in place)."""
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return [f"{name}: {size} bytes, the index says {expected['bytes']}"]
    if (sha256 or file_sha256(path)) != expected["sha256"]:
        return [f"{name}: sha256 differs from the index (the file changed after {since})"]
    return []


def _check_media(where: str, item: dict, data: bytes) -> list[str]:
    modality = MODALITIES[item["modality"]]
    keys = modality.verified_fields
    try:
        found = modality.decoded_metadata(data)
    except (MediaError, OSError, ValueError, SyntaxError) as exc:
        return [f"{where} member {_member(where, item)}: does not decode: {exc}"]
    return [f"{where} member {_member(where, item)}: {key} is {found[key]!r}, the JSON says "
            f"{item[key]!r}" for key in keys if found[key] != item.get(key)]


def _member(where: str, item: dict) -> str:
    """``KEY.img0.jpg`` of a media item, from ``where`` (``shard NAME: sample KEY``)."""
    return f"{where.rpartition(' ')[2]}.{item['member']}"


def verify_shard(directory: str, shard: dict, rows: list[dict],
                 records: list[dict] | None = None, keys_per_tar: bool = False) -> list[str]:
    """Problems found in one shard (empty list: the shard is intact); ``records``: the
    shard's records of a dataset indexed in place, ``directory`` its shard root
    (``keys_per_tar``: indexed with its samples' keys as TAR/KEY)."""
    location = storage.join(directory, shard["name"])
    if not storage.exists(location):
        return [f"{shard['name']}: missing, not at {location}" + (
            "" if records is None else ", where the index says the tars are (moved? index "
            "them again where they are now with `mimo-shard index`)")]
    with storage.local_copy(location) as path:
        walked = Walked()       # the walk reads the file once: its sha256 too, if it ends
        try:
            located = _walk_built(path, shard, rows, walked) if records is None else \
                _walk_indexed(path, shard, rows, records, walked, keys_per_tar)
        except (tarfile.TarError, OSError, EOFError, NotATarError) as exc:
            located = [f"shard {shard['name']}: the tar cannot be read: {exc}"]
        problems = _check_file(path, shard["name"], shard, walked.sha256 or None,
                               "the build" if records is None else "its indexing")
        grown = os.path.getsize(path) - shard["bytes"]
    if problems and not located and grown > 0:       # members appended (tar rf) since
        problems = [f"{shard['name']}: {grown:,} bytes longer than the index says "
                    f"({shard['bytes']:,}): written to after it was " + (
                        "indexed (samples appended?), which the index does not hold; its "
                        "indexed samples' members sit where it says, match their crc32 and "
                        "decode: index the tars again "
                        "(`mimo-shard index ... --overwrite`) to take in what was added"
                        if records is not None else
                        "built; its samples' members sit where the index says, match their crc32 "
                        "(where recorded) and decode, but a build's shard is not written "
                        "to: build the dataset again")]
    elif problems and not located:
        problems.append(f"shard {shard['name']}: every member sits where {SAMPLES_FILE} says, "
                        "matches its crc32 (where recorded) and decodes: the changed bytes are "
                        "in tar headers or padding, or in media without a recorded crc32")
    return problems + located


def _walk_built(path: str, shard: dict, rows: list[dict], walked: Walked) -> list[str]:
    """Problems of the members of one built shard, each naming its sample and member."""
    problems: list[str] = []
    expected = iter(rows)
    samples = 0
    with open(path, "rb") as tar:
        for sample in walk(tar, walked, shard["name"]):
            samples += 1
            row = next(expected, None)
            if row is None or row["key"] != sample.key:
                problems.append(f"shard {shard['name']}: sample {sample.key} found where the "
                                f"table expects {row and row['key']}")
                return problems
            problems += _placed(f"shard {shard['name']}: sample {sample.key}", sample, row)
            problems += [f"shard {shard['name']}: member {name} repeats a suffix of its sample"
                         for name in sample.duplicates]
            problems += _check_sample(shard["name"], sample.key, row,
                                      {suffix: m.data for suffix, m in sample.members.items()})
            if len(problems) >= MAX_PROBLEMS_PER_SHARD:
                return problems
    if walked.truncated:            # a tar mimo wrote is whole (one indexed in place may not be)
        return problems + [f"shard {shard['name']}: the tar cannot be read: {walked.truncated}"]
    problems += [f"shard {shard['name']}: member {name} belongs to no sample (no suffix)"
                 for name in walked.stray]
    problems += [f"shard {shard['name']}: member {name} is {link}, not a file"
                 for name, link in walked.links]
    problems += [f"shard {shard['name']}: member {name} is no file (a folder?)"
                 for name in walked.others]
    if samples != shard["samples"] or samples != len(rows):
        problems.append(f"shard {shard['name']}: {samples} samples, the index says "
                        f"{shard['samples']} and the table {len(rows)}")
    return problems


def _placed(where: str, sample: Sample, row: dict) -> list[str]:
    """Problems of ``sample``'s members (``where``: its shard and key) against its row of the
    sample table: each where the row says, with the row's crc32 (where recorded)."""
    placed = {m["name"]: m for m in row["members"]}
    problems = []
    for suffix, member in sample.members.items():
        record = placed.get(suffix)
        named = f"{where} member {sample.key}.{suffix}"
        if record is None or (record["offset"], record["size"]) != (member.offset, member.size):
            problems.append(f"{named}: at offset {member.offset} size {member.size}, the table "
                            f"says {record}")
        elif record.get("crc32") is not None and member.crc32 != record["crc32"]:
            problems.append(f"{named}: its bytes changed (crc32 differs from {SAMPLES_FILE})")
    return problems


def _walk_indexed(path: str, shard: dict, rows: list[dict], records: list[dict],
                  walked: Walked, keys_per_tar: bool) -> list[str]:
    """``_walk_built`` for a tar indexed in place: its indexed samples' members where the
    table says, with their crc32, and their media decoding as their records say."""
    expected = {row["key"]: (row, record) for row, record in zip(rows, records)}
    prefix = f"{shard['name']}/" if keys_per_tar else ""
    problems: list[str] = []
    with open(path, "rb") as tar:
        for sample in walk(tar, walked, shard["name"]):
            # left out by the indexing (its report counts it): a run of members repeating a
            # suffix always, though a later run of its key is kept
            if sample.duplicates or prefix + sample.key not in expected:
                continue
            row, record = expected.pop(prefix + sample.key)
            where = f"shard {shard['name']}: sample {sample.key}"
            table = [m["name"] for m in row["members"]]
            if table != list(sample.members):
                problems.append(f"{where}: members {listed(sample.members)}, the table lists "
                                f"{listed(table)}")
                continue
            problems += _placed(where, sample, row)
            for item in record["media"]:
                problems += _check_media(where, item, sample.members[item["member"]].data)
            if len(problems) >= MAX_PROBLEMS_PER_SHARD:
                return problems
    problems += [f"shard {shard['name']}: sample {key} is not in the tar" for key in expected]
    return problems


def _check_sample(shard_name, key, row, members) -> list[str]:
    where = f"shard {shard_name}: sample {key}"
    if set(members) != {m["name"] for m in row["members"]}:
        return [f"{where}: members {listed(sorted(members))}, the table lists "
                f"{listed(sorted(m['name'] for m in row['members']))}"]
    try:
        sample = json.loads(members["json"])
    except (KeyError, ValueError) as exc:
        return [f"{where} member {key}.json: unreadable JSON ({exc})"]
    problems = ([] if sample.get("key") == key else
                [f"{where} member {key}.json: JSON key is {sample.get('key')!r}"])
    for item in sample.get("media", []):
        if item["member"] not in members:
            problems.append(f"{where}: JSON lists {item['member']} but the tar has no such member")
        else:
            problems += _check_media(where, item, members[item["member"]])
    return problems


def _verify_one(args):
    return verify_shard(*args)


def _unlisted_shards(index: dict, shard_of_row) -> list[str]:
    """A problem where samples.parquet's rows (``shard_of_row``: their shards) name a shard
    index.json does not list: its size and hash would go unchecked while readers read it."""
    listed = {shard["name"] for shard in index["shards"]}
    unlisted = sorted(set(pc.unique(shard_of_row).to_pylist()) - listed)
    if not unlisted:
        return []
    return [f"{SAMPLES_FILE} has samples in {len(unlisted)} shard(s) that {INDEX_FILE} does "
            f"not list ({', '.join(unlisted[:3])}{', ...' if len(unlisted) > 3 else ''}): "
            f"{INDEX_FILE} was edited or is another dataset's; restore it, or {remake(index)}"]


def _shard_rows(table, shard_of_row, directory: str, index: dict
                ) -> Iterator[tuple[dict, list, list | None]]:
    """Each shard of the index with its rows of samples.parquet (``table``, whose rows'
    shards are ``shard_of_row``) and (indexed in place) its records, read a batch at a time
    where the table holds each shard's rows together and in the index's order (as build and
    index write it): a shard's rows in memory, not the table's. Otherwise the whole table is
    grouped at once."""
    records_file = storage.join(directory, RECORDS_FILE) \
        if RECORDS_FILE in index["files"] else None
    names = [shard["name"] for shard in index["shards"]]
    runs = pc.run_end_encode(shard_of_row.combine_chunks())
    ran = runs.values.to_pylist()                  # one per run of rows: per shard
    order = {name: at for at, name in enumerate(names)}
    if any(name not in order for name in ran) or any(
            order[a] >= order[b] for a, b in zip(ran, ran[1:])):
        yield from _grouped_at_once(table, records_file, index)
        return
    rows = _rows(table)
    records = None if records_file is None else (
        json.loads(raw) for raw in _rows(storage.readable(records_file), column="json"))
    ends = iter(runs.run_ends.to_pylist())
    held = dict.fromkeys(ran)
    start = 0
    for shard in index["shards"]:
        if shard["name"] not in held:
            yield shard, [], None if records is None else []
            continue
        end = next(ends)
        count = end - start
        start = end
        yield (shard, list(itertools.islice(rows, count)),
               None if records is None else list(itertools.islice(records, count)))


def _rows(table, column: str | None = None) -> Iterator:
    """The rows (dicts), or one column's values, of a Parquet file (what ``storage.readable``
    gives), a batch at a time."""
    for batch in parquet_batches(table, None if column is None else [column], 1024):
        yield from (batch.column(0).to_pylist() if column else batch.to_pylist())


def _grouped_at_once(table, records_file: str | None, index: dict):
    """``_shard_rows`` for a table whose shards' rows are not together: grouped in memory."""
    rows_by_shard = defaultdict(list)
    for row in pq.read_table(table).to_pylist():
        rows_by_shard[row["shard"]].append(row)
    records_by_shard: dict[str, list[dict]] | None = None
    if records_file is not None:
        records_by_shard = defaultdict(list)
        jsons = pq.read_table(storage.readable(records_file))
        for record in jsons.column("json").to_pylist():
            decoded = json.loads(record)
            records_by_shard[decoded["source"]["file"]].append(decoded)
    for shard in index["shards"]:
        yield (shard, rows_by_shard.get(shard["name"], []),
               None if records_by_shard is None else records_by_shard.get(shard["name"], []))


def verify(directory: str, workers: int = 1, progress: bool = True) -> list[str]:
    """All problems found in the dataset at ``directory`` (empty list: it verifies)."""
    # not read_index: its own files missing are problems listed here, beside those changed
    index = parse_index(directory, index_bytes(directory))
    problems = []
    for name, expected in index["files"].items():
        location = storage.join(directory, name)
        if not storage.exists(location):
            problems.append(f"{name}: missing, not at {location}: restore it, or "
                            f"{remake(index)}")
            continue
        with storage.local_copy(location) as path:
            problems += _check_file(path, name, expected)
    if problems:
        return problems
    table = storage.readable(storage.join(directory, SAMPLES_FILE))  # a remote one read once
    shard_of_row = pq.read_table(table, columns=["shard"]).column("shard")
    problems += _unlisted_shards(index, shard_of_row)
    root = shard_root(directory, index)
    per_tar = bool(index.get("build", {}).get("keys_per_tar"))
    jobs = ((root, shard, rows, records, per_tar)
            for shard, rows, records in _shard_rows(table, shard_of_row, directory, index))
    bar = tqdm(total=len(index["shards"]), unit="shard", desc="verify", disable=not progress)
    # a few shards' rows in flight, not the table's
    pooled = ordered_map(_verify_one, jobs, workers, 2 * workers,
                         describe=lambda job: f"shard {job[1]['name']}",
                         advice="verify again with fewer --workers, or --workers 0 to verify in "
                         "this process and see the failure") if workers > 1 else None
    try:
        for shard_problems in pooled or map(_verify_one, jobs):
            problems += shard_problems
            bar.update()
    finally:        # an error or Ctrl-C here stops the workers now, not at the exit's wait
        if pooled is not None:
            pooled.close()
    bar.close()
    return problems
