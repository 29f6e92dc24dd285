"""Where tables derived from a dataset live, and how they are written and checked.

A derived table (the memory-mapped sample table, a token table per preprocessing config) is an
Arrow IPC file named after a key that covers everything it was computed from, with the sha256
of its columns in its schema metadata. It lives in ``DATASET/.mimo-cache/`` when that
directory is writable, otherwise (or when ``MIMO_CACHE_DIR`` or a ``cache_dir`` is given) in
``CACHE/<dataset name>-<hash of its absolute path or URL>/`` (``CACHE`` by default
``~/.cache/mimo``). ``MIMO_CACHE_DIR`` overrides a configured ``cache_dir``. A local
dataset's own ``.mimo-cache/`` table (the sample and records tables ``mimo-shard build`` and
``index`` write) is read there first, wherever the cache is. A remote dataset's tables always
live in the local cache (they are memory-mapped): on first use they are
downloaded from the dataset's own ``.mimo-cache/`` (where ``mimo-shard build`` puts them), or
derived when it has none.

Files are written to a temporary name and renamed, so readers (and concurrent writers of the
same table) only ever see complete files; a file that does not open, whose key differs or
whose columns do not hash to the recorded digest is not used (the caller rebuilds it).

Besides its key, a table carries labels (``Labels``) saying what it is and what it was derived
from, so that ``cache_entries`` can tell a table still in use from one superseded by a rebuild
of the dataset or by a newer table for the same preprocessing.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import pyarrow as pa

from mimo_data.errors import ConfigError
from mimo_data.shards import storage

CACHE_DIR_ENV = "MIMO_CACHE_DIR"
# what a write into a cache that cannot take a table fails with (no read fails so)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
DATASET_CACHE = ".mimo-cache"
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "mimo")


def environment_cache() -> str | None:
    """The cache folder ``MIMO_CACHE_DIR`` names, ``~`` expanded (an ``ENV`` line of a
    Dockerfile, a systemd unit or an ``.env`` file leaves it as written); None where unset."""
    value = os.environ.get(CACHE_DIR_ENV)
    return os.path.expanduser(value) if value else None


@dataclass(frozen=True)
class Labels:
    """What a derived table is (schema metadata ``mimo.<field>``)."""
    kind: str                 # "samples", "records", "tokens", "report", "checked"
    dataset: str              # the build it was derived from: samples.parquet's sha256
    purpose: str = ""         # what it was computed for besides the code (a preprocessing's
    #                           digest; "" for the sample table): one current table per purpose
    about: str = ""           # the purpose in words (tokenizer, sequence length)

    def metadata(self) -> dict[bytes, bytes]:
        return {f"mimo.{name}".encode(): value.encode() for name, value in asdict(self).items()}

    @classmethod
    def of(cls, metadata: dict[bytes, bytes]) -> Labels | None:
        """The labels in a table's metadata; None for a table written without them."""
        try:
            return cls(**{name: metadata[f"mimo.{name}".encode()].decode()
                          for name in cls.__dataclass_fields__})
        except KeyError:
            return None


def cache_directory(dataset: str, cache_dir: str | None = None,
                    storage_options: dict | None = None) -> str:
    """The directory holding ``dataset``'s derived tables (created if missing;
    ``storage_options``: a remote dataset's, whose endpoint tells stores apart)."""
    root = environment_cache() or cache_dir
    if root is None and not storage.is_remote(dataset):
        own = os.path.join(storage.local_path(dataset), DATASET_CACHE)
        try:
            os.makedirs(own, exist_ok=True)
        except OSError:         # a read-only dataset
            pass
        if os.access(own, os.W_OK):
            return own
    path = external_directory(dataset, root, storage_options)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:      # a file in the way, no permission
        named = f"{CACHE_DIR_ENV}={root}" if os.environ.get(CACHE_DIR_ENV) else \
            f"the cache folder {root} (data.cache_dir, or --cache-dir)" if root else \
            f"the default cache {DEFAULT_CACHE}"
        raise ConfigError(f"{dataset}'s tables cannot be kept: {path} cannot be made "
                          f"({exc.strerror}); {named} must be a folder this process can write "
                          "to") from None
    return path


def external_directory(dataset: str, root: str | None,
                       storage_options: dict | None = None) -> str:
    """``dataset``'s directory in the cache ``root`` (None: the default cache), named by its
    path or URL, and by the endpoint of a bucket not on AWS's own (two MinIO servers may each
    hold a bucket of the same name)."""
    absolute = dataset.rstrip("/") if storage.is_remote(dataset) else \
        os.path.abspath(storage.local_path(dataset))
    endpoint = storage.endpoint_of(dataset, storage_options or {}).rstrip("/")
    if "://" in endpoint:               # a configured endpoint, not AWS's own (unchanged)
        absolute = f"{endpoint} {absolute}"
    name = f"{storage.name_of(dataset)}-{hashlib.sha256(absolute.encode()).hexdigest()[:12]}"
    return os.path.join(root or DEFAULT_CACHE, name)


def index_folder(sources: list[str], storage_options: dict | None = None) -> str:
    """Where ``mimo-shard index`` writes the index of ``sources`` without ``--output``:
    ``CACHE/indexes/<name>-<hash of the sources>`` (CACHE: ``MIMO_CACHE_DIR`` or
    ``~/.cache/mimo``; a bucket's endpoint in the hash, as ``external_directory``)."""
    root = os.path.join(environment_cache() or DEFAULT_CACHE, "indexes")
    given = sources[0] if len(sources) == 1 else "\n".join(sources)
    return external_directory(given, root, storage_options)


def columns_digest(table: pa.Table) -> str:
    """sha256 of every column's buffers: detects a changed byte in a table file."""
    digest = hashlib.sha256()
    for column in table.columns:
        for chunk in column.chunks:
            for buffer in chunk.buffers():
                if buffer is not None:
                    digest.update(memoryview(buffer))
    return digest.hexdigest()


def column(table: pa.Table, name: str) -> pa.Array:
    """Column ``name`` as one array: the file's own (memory-mapped) when it holds one chunk,
    an empty one when the table has no rows."""
    chunked = table.column(name)
    return chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()


def write_table(path: str, table: pa.Table, key: str, labels: Labels) -> None:
    """Write ``table`` to ``path`` atomically, with ``key``, its digest and ``labels`` in its
    metadata."""
    # The digest is taken of the table as read back from IPC: buffers exactly as the file holds
    # them (a sliced array's buffers may hold more than it shows). Read back from a file of
    # its own, memory-mapped, not from a buffer in memory: the table is written twice, but
    # no copy of it is held (a build's records are as large as the dataset's JSON).
    def temporary() -> tuple[int, str]:
        return tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-",
                                dir=os.path.dirname(path))
    handle, plain = temporary()
    try:
        with os.fdopen(handle, "wb") as out, pa.ipc.new_file(out, table.schema) as writer:
            writer.write_table(table.combine_chunks())    # a column of one chunk: as it is
        with pa.memory_map(plain) as source:
            table = pa.ipc.open_file(source).read_all()
            metadata = {**(table.schema.metadata or {}), **labels.metadata(),
                        b"mimo.key": key.encode(),
                        b"mimo.digest": columns_digest(table).encode()}
            table = table.replace_schema_metadata(metadata)
            handle, tmp = temporary()
            try:
                with os.fdopen(handle, "wb") as out, \
                        pa.ipc.new_file(out, table.schema) as writer:
                    writer.write_table(table)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(tmp, 0o644)        # mkstemp's 0600 would hide it from other users
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
            del table
    finally:
        os.unlink(plain)


def save_table(path: str, table: pa.Table, key: str, labels: Labels) -> pa.Table | None:
    """``write_table``, then the saved file memory-mapped; None, with a warning, when it cannot
    be saved (a read-only or full cache: the caller uses ``table`` from memory this time)."""
    try:
        write_table(path, table, key, labels)
    except OSError as exc:
        print(f"mimo: could not save {path} ({exc}); set {CACHE_DIR_ENV} to a writable "
              "directory", file=sys.stderr)
        return None
    return read_table(path, key)


def mapped(path: str) -> pa.Table:
    """The IPC file at ``path``, memory-mapped (no check: see ``read_table``)."""
    return pa.ipc.open_file(pa.memory_map(path)).read_all()


def read_table(path: str, key: str) -> pa.Table | None:
    """The table at ``path``, memory-mapped, if it is complete, for ``key`` and undamaged;
    None otherwise (missing, truncated, another key, changed bytes)."""
    if not os.path.isfile(path):
        return None
    try:
        table = mapped(path)
    except (pa.ArrowInvalid, OSError):
        return None
    metadata = table.schema.metadata or {}
    if metadata.get(b"mimo.key") != key.encode() or \
            metadata.get(b"mimo.digest") != columns_digest(table).encode():
        return None
    return table


def obtain(dataset: str, name: str, key: str, labels: Labels, derive: Callable[[str], None],
           cache_dir: str | None = None,
           remote: storage.Remote | None = None) -> tuple[pa.Table, str | None]:
    """The derived table ``name`` of ``dataset`` for ``key``, memory-mapped from the cache, and
    its path: a local dataset's own (a build's) first, wherever the cache is; else the
    cache's, downloaded from a remote dataset's own cache, or written there by
    ``derive(path)`` when the cache has none (path None: it could not be saved, the table is
    mapped from a removed temporary file)."""
    own = None
    if not storage.is_remote(dataset):
        # the build's own copy, read where it is whatever the cache (MIMO_CACHE_DIR's, a
        # cache_dir, the default one of a read-only dataset), which need not even be made
        own = os.path.join(storage.local_path(dataset), DATASET_CACHE, name)
        if (table := read_table(own, key)) is not None:
            return table, own
    path = os.path.join(cache_directory(dataset, cache_dir,
                                        remote.options if remote is not None else None), name)
    table = read_table(path, key) if path != own else None
    if table is None and remote is not None:
        try:
            remote.fetch(storage.join(dataset, DATASET_CACHE, name), path)
            table = read_table(path, key)
        except FileNotFoundError:        # the dataset publishes no such table
            pass
    if table is not None:
        return table, path
    if os.environ.get("LOCAL_RANK", "0") == "0":    # once per machine under torchrun
        print(f"mimo: {dataset}: writing {path} ({labels.kind} table; once per dataset and "
              "cache directory)", file=sys.stderr, flush=True)
    try:
        derive(path)
    except OSError as exc:
        if exc.errno not in _NO_ROOM:    # a read error, say: not the cache's
            raise
        # a full or read-only cache: this process uses a temporary copy
        print(f"mimo: could not save {path} ({exc}); set {CACHE_DIR_ENV} to a writable "
              "directory", file=sys.stderr)
        try:
            with tempfile.TemporaryDirectory() as folder:
                derive(os.path.join(folder, name))
                return mapped(os.path.join(folder, name)), None   # pages outlive the file
        except OSError as again:
            raise ConfigError(f"{dataset}'s {labels.kind} table could be written neither to "
                              f"{path} ({exc.strerror or exc}) nor to the temporary folder "
                              f"{tempfile.gettempdir()} ({again.strerror or again}); set "
                              f"{CACHE_DIR_ENV} to a folder with room") from None
    table = read_table(path, key)
    if table is None:
        raise ConfigError(f"{path} was written but does not read back as written: another "
                          "process may be writing a different table there; remove it and "
                          "start again")
    return table, path
