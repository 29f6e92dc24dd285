"""How a build's or an indexing's files take the place of what its output held.

A new run's files are written beside an old dataset (``.staging``), which stays whole until
the run is complete: then its index is removed first (from then on it no longer looks
complete), then its other files (those it had when the run began, nothing else), the new
files are moved in (the report last) and the caller writes the new index. A run that fails
or is killed before that leaves the old dataset as it was; one killed during the swap (local
renames; in a bucket a copy of each shard on the store's side) leaves no index, which the
next run cleans up. A run that keeps no sample makes no dataset: an old one stays, the run's
report and skipped list beside it as ``report.failed.json`` and ``skipped.failed.jsonl``;
without an old one they are the output's ``report.json`` and ``skipped.jsonl``. An output
without a complete dataset (no index) holds nothing worth keeping: it is emptied before the
run, which needs no room for two datasets then. The callers have checked that the output
holds only their files.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from mimo_data.files import write_atomic
from mimo_data.stats import size_text
from mimo_data.shards import storage
from mimo_data.shards.format import (CLAIM_FILE, FAILED_REPORT_FILE, FAILED_SKIPPED_FILE,
                                     INDEX_FILE, REPORT_FILE, SKIPPED_FILE, STAGING_DIR)
from mimo_data.shards.index import dumps
from mimo_data.shards.stops import OutputFull

# objects moved or removed at once in a bucket's swap (each a request or a copy by the store)
_THREADS = 8


@contextmanager
def output_folder(folder: str, named: str, refused: Callable[[str], Exception]
                  ) -> Iterator[None]:
    """The local output ``folder`` (``named`` so in messages), made where it is missing, and
    removed again where the run leaves it empty (refused, failed or stopped in the folder it
    made); ``refused(message)``: the caller's error for a folder that cannot be one."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise refused(f"{named} exists and is not a directory")
    try:
        os.makedirs(folder)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:      # a file where a parent folder should be, no permission
        raise refused(f"cannot create {named}: {exc}") from None
    try:
        yield
    finally:
        if created and os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def clear_folder(folder: str) -> list[str]:
    """Remove what earlier runs left in ``folder`` but a complete dataset; return that
    dataset's names ([]: none), which stay until :func:`into_folder` replaces them. The
    run's own claim stays."""
    names = [name for name in os.listdir(folder) if name != CLAIM_FILE]
    complete = INDEX_FILE in names
    for name in names:
        if not complete or _leftover(name):
            _remove(os.path.join(folder, name))
    return sorted(name for name in names if complete and not _leftover(name))


def staging_in(folder: str) -> str:
    """Make ``folder``'s staging folder (``clear_folder`` removed any earlier one); OSError:
    the folder takes no writes."""
    staging = os.path.join(folder, STAGING_DIR)
    os.mkdir(staging)
    return staging


def write_in_place(folder: str, named: str, old: list[str],
                   refused: Callable[[str], Exception],
                   write: Callable[[str], tuple[dict, Any]]) -> tuple[dict, Any, str]:
    """A local run: ``write(staging)`` writes its files into a staging folder of ``folder``
    (``named`` so in messages) and returns its index and whatever else the caller keeps;
    they then take the place of the ``old`` dataset's files (:func:`into_folder`) and the
    index is written last (none where no sample was kept). Returns the index, the rest and
    the report's path. A failed run's files are removed; a full disk is ``OutputFull``;
    ``refused(message)``: the caller's error for a folder that takes no writes."""
    try:
        staging = staging_in(folder)
    except OSError as exc:      # a read-only folder, no permission
        raise refused(f"cannot write into {named}: {exc}") from None
    try:
        index, rest = write(staging)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            raise OutputFull(no_room(exc, folder, old)) from None
        raise
    report = into_folder(folder, staging, index["totals"]["samples"], old)
    if index["totals"]["samples"]:
        write_atomic(os.path.join(folder, INDEX_FILE), dumps(index))
    return index, rest, report


def into_folder(folder: str, staging: str, samples: int, old: list[str]) -> str:
    """Move a finished run's files from ``staging`` (inside ``folder``) into the place of the
    ``old`` dataset's, having written ``samples``; return the path of its report. The caller
    writes the index after."""
    if not samples:                 # the report and the skipped list alone
        for name, kept in _kept_none(bool(old)):
            os.replace(os.path.join(staging, name), os.path.join(folder, kept))
        shutil.rmtree(staging)
        return os.path.join(folder, _report_name(bool(old)))
    for name in _index_first(old):
        _remove(os.path.join(folder, name))
    for name in _report_last(os.listdir(staging)):
        if os.path.isdir(os.path.join(folder, name)):   # a cache a reader made meanwhile
            shutil.rmtree(os.path.join(folder, name))
        os.replace(os.path.join(staging, name), os.path.join(folder, name))
    os.rmdir(staging)
    return os.path.join(folder, REPORT_FILE)


def see_report(report: str, index: dict) -> str:
    """What a run's summary line says of its ``report`` (the path or URL ``into_folder`` or
    ``into_prefix`` gave) where it skipped records or set members aside: the report, and
    beside it the list of every skipped record; "" where it did neither."""
    built = index["report"]
    if not built["records_skipped"] and not built.get("members_ignored"):
        return ""
    listed = FAILED_SKIPPED_FILE if report.endswith(FAILED_REPORT_FILE) else SKIPPED_FILE
    every = f"; {listed} beside it lists every skipped record" if built["records_skipped"] \
        else ""
    return f" (see {report}{every})"


def clear_prefix(remote: storage.Remote, output: str, names: list[str]) -> list[str]:
    """:func:`clear_folder` for an output URL whose objects are ``names``; a run that keeps
    an old dataset uploads its shards under :func:`staged` until :func:`into_prefix`."""
    names = [name for name in names if name != CLAIM_FILE]
    complete = INDEX_FILE in names
    for name in names:
        if not complete or _leftover(name):
            remote.remove(storage.join(output, name), recursive=True)
    return sorted(name for name in names if complete and not _leftover(name))


def staged(output: str) -> str:
    """Where a run replacing the dataset at ``output`` uploads its shards."""
    return storage.join(output, STAGING_DIR)


def into_prefix(remote: storage.Remote, output: str, local: str, index: dict,
                old: list[str]) -> str:
    """:func:`into_folder` for an output URL: the shards of ``index`` already uploaded (under
    :func:`staged` where there is an ``old`` dataset), the other files in the local folder
    ``local``; return the report's URL. StorageError naming what is left where the swap
    fails."""
    if not index["totals"]["samples"]:
        remote.remove(staged(output), recursive=True)
        for name, kept in _kept_none(bool(old)):
            remote.put(os.path.join(local, name), storage.join(output, kept))
        return storage.join(output, _report_name(bool(old)))
    if old:
        try:
            remote.remove(storage.join(output, INDEX_FILE))
            with ThreadPoolExecutor(_THREADS) as pool:
                list(pool.map(lambda name: remote.remove(storage.join(output, name),
                                                         recursive=True),
                              [name for name in old if name != INDEX_FILE]))
                list(pool.map(lambda name: remote.move(storage.join(staged(output), name),
                                                       storage.join(output, name)),
                              [shard["name"] for shard in index["shards"]]))
            remote.remove(staged(output), recursive=True)
        except OSError as exc:
            raise storage.StorageError(
                f"{exc}: while replacing the dataset at {output}, whose index was removed, "
                f"so neither it nor the new one is there (the new shards partly under "
                f"{staged(output)}); build again with --overwrite") from None
    files = [os.path.relpath(os.path.join(folder, name), local)
             for folder, _, names in os.walk(local) for name in names]
    for name in _report_last(files):
        remote.put(os.path.join(local, name), storage.join(output, name))
    return storage.join(output, REPORT_FILE)


NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def no_room(exc: OSError, output: str, old: list[str]) -> str:
    """What to say when writing a run's files into the folder ``output`` failed with
    ``exc``, one of ``NO_ROOM`` (the run's files removed by then)."""
    where = output
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)      # a folder the run made, removed again
    try:
        disk = os.statvfs(where)
        free = (f": {size_text(disk.f_bavail * disk.f_frsize)} and {disk.f_favail:,} files free "
                "there now")
    except OSError:
        free = ""
    return (f"no room left on the disk of --output {output} ({exc.strerror}, writing "
            f"{os.path.basename(str(exc.filename)) if exc.filename else 'its files'}){free}; "
            "the run's files are removed" +
            (", and the dataset there is as it was (--overwrite builds the new one beside "
             "it: room for both is needed)" if old else "") +
            "; free some space, or give an --output on a disk with room")




def _leftover(name: str) -> bool:
    """Whether ``name``, beside a complete dataset, was left by a failed or killed run."""
    return name in (STAGING_DIR, FAILED_REPORT_FILE, FAILED_SKIPPED_FILE) or \
        name.startswith(INDEX_FILE + ".tmp")


def _report_name(replacing: bool) -> str:
    return FAILED_REPORT_FILE if replacing else REPORT_FILE


def _kept_none(replacing: bool) -> list[tuple[str, str]]:
    """What a run that kept no sample leaves, as ``(its name in the run's files, the name it
    is given)``: its report and skipped list, beside an old dataset (``replacing``) under the
    names of a failed run's."""
    return [(REPORT_FILE, _report_name(replacing)),
            (SKIPPED_FILE, FAILED_SKIPPED_FILE if replacing else SKIPPED_FILE)]


def _index_first(names: list[str]) -> list[str]:
    return sorted(names, key=lambda name: name != INDEX_FILE)


def _report_last(names: list[str]) -> list[str]:
    """``names`` in order, the report last: an output with a report and no index is one
    whose run kept no sample (training start-up says so), not one whose swap was cut."""
    return sorted(names, key=lambda name: (name == REPORT_FILE, name))


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
