"""Local-file helpers every part of mimo uses: atomic writes, content digests, Parquet read a
batch at a time, YAML read with a key given twice refused, compressed files known by their
first bytes or names, and how a file is missing."""

from __future__ import annotations

import functools
import hashlib
import os
import unicodedata
from collections.abc import Iterator
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml


def write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` so that readers see either the old file or the whole new one (a write
    that fails, on a full disk say, leaves no temporary file)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def not_found(path: str) -> str:
    """How a path that opens no file is missing: a symbolic link to nothing is said as one
    (its target named), a name its folder holds but for the Unicode normalization, letter
    case or white space around it (which print alike) with that name, else "not found"."""
    if os.path.islink(path):
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    name = os.path.basename(path)
    near = _names_alike(os.path.dirname(path) or ".").get(_alike(name))
    if near is None or near == name:       # (a name read before the file went)
        return "not found"
    differs = ("its Unicode normalization (NFC and NFD: macOS and its zip files write names "
               "decomposed)" if unicodedata.normalize("NFC", near) ==
               unicodedata.normalize("NFC", name) else
               "white space around it" if near.strip() == name.strip() else "letter case")
    return (f"not found, but its folder holds {near!r}, another name for {name!r} only in "
            f"{differs}: rename the file, or the record's path")


# names read of a folder to find one alike (a folder of more names is not searched)
_MAX_NAMES_ALIKE = 100_000


def _alike(name: str) -> str:
    return unicodedata.normalize("NFC", name).casefold().strip()


@functools.lru_cache(maxsize=8)
def _names_alike(folder: str) -> dict[str, str]:
    """``folder``'s names by ``_alike``; empty where it cannot be read or holds more than
    ``_MAX_NAMES_ALIKE`` (kept for the next missing file of the folder)."""
    names: dict[str, str] = {}
    try:
        with os.scandir(folder) as entries:
            for count, entry in enumerate(entries):
                if count == _MAX_NAMES_ALIKE:
                    return {}
                names.setdefault(_alike(entry.name), entry.name)
    except OSError:
        return {}
    return names


def file_in_the_way(folder: str) -> str | None:
    """The file that stands where ``folder`` or a folder above it would be (so that
    ``folder`` cannot be made), None where there is none."""
    path = os.path.abspath(folder)
    while not os.path.isdir(path):
        if os.path.lexists(path):
            return path
        if os.path.dirname(path) == path:
            return None
        path = os.path.dirname(path)
    return None


# a Parquet file's leading bytes (a table given where another file is read)
PARQUET_MAGIC = b"PAR1"
# the compressions users' files come in: each one's leading bytes (whatever the file's name)
# and its names' suffixes; undone by ``decompress_command``
COMPRESSIONS = {"gzip": (b"\x1f\x8b", (".gz", ".tgz")), "zstd": (b"\x28\xb5\x2f\xfd", (".zst",)),
                "bzip2": (b"BZh", (".bz2",)), "xz": (b"\xfd7zXZ\x00", (".xz",)),
                "zip": (b"PK\x03\x04", (".zip",))}


def compression_of(head: bytes) -> str | None:
    """The compression (a ``COMPRESSIONS`` key) a file starting with ``head`` is in, if any."""
    return next((kind for kind, (magic, _) in COMPRESSIONS.items() if head.startswith(magic)),
                None)


def compression_suffix(name: str) -> str:
    """The compression's suffix (``.gz``) the file name ``name`` ends with, "" where none."""
    return next((suffix for _, suffixes in COMPRESSIONS.values() for suffix in suffixes
                 if name.lower().endswith(suffix)), "")


def compression_named(name: str) -> str | None:
    """The compression (a ``COMPRESSIONS`` key) the file name ``name``'s suffix says, if any."""
    suffix = compression_suffix(name)
    return next((kind for kind, (_, suffixes) in COMPRESSIONS.items() if suffix in suffixes),
                None)


def decompress_command(kind: str, path: str, ext: str | None = None) -> str:
    """The command that decompresses ``path`` in ``kind``: beside itself, the file kept, where
    its name ends with the suffix of ``kind`` (the tool writes the name less it); else into
    ``STEM.plain.EXT`` (the tool refuses a name without its suffix; another's suffix goes;
    ``ext``: the decompressed file's, else the name's own)."""
    if compression_named(path) == kind:
        return f"unzip {path}" if kind == "zip" else f"{kind} -dk {path}"
    stem, own = os.path.splitext(path[:len(path) - len(compression_suffix(path))])
    return (f"unzip -p {path}" if kind == "zip" else f"{kind} -dc {path}") + \
        f" > {stem}.plain{own if ext is None else ext}"


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes (shard indexes and checkpoint manifests record these)."""
    with open(path, "rb") as data:
        return hashlib.file_digest(data, "sha256").hexdigest()


PARQUET_BATCH = 65536                # rows a batch of ``parquet_batches``


def parquet_batches(source: str | IO[bytes], columns: list[str] | None = None,
                    batch_size: int | None = None) -> Iterator[pa.RecordBatch]:
    """The record batches of a Parquet file (a path or file), in memory one at a time."""
    # pre_buffer off: with it, reading a samples.parquet of 4M rows in 40 row groups held 94 MB
    # of buffers by its last batch, 19 MB without (pyarrow 26)
    return pq.ParquetFile(source, pre_buffer=False).iter_batches(
        batch_size=batch_size or PARQUET_BATCH, columns=columns)


class _OneKeyOnce(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice: PyYAML keeps the last
    without a word (a second ``optimizer:`` section would replace the first whole)."""


def _mapping(loader: _OneKeyOnce, node: yaml.MappingNode, deep: bool = False) -> dict:
    first: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":          # ``<<: *anchor`` overrides
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            given = key in first
        except TypeError:                                      # an unhashable key: PyYAML's
            continue
        if given:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {key!r} is given twice (lines {first[key] + 1} and "
                f"{key_node.start_mark.line + 1}), and only the last would count: give it "
                "once, its settings together", key_node.start_mark)
        first[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep)


_OneKeyOnce.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(stream) -> Any:
    """``yaml.safe_load`` of ``stream`` (text or a file), a key given twice in a mapping
    refused (``yaml.YAMLError``)."""
    return yaml.load(stream, Loader=_OneKeyOnce)  # noqa: S506 (a SafeLoader)
