"""A checkpoint's integrity manifest, with the hashing spread over the ranks.

The manifest is megatron-core's (``integrity.json``: ``{"algorithm": "sha256", "files":
{name: hex digest}}``), so its own ``verify_integrity_manifest`` reads ours. megatron-core has
rank 0 hash every file, at every save and every start: O(checkpoint) on one rank while the others
wait, growing with the model and not shrinking with the world. Here:

- at save, each rank hashes the files it wrote itself (``__<rank>_<n>.distcp``, torch_dist's
  per-rank files; in an asynchronous save, in its writer process: ``write_part``), and rank 0
  gathers the parts and hashes only its few small files (``write_manifest``);
- at load, the files are split into shares of about equal bytes, one per reading rank, and the
  ranks exchange their verdicts (``verify``): every rank raises the same error naming every
  damaged file.

Hand-written because neither megatron-core nor torch.distributed.checkpoint divides the hashing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time

from mimo_data.files import file_sha256, write_atomic
from mimo_train.checkpoint_folders import MANIFEST
from mimo_train.errors import IntegrityError

ALGORITHM = "sha256"
_PART = re.compile(r"^integrity\.(\d+)\.json$")              # one writing rank's digests
_WRITTEN_BY = re.compile(r"^__(\d+)_\d+\.distcp$")           # torch_dist: __<rank>_<thread>


def writer(name: str) -> int:
    """The rank that writes the checkpoint file ``name``: torch_dist's data files are named by
    their writer; every other file (index, metadata, meta.json) is rank 0's."""
    match = _WRITTEN_BY.match(name)
    return int(match[1]) if match else 0


def _checkpoint_files(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory)
                  if name != MANIFEST and not _PART.match(name)
                  and os.path.isfile(os.path.join(directory, name)))


def write_part(directory: str, rank: int) -> None:
    """Hash the data files ``rank`` wrote and store their digests for ``write_manifest``
    (``integrity.<rank>.json``): called by the process that wrote them, right after."""
    digests = {name: file_sha256(os.path.join(directory, name))
               for name in _checkpoint_files(directory)
               if _WRITTEN_BY.match(name) and writer(name) == rank}
    write_atomic(os.path.join(directory, f"integrity.{rank}.json"), json.dumps(digests).encode())


def write_manifest(directory: str) -> None:
    """Rank 0, once every rank's ``write_part`` is done: merge the parts, hash rank 0's other
    files, write the manifest and remove the parts. Raises IntegrityError when a data file has
    no digest (its writer's part is missing: the save did not finish)."""
    files: dict[str, str] = {}
    parts = [name for name in os.listdir(directory) if _PART.match(name)]
    for name in parts:
        with open(os.path.join(directory, name)) as f:
            files.update(json.load(f))
    for name in _checkpoint_files(directory):
        if not _WRITTEN_BY.match(name):
            files[name] = file_sha256(os.path.join(directory, name))
        elif name not in files:
            raise IntegrityError(f"{directory}: {name} has no digest from rank {writer(name)} "
                                 "(its writer did not finish)")
    missing = sorted(set(_data_files(directory)) - set(files))
    if missing:
        raise IntegrityError(f"{directory}: {', '.join(missing)}, which its .metadata names, "
                             "went missing while it was saved (deleted: another run writing "
                             "to this checkpoint.dir?)")
    # "sizes" is mimo's (megatron-core's reader ignores it): a truncated file is told as such
    sizes = {name: os.path.getsize(os.path.join(directory, name)) for name in sorted(files)}
    write_atomic(os.path.join(directory, MANIFEST), json.dumps(
        {"algorithm": ALGORITHM, "files": dict(sorted(files.items())), "sizes": sizes},
        indent=1).encode())
    for name in parts:
        os.remove(os.path.join(directory, name))


def _data_files(directory: str) -> list[str]:
    """The data files the save's ``.metadata`` (torch.distributed.checkpoint's) names: what
    the checkpoint must hold, whatever the folder holds now."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as error:
        raise IntegrityError(f"{directory}: its .metadata cannot be read ({error})") from None
    return sorted({item.relative_path for item in metadata.storage_data.values()})


def shares(sizes: dict[str, int], ranks: int) -> list[list[str]]:
    """Files split into ``ranks`` shares of about equal bytes (largest first, each to the least
    loaded share; ties by name and rank, so every rank computes the same split)."""
    loads = [0] * ranks
    split: list[list[str]] = [[] for _ in range(ranks)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        split[rank].append(name)
        loads[rank] += sizes[name]
    return split


def verify(directory: str, workers: int = 1) -> None:
    """Check every file against the manifest, each rank hashing one share (collective when a
    process group of several ranks is up; alone otherwise) with ``workers`` threads. Raises
    IntegrityError on every rank, naming each missing, resized or changed file."""
    from mimo_train.runtime import distributed       # torch: not for mimo-inspect checkpoint
    expected, sizes = read_manifest(directory)
    together = distributed.together()
    rank, ranks = distributed.rank_and_size()
    # the shares by the manifest's sizes where it has them: the same split on every rank,
    # whatever a damaged file's size is on one node
    weights = {name: sizes[name] if name in sizes else _size(os.path.join(directory, name))
               for name in expected}
    problems = mismatches(directory, shares(weights, ranks)[rank], expected, sizes, workers)
    if together:
        problems = [problem for share in distributed.gather(problems) for problem in share]
    if problems:
        raise IntegrityError(f"{len(problems)} file(s) do not match {MANIFEST}: "
                             + "; ".join(sorted(problems)))


def read_manifest(directory: str) -> tuple[dict[str, str], dict[str, int]]:
    """The manifest's digests and sizes by file name (sizes empty in a manifest written
    without them: megatron-core's, or mimo's before they were kept); IntegrityError where it
    cannot be read."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
        expected: dict[str, str] = manifest["files"]
        sizes: dict[str, int] = manifest.get("sizes") or {}
        algorithm = manifest.get("algorithm", ALGORITHM)
        if not isinstance(expected, dict) or not isinstance(sizes, dict) or not all(
                isinstance(v, str) for v in expected.values()) or not all(
                type(v) is int for v in sizes.values()):
            raise TypeError("'files' must map names to hex digests, 'sizes' names to bytes")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise IntegrityError(f"{path} is unreadable ({error})") from None
    if algorithm != ALGORITHM:
        raise IntegrityError(f"{path} uses {algorithm!r}, this reader knows {ALGORITHM!r}")
    return expected, sizes


def mismatches(directory: str, names: list[str], expected: dict[str, str],
               sizes: dict[str, int], workers: int = 1) -> list[str]:
    """What is wrong with each of ``names`` against the manifest's digests and sizes, hashed
    by ``workers`` threads (hashlib lets go of the GIL while it hashes): missing, unreadable,
    of another size (not hashed) or of another digest."""
    def problem(name: str) -> str | None:
        path = os.path.join(directory, name)
        try:
            size = os.path.getsize(path)
            if name in sizes and size != sizes[name]:
                how = ("empty" if size == 0 else "truncated" if size < sizes[name]
                       else "longer than saved")
                return f"{name}: {how} ({size:,} bytes, {sizes[name]:,} saved)"
            actual = file_sha256(path)
        except OSError as error:
            return f"{name}: file missing or unreadable ({error.strerror})"
        if actual != expected[name]:
            return (f"{name}: hash mismatch (expected {expected[name][:16]}..., "
                    f"got {actual[:16]}...)")
        return None
    if workers > 1 and len(names) > 1:
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(min(workers, len(names)))
        try:
            verdicts = list(pool.map(problem, names))
        finally:                  # interrupted: the files not started are not hashed
            pool.shutdown(cancel_futures=True)
    else:
        verdicts = [problem(name) for name in names]
    return [verdict for verdict in verdicts if verdict]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


_BLOB = re.compile(r"[0-9a-f]{64}")


def weights_digest(path: str) -> str:
    """One SHA-256 naming the weights at ``path``: a mimo_train checkpoint's is its
    manifest's (which holds every file's), a transformers model directory's (or cached hub
    name's) that of the names and digests of the weight files transformers loads (the
    safetensors where both formats are there; every ``.safetensors`` / ``.bin`` where no
    standard name is)."""
    from mimo_train.families.base import loaded_weight_files, model_directory
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return file_sha256(os.path.join(path, MANIFEST))
    directory = model_directory(path)
    names = loaded_weight_files(directory) or sorted(
        name for name in os.listdir(directory) if name.endswith((".safetensors", ".bin")))
    listing = "".join(f"{name}:{_file_digest(os.path.join(directory, name))}\n"
                      for name in names)
    return hashlib.sha256(listing.encode()).hexdigest()


def _file_digest(path: str) -> str:
    """A file's SHA-256; a hub cache's snapshot file links to a blob named by it
    (``models--ORG--NAME/blobs/SHA256``: a large file's, as huggingface_hub stores it), which
    is read instead of hashing the file again; a link elsewhere is hashed."""
    if os.path.islink(path):
        target = os.path.realpath(path)
        folder, blob = os.path.split(target)
        if _BLOB.fullmatch(blob) and os.path.basename(folder) == "blobs" and \
                os.path.basename(os.path.dirname(folder)).startswith("models--"):
            return blob
    return _kept_digest(path)


DIGESTS_KEPT = "file-digests"           # under the mimo cache (MIMO_CACHE_DIR, ~/.cache/mimo)
_SETTLED_S = 2.0


def _kept_digest(path: str) -> str:
    """``path``'s SHA-256, kept in the mimo cache under the file's identity and times (device,
    inode, size, mtime and ctime in ns: a write or replacement changes ctime, which no tool
    sets back), so that a local multi-GB base is hashed once, not at every mimo-generate. A
    file changed in the last two seconds is not kept: a coarse clock could give its next
    change the same times (git's rule for its index, "racy git")."""
    from mimo_data.shards.cache import DEFAULT_CACHE, environment_cache
    stat = os.stat(path)
    identity = (f"{os.path.realpath(path)}\0{stat.st_dev}\0{stat.st_ino}\0{stat.st_size}\0"
                f"{stat.st_mtime_ns}\0{stat.st_ctime_ns}")
    folder = os.path.join(environment_cache() or DEFAULT_CACHE, DIGESTS_KEPT)
    kept = os.path.join(folder, hashlib.sha256(identity.encode()).hexdigest())
    try:
        with open(kept) as f:
            digest = f.read()
        if _BLOB.fullmatch(digest):
            return digest
    except OSError:
        pass
    digest = file_sha256(path)
    if time.time() - max(stat.st_mtime, stat.st_ctime) > _SETTLED_S:
        try:
            os.makedirs(folder, exist_ok=True)
            write_atomic(kept, digest.encode())
        except OSError:               # a read-only or full cache: hashed again next time
            pass
    return digest
