"""``index.json``: read it (the only proof a dataset is complete), and the canonical JSON it is
written in (``mimo_data.files.write_atomic`` writes it)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import IO, Any
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from mimo_data.shards import cache, storage
from mimo_data.shards.format import (CLAIM_FILE, FORMAT_NAME, INDEX_FILE, INDEXED_VERSION,
                                     READ_VERSIONS, REPORT_FILE, SAMPLES_FILE, SKIPPED_FILE,
                                     STAGING_DIR)
from mimo_data.shards.energon import META as ENERGON_META


class DatasetError(Exception):
    """A dataset directory that is missing (``missing``: nothing there, a usage error), or
    incomplete or not of our format."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing

    def __reduce__(self):           # rebuilt whole where a worker process raised it
        return type(self), (str(self), self.missing)


def read_samples[T](directory: str, read: Callable[[str | IO[bytes]], T]) -> T:
    """``read(path)`` of the dataset ``directory``'s samples.parquet; DatasetError naming it
    where it is no Parquet file."""
    path = storage.readable(storage.join(directory, SAMPLES_FILE))
    try:
        return read(path)
    except pa.ArrowInvalid as error:
        raise damaged_samples(storage.join(directory, SAMPLES_FILE), error) from None


def damaged_samples(path: str, error: Exception) -> DatasetError:
    """A dataset's samples.parquet at ``path`` that pyarrow could not read (``error``)."""
    directory = os.path.dirname(path.rstrip("/"))
    return DatasetError(f"{path} cannot be read ({error}): the dataset's copy is damaged or "
                        f"partial; `mimo-shard verify {directory}` names what differs from its "
                        "index: copy it again, or build it again")


def dumps(value) -> bytes:
    """Canonical JSON bytes (sorted keys, 2-space indent) so equal content is equal bytes."""
    return (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def read_index(directory: str, storage_options: dict | None = None) -> dict:
    """The index of a complete dataset (a local directory or a URL); DatasetError says what is
    wrong and what to do (``check_complete``)."""
    index = parse_index(directory, index_bytes(directory, storage_options))
    check_complete(directory, index, storage_options)
    return index


def check_complete(directory: str, index: dict, storage_options: dict | None = None) -> None:
    """DatasetError where a file of the dataset's own that ``index`` lists (samples.parquet
    ...) is not there: a stat each, or at a URL a HEAD each, at once (not a listing, which a
    prefix of many shards takes many requests for)."""
    own = list(index.get("files", {}))
    if storage.is_remote(directory):
        remote = storage.Remote(directory, storage_options)
        with ThreadPoolExecutor(max(1, len(own))) as pool:
            there = list(pool.map(lambda name: remote.exists(storage.join(directory, name)),
                                  own))
    else:
        there = [os.path.isfile(os.path.join(storage.local_path(directory), name))
                 for name in own]
    missing = [name for name, found in zip(own, there) if not found]
    if missing:
        raise DatasetError(f"{directory}: {', '.join(missing)} missing (the dataset is "
                           f"incomplete): restore it, or {remake(index)}; `mimo-shard "
                           f"verify {directory}` checks the rest")


def remake(index: dict) -> str:
    """What makes ``index``'s dataset again, in words: a build, or its tars indexed again."""
    return "index the tars again where they are now (`mimo-shard index`)" \
        if index.get("version") == INDEXED_VERSION else "rebuild the dataset"


def index_bytes(directory: str, storage_options: dict | None = None) -> bytes:
    """The bytes of ``directory``'s index.json (DatasetError when there is none)."""
    if storage.is_remote(directory):    # a URL's mistake said of the URL given, not its file
        storage.check_scheme(directory)
    energon = energon_dataset_of(directory)
    if energon is not None:
        raise DatasetError(energon_metadata_given(directory, energon), missing=True)
    if not storage.is_remote(directory) and os.path.isfile(storage.local_path(directory)):
        raise DatasetError(file_given_for_a_dataset(directory), missing=True)
    if not storage.is_remote(directory) and not os.path.isdir(storage.local_path(directory)):
        raise DatasetError(f"{directory}: no such directory (check the path: a dataset is the "
                           "folder `mimo-shard build` or `mimo-shard index` wrote)", missing=True)
    try:
        return storage.read_bytes(storage.join(directory, INDEX_FILE), storage_options)
    except FileNotFoundError:
        names = _names_at(directory, storage_options)
        if names == [] and storage.is_remote(directory):
            absent = storage.bucket_absence(directory, storage_options)
            raise DatasetError(f"{directory}: " + (
                "nothing there, no such dataset (check the prefix)" if absent is None else
                storage.bucket_missing(directory, storage_options, absent) +
                ": check the URL and the endpoint"),
                missing=True) from None
        if names is None and directory.startswith(("http://", "https://")):
            raise DatasetError(f"{directory}: no {INDEX_FILE} at "
                               f"{storage.join(directory, INDEX_FILE)}: check the URL (a web "
                               "server lists no folder, so nothing more can be said)",
                               missing=True) from None
        if names and _foreign_tars(names):
            raise DatasetError(f"{directory}: "
                               f"{unindexed_tars_advice(directory, storage_options)}") from None
        if names and REPORT_FILE in names and _kept_none(directory, storage_options):
            raise DatasetError(f"{directory}: no {INDEX_FILE}: the build or indexing that "
                               f"wrote it kept no sample; {storage.join(directory, REPORT_FILE)}"
                               " says why: fix the inputs (or the options) and run it again"
                               ) from None
        inputs = sorted(name for name in names or () if name.lower().endswith(_INPUTS)
                        and name not in (SAMPLES_FILE, REPORT_FILE, SKIPPED_FILE)  # a build's
                        and not name.startswith("."))                   # a tool's own
        if inputs and not {SAMPLES_FILE, REPORT_FILE, STAGING_DIR} & set(names or ()) and \
                not any(name.endswith(".tar") for name in names or ()):
            raise DatasetError(
                f"{directory}: no {INDEX_FILE} and no shards: a build's input ("
                f"{', '.join(inputs[:3])}{', ...' if len(inputs) > 3 else ''}), not a dataset; "
                f"`mimo-shard build {storage.join(directory, inputs[0])} --output DIR` makes "
                "one", missing=True) from None
        raise DatasetError(f"{directory}: no {INDEX_FILE}, so this is not a complete dataset "
                           "(an interrupted build or indexing?); run `mimo-shard build` (or "
                           "`mimo-shard index`) again") from None


def energon_dataset_of(directory: str) -> str | None:
    """The Energon dataset whose metadata folder (``.nv-meta``) ``directory`` is, if it is
    one."""
    path = directory.rstrip("/")
    if path.rsplit("/", 1)[-1] != ENERGON_META:
        return None
    return path.rsplit("/", 1)[0] if storage.is_remote(path) else \
        os.path.dirname(os.path.abspath(storage.local_path(path)))


def energon_metadata_given(directory: str, dataset: str) -> str:
    """What to give instead of an Energon dataset's metadata folder ``directory``."""
    return (f"{directory} is the metadata folder of the Energon dataset {dataset}, not a "
            f"dataset mimo reads: index that dataset where it is (`mimo-shard index {dataset} "
            "--output DIR`) and give DIR")


# the files a build reads records from (what a folder of them is: input, not a dataset)
_INPUTS = (".json", ".jsonl", ".parquet")


def file_given_for_a_dataset(path: str) -> str:
    """What a file given for a dataset's folder is, and what to give instead: a file of a
    dataset (its folder), a tar (its folder indexed), a build's input (built)."""
    folder = os.path.dirname(os.path.abspath(path))
    said = f"{path} is a file, not a dataset's folder ({INDEX_FILE} beside its tars)"
    if os.path.isfile(os.path.join(folder, INDEX_FILE)):
        return f"{said}: it is one of the dataset {folder}'s files; give that folder"
    if path.endswith(".tar"):
        return f"{said}: a folder of {unindexed_tars_advice(folder)}"
    if path.lower().endswith(_INPUTS):
        return f"{said}: a build's input becomes one with `mimo-shard build {path} --output DIR`"
    return f"{said}: give the folder a `mimo-shard build` or `mimo-shard index` wrote"


def _kept_none(directory: str, storage_options: dict | None) -> bool:
    """Whether ``directory``'s report is a run's that kept no sample (left alone there: no
    dataset), not one moved in by a run killed before it wrote the index."""
    try:
        report = json.loads(storage.read_bytes(storage.join(directory, REPORT_FILE),
                                               storage_options))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and report.get("samples_written") == 0


def _names_at(directory: str, storage_options: dict | None) -> list[str] | None:
    """The names directly under a dataset directory (none under a URL: a typo); None where
    not known: over HTTP, which lists nothing, or where the listing fails."""
    if directory.startswith(("http://", "https://")):
        return None
    try:
        if not storage.is_remote(directory):
            return os.listdir(storage.local_path(directory))
        return storage.Remote(directory, storage_options).names(directory)
    except OSError:                 # StorageError too: the first message stands
        return None


def unindexed_tars(directory: str, storage_options: dict | None = None) -> bool:
    """Whether ``directory`` holds tars and no index, nor a build's other files: a WebDataset
    made elsewhere (or a bucket build interrupted before its tables)."""
    names = _names_at(directory, storage_options)
    return names is not None and _foreign_tars(names)


def unindexed_tars_advice(directory: str, storage_options: dict | None = None) -> str:
    """What to do with ``unindexed_tars``: the index ``mimo-shard index`` made of them
    without ``--output`` where there is one, else how to make it."""
    made = cache.index_folder([directory], storage_options)
    if os.path.isfile(os.path.join(made, INDEX_FILE)):
        return (f"tars with no {INDEX_FILE}: `mimo-shard index {directory}` (no --output) "
                f"wrote their index to {made}: give that folder instead")
    # a folder inside an Energon dataset, which mimo-shard index refuses (local: no options;
    # imported here, on this error's path alone)
    from mimo_data.shards.tar_sources import energon_above
    folder = None if storage.is_remote(directory) else \
        os.path.abspath(storage.local_path(directory))      # ".", "sub/": the real folders
    above = energon_above([folder], None) if folder else None
    if above is not None and above != folder:
        return (f"tars with no {INDEX_FILE}, of the Energon dataset {above}: index that "
                f"dataset where it is (`mimo-shard index {above} --output DIR`) and give DIR")
    return (f"tars with no {INDEX_FILE}: tars made elsewhere (webdataset, img2dataset, "
            f"Energon) are indexed where they are with `mimo-shard index {directory} --output "
            "DIR`, then DIR is given; a `mimo-shard build` that wrote them was interrupted: "
            "run it again")


def _foreign_tars(names: list[str]) -> bool:
    """Whether ``names`` are tars (an Energon folder's too) without a mimo build's files, so
    not an interrupted build's."""
    return (any(name.endswith(".tar") or name == ".nv-meta" for name in names)
            and not {SAMPLES_FILE, "report.json", STAGING_DIR, CLAIM_FILE} & set(names))


def parse_index(directory: str, data: bytes) -> dict:
    """The index in ``data`` (``directory``'s index.json), checked to be of this format."""
    path = storage.join(directory, INDEX_FILE)
    try:
        index = json.loads(data)
    except ValueError as exc:
        raise DatasetError(f"{path}: unreadable index ({exc}); run `mimo-shard build` (or "
                           "`mimo-shard index`) again") from None
    if not isinstance(index, dict):
        raise DatasetError(f"{path}: holds a JSON {type(index).__name__}, not an index; run "
                           "`mimo-shard build` (or `mimo-shard index`) again")
    if index.get("format") != FORMAT_NAME or index.get("version") not in READ_VERSIONS:
        raise DatasetError(f"{path}: format {index.get('format')!r} version "
                           f"{index.get('version')!r}; this mimo reads {FORMAT_NAME!r} "
                           f"versions {', '.join(map(str, READ_VERSIONS))} (a newer mimo "
                           "wrote it?)")
    if index["version"] == INDEXED_VERSION and not isinstance(index.get("shard_root"), str):
        raise DatasetError(f"{path}: an index of shards indexed in place without its "
                           "shard_root; run `mimo-shard index` again")
    if problem := _shape_problem(index):
        raise DatasetError(f"{path}: {problem} (an edited or damaged index): restore it, or "
                           f"{remake(index)}")
    return index


def _shape_problem(index: dict) -> str | None:
    """The first value of ``index`` not of the type the readers take (each shard's and each
    own file's sizes and hashes, the totals and counts), or None."""
    def wrong(where: str, value: Any, kind: type | tuple[type, ...], said: str) -> str | None:
        if isinstance(value, kind) and not isinstance(value, bool) and \
                not (isinstance(value, int) and value < 0):
            return None
        return f"{where} is {value!r} ({type(value).__name__}), expected {said}"

    def found(where: str, entry: Any, fields: dict[str, tuple[type, str]]) -> str | None:
        if not isinstance(entry, dict):
            return wrong(where, entry, dict, "a mapping")
        return next((f"{where}.{name} is missing ({said})" if name not in entry else problem
                     for name, (kind, said) in fields.items()
                     if name not in entry or
                     (problem := wrong(f"{where}.{name}", entry[name], kind, said))), None)

    count, text = (int, "a whole number >= 0"), (str, "text")
    if (problem := wrong("shards", index.get("shards"), list, "a list of shards")) or \
            "totals" in index and (problem := found("totals", index["totals"],
                                                    {"samples": count})) or \
            (problem := wrong("modalities", index.get("modalities", {}), dict, "a mapping")) or \
            (problem := wrong("files", index.get("files", {}), dict, "a mapping")):
        return problem
    shard = {"name": text, "samples": count, "bytes": count, "sha256": text}
    return next((problem for where, entry, fields in (
        *((f"shards[{i}]", entry, shard) for i, entry in enumerate(index["shards"])),
        *((f"files[{name!r}]", entry, {"bytes": count, "sha256": text})
          for name, entry in index.get("files", {}).items()))
        if (problem := found(where, entry, fields))), None)


def shard_root(directory: str, index: dict) -> str:
    """Where ``directory``'s shards are: its ``shard_root`` (indexed in place), else itself."""
    return index.get("shard_root", directory)
