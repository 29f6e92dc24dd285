"""How a build's or an indexing's files take the place of what its output held.

A new run's files are written beside an old dataset (``.staging``), which stays whole until
the run is complete: its index is removed first (from then on it no longer looks complete),
then its other files, the new files are moved in, and the caller writes the new index last.
A run that fails or is killed leaves the old dataset as it was. A run that keeps no sample
makes no dataset: an old one stays, the run's report beside it as ``report.failed.json``;
without an old one the report is the output's ``report.json``. An output without a complete
dataset (no index) holds nothing worth keeping: it is emptied before the run, which needs no
room for two datasets then. The callers have checked that the output holds only their files.
"""

from __future__ import annotations

import errno
import os
import shutil

from mimo_data.shards import storage
from mimo_data.shards.format import FAILED_REPORT_FILE, INDEX_FILE, REPORT_FILE, STAGING_DIR


def clear_folder(folder: str) -> bool:
    """Remove what earlier runs left in ``folder`` but a complete dataset; return whether one
    stays (until :func:`into_folder` replaces it)."""
    names = os.listdir(folder)
    keeps = INDEX_FILE in names
    for name in names:
        if keeps and not _leftover(name):
            continue
        path = os.path.join(folder, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return keeps


def into_folder(folder: str, staging: str, samples: int) -> str:
    """Move a finished run's files from ``staging`` (inside ``folder``) into place, having
    written ``samples``; return the path of its report. The caller writes the index after."""
    if not samples:
        return _report_alone(staging, os.path.join(folder, _report_name(
            os.path.exists(os.path.join(folder, INDEX_FILE)))))
    old = [name for name in os.listdir(folder) if name != STAGING_DIR]
    if INDEX_FILE in old:
        os.remove(os.path.join(folder, INDEX_FILE))
    for name in old:
        path = os.path.join(folder, name)
        if name != INDEX_FILE:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    for name in sorted(os.listdir(staging)):
        os.replace(os.path.join(staging, name), os.path.join(folder, name))
    os.rmdir(staging)
    return os.path.join(folder, REPORT_FILE)


def clear_prefix(remote: storage.Remote, output: str, names: list[str]) -> bool:
    """:func:`clear_folder` for an output URL whose objects are ``names``; a run that keeps
    the old dataset uploads its shards under :func:`staged` until :func:`into_prefix`."""
    keeps = INDEX_FILE in names
    for name in names:
        if not keeps or _leftover(name):
            remote.remove(storage.join(output, name), recursive=True)
    return keeps


def staged(output: str) -> str:
    """Where a run replacing the dataset at ``output`` uploads its shards."""
    return storage.join(output, STAGING_DIR)


def into_prefix(remote: storage.Remote, output: str, local: str, samples: int,
                replacing: bool) -> str:
    """:func:`into_folder` for an output URL: the shards already uploaded (under
    :func:`staged` where ``replacing``), the other files in the local folder ``local``;
    return the report's URL. An object store moves an object by copying it (on the store's
    side) and removing the original: a replacing run's shards are copied once more here."""
    if not samples:
        remote.remove(staged(output), recursive=True)
        report = storage.join(output, _report_name(replacing))
        remote.put(os.path.join(local, REPORT_FILE), report)
        return report
    if replacing:
        remote.remove(storage.join(output, INDEX_FILE))
        for name in remote.names(output):
            if name not in (INDEX_FILE, STAGING_DIR):
                remote.remove(storage.join(output, name), recursive=True)
        for name in remote.names(staged(output)):
            remote.move(storage.join(staged(output), name), storage.join(output, name))
        remote.remove(staged(output), recursive=True)
    for folder, _, files in os.walk(local):
        for name in sorted(files):
            path = os.path.join(folder, name)
            remote.put(path, storage.join(output, os.path.relpath(path, local)))
    return storage.join(output, REPORT_FILE)


def staging_in(folder: str) -> str:
    """Make ``folder``'s staging folder (``clear_folder`` removed any earlier one); OSError:
    the folder takes no writes."""
    staging = os.path.join(folder, STAGING_DIR)
    os.mkdir(staging)
    return staging


NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def no_room(exc: OSError, output: str, replacing: bool) -> str:
    """What to say when writing a run's files failed with ``exc``, one of ``NO_ROOM`` (the
    run's files removed then)."""
    where = os.path.dirname(exc.filename) if isinstance(exc.filename, str) else output
    try:
        free = f"{shutil.disk_usage(where).free / 1e9:.1f} GB free there now, "
    except OSError:
        free = ""
    return (f"no room left writing {exc.filename or where} ({exc.strerror}; {free}the run's "
            "files removed): " + (f"the dataset at {output} is as it was (--overwrite builds "
                                  "the new one beside it: room for both is needed); "
                                  if replacing else "") +
            "free some space, or give an --output on a disk with room")


def _leftover(name: str) -> bool:
    """Whether ``name``, beside a complete dataset, was left by a failed or killed run."""
    return name in (STAGING_DIR, FAILED_REPORT_FILE) or name.startswith(INDEX_FILE + ".tmp")


def _report_name(replacing: bool) -> str:
    return FAILED_REPORT_FILE if replacing else REPORT_FILE


def _report_alone(staging: str, report: str) -> str:
    """A run that kept no sample: its report to ``report``, nothing else kept."""
    os.replace(os.path.join(staging, REPORT_FILE), report)
    shutil.rmtree(staging)
    return report
