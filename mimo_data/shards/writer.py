"""Write samples into size-bounded WebDataset tars, recording every member's byte offset.

``webdataset.TarWriter`` writes the tar; this module adds what it lacks for an indexed dataset:
rotation by sample count and bytes with our own names, a sha256 of each shard computed while
writing (no second read), and the data offset of every member for the per-sample table.
Shards are not fsynced (that would double the build time); ``index.json`` is, and
``mimo-shard verify`` detects a shard torn by a power loss.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import zlib
from collections.abc import Callable

import webdataset

from mimo_data.shards.format import shard_name

_BLOCK = 512  # tar header and data alignment (USTAR)


def _padded(size: int) -> int:
    return (size + _BLOCK - 1) // _BLOCK * _BLOCK


def _closed_size(offset: int) -> int:
    """Size of a tar whose members end at ``offset`` once closed: ``tarfile`` adds two zero
    blocks and pads the file to a whole record (RECORDSIZE, 20 blocks)."""
    return -(-(offset + 2 * _BLOCK) // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


class _HashingFile:
    """A write-only file that hashes and counts what goes through it."""

    def __init__(self, path: str):
        self._file = open(path, "wb", buffering=1 << 22)  # tarfile writes 10 KiB records
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._file.write(data)

    def close(self) -> None:
        self._file.close()


class ShardSet:
    """Shards ``NAME-000000.tar``, ``NAME-000001.tar`` ... in ``directory``.

    A new shard starts when the current one holds ``max_samples`` samples or the next sample
    would take it past ``max_bytes`` (a single larger sample still gets a shard of its own).
    Output is byte-reproducible: fixed mtime, owner and mode in every header.
    """

    def __init__(self, directory: str, name: str, max_samples: int, max_bytes: int,
                 shard_done: Callable[[str], None] | None = None):
        self.directory, self.name = directory, name
        self.shard_done = shard_done       # called with each complete shard's path
        self.max_samples, self.max_bytes = max_samples, max_bytes
        self.shards: list[dict] = []
        self._file: _HashingFile | None = None
        self._tar: webdataset.TarWriter | None = None
        self._samples = 0

    def add(self, key: str, members: dict[str, bytes]) -> tuple[str, list[dict]]:
        """Write one sample (``{suffix: bytes}``); return its shard name and member records."""
        size = sum(_BLOCK + _padded(len(data)) for data in members.values())
        tar = self._tar
        if tar is None or self._samples >= self.max_samples or (
                self._samples and _closed_size(tar.tarstream.offset + size) > self.max_bytes):
            self._close_shard()
            self._open_shard()
        assert self._tar is not None
        start = self._tar.tarstream.offset
        self._tar.write({"__key__": key, **members})
        # TarWriter writes members in sorted order, each a 512-byte header plus padded data.
        records, offset = [], start
        for suffix in sorted(members):
            length = len(members[suffix])
            records.append({"name": suffix, "offset": offset + _BLOCK, "size": length,
                            "crc32": zlib.crc32(members[suffix])})
            offset += _BLOCK + _padded(length)
        if offset != self._tar.tarstream.offset:
            raise RuntimeError(f"tar layout changed: computed end {offset}, "
                               f"tarfile says {self._tar.tarstream.offset} (key {key})")
        self._samples += 1
        return self.shards[-1]["name"], records

    def _open_shard(self) -> None:
        name = shard_name(self.name, len(self.shards))
        self._file = _HashingFile(os.path.join(self.directory, name))
        self._tar = webdataset.TarWriter(self._file, encoder=False, mtime=0)
        self._samples = 0
        self.shards.append({"name": name, "samples": 0, "bytes": 0, "sha256": None})

    def _close_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()          # writes the end-of-archive blocks through _HashingFile
        assert self._file is not None
        self._file.close()
        self.shards[-1].update(samples=self._samples, bytes=self._file.size,
                               sha256=self._file.sha256.hexdigest())
        self._tar = self._file = None
        if self.shard_done is not None:
            self.shard_done(os.path.join(self.directory, self.shards[-1]["name"]))

    def close(self) -> list[dict]:
        """Finish the last shard; return ``[{name, samples, bytes, sha256}]``."""
        self._close_shard()
        return self.shards
