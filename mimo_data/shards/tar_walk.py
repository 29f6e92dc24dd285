"""Walk an existing WebDataset tar once: its samples' members with their data offsets, sizes,
crc32 and bytes, and the whole file's size and sha256, telling a complete tar from a truncated
one.

The walk is ``tarfile``'s stream mode (``r|``) over a reader that hashes what passes: webdataset's
tar iterators yield member bytes but not where they sit in the file, and ``TarInfo.offset_data``
is that position. Members are grouped into samples as webdataset groups them (its
``base_plus_ext``: the key is the path up to the first dot of the file name, the rest the
suffix, lowercased as its ``group_by_keys`` does: ``KEY.JPG`` is the sample's ``jpg``;
consecutive members of one key form a sample). Members are read by their data offsets, so the
suffix is only their name in the index.

A truncated tar ends either inside a member's data (``tarfile`` raises) or inside or instead of
the next header, which ``tarfile`` takes for the end without a word; the walk checks that the
block where the next header would start is the zero block that ends every complete archive
(where the file goes on past that block, its header is damaged instead).
"""

from __future__ import annotations

import hashlib
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from webdataset.tariterators import base_plus_ext

from mimo_data.files import (PARQUET_MAGIC, compression_named, compression_of,
                              decompress_command)

_BLOCK = 512
_WINDOW = 1 << 16      # bytes kept behind the read position: tarfile buffers 10 KiB at most


def _decompress(command: str) -> str:
    """What to do with a tar that ``command`` (`gzip -dk FILE`) decompresses."""
    return (f"decompress it into a .tar (`{command}`), then index that: a compressed tar's "
            "members have no byte offsets to read them at")


def not_in_place(name: str) -> str:
    """What to do with the compressed tar ``name`` (its tool by its suffix)."""
    kind = compression_named(name)
    assert kind is not None, name           # (tar_sources.COMPRESSED_TARS: named so)
    return _decompress(decompress_command(kind, name, ".tar"))


class NotATarError(ValueError):
    """The file is no tar (its first block is no tar header), not a truncated one."""


def _cut_header(first: bytes) -> bool:
    """Whether bytes shorter than a block are the start of a tar header: a name (no control
    characters) ended by NUL padding before the cut, then, where the cut leaves them, an octal
    mode and the ``ustar`` magic."""
    name, nul, padding = first[:100].partition(b"\0")
    mode = first[100:108]
    return (bool(name) and bool(nul) and not padding.strip(b"\0")
            and all(byte >= 0x20 for byte in name)
            and not mode.strip(b"01234567 \0")
            and (len(first) < 262 or first[257:262] == b"ustar"))


def _not_a_tar(first: bytes, name: str) -> str | None:
    """Why a file whose first header ``tarfile`` refused is no tar; None: a tar cut inside its
    first header (its start reads as one)."""
    kind = compression_of(first)
    if kind == "zip":
        return "not a tar but a zip file: unzip it"
    if kind:
        return f"not a tar but {kind}-compressed: " \
            f"{_decompress(decompress_command(kind, name, '.tar'))}"
    if first.startswith(PARQUET_MAGIC):
        return ("not a tar but a Parquet file (img2dataset writes one beside each tar: give "
                "only the tars, e.g. 'DIR/*.tar'; a dataset as a table is for `mimo-shard "
                "build`)")
    if len(first) == _BLOCK:
        return "not a tar (its first 512 bytes are no tar header)"
    if not first:
        return "an empty file (0 bytes), not a tar: remove it or fetch it again"
    if _cut_header(first):
        return None
    return (f"not a tar ({len(first)} bytes: shorter than one tar header and not the start of "
            "one; a metadata file such as img2dataset's *_stats.json? give only the tars)")


@dataclass
class Member:
    offset: int         # of the data in the tar
    size: int
    crc32: int
    data: bytes


@dataclass
class Sample:
    key: str
    members: dict[str, Member]          # by suffix (``jpg``, ``0.png``), in tar order
    duplicates: list[str] = field(default_factory=list)   # members whose suffix came before


@dataclass
class Walked:
    """What the walk found besides the samples (filled in when it ends)."""
    bytes: int = 0
    sha256: str = ""
    truncated: str = ""                 # why the tar is incomplete ("" when it is complete)
    cut_key: str = ""                   # the key being read where it ends ("": none)
    stray: list[str] = field(default_factory=list)   # members that belong to no sample
    links: list[tuple[str, str]] = field(default_factory=list)   # (name, "a hard link to X")
    others: list[str] = field(default_factory=list)  # folders, devices: no file, no link
    trailing: tuple[int, int] | None = None  # (end block's byte, data byte after it): unread


class _Hashing:
    """A read-only file that hashes and counts what goes through it and keeps its last bytes."""

    def __init__(self, source: IO[bytes]):
        self._source = source
        self._sha256 = hashlib.sha256()
        self.size = 0
        self._window = bytearray()

    def read(self, size: int = -1) -> bytes:
        data = self._source.read(size)
        self._sha256.update(data)
        self.size += len(data)
        self._window += data
        del self._window[:max(0, len(self._window) - _WINDOW)]
        return data

    def at(self, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset + size)`` of the file if still held (fewer at its end)."""
        start = self.size - len(self._window)
        if offset < start:
            raise RuntimeError(f"tar walk: byte {offset} is no longer held (from {start})")
        return bytes(self._window[offset - start:offset - start + size])

    def drain(self, after: int | None = None) -> tuple[str, int | None]:
        """Read to the end; the file's sha256, and the first byte from ``after`` on (a byte
        still held, or later) that is not NUL (None: none, or ``after`` None)."""
        held = self.at(after, len(self._window)) if after is not None else b""
        found = self.size - len(held.lstrip(b"\0")) if held.strip(b"\0") else None
        while data := self.read(1 << 20):
            if found is None and after is not None and data.strip(b"\0"):
                found = self.size - len(data.lstrip(b"\0"))
        return self._sha256.hexdigest(), found


def walk(source: IO[bytes], walked: Walked, name: str) -> Iterator[Sample]:
    """The complete samples of the tar read from ``source``; ``walked`` gets the file's size,
    sha256, why it is truncated (then the sample being read when it ended is not yielded),
    members outside any sample (no suffix) and link members (not read). NotATarError: the
    file is no tar at all (``name``: the file, as its remedy names it)."""
    stream = _Hashing(source)
    current: Sample | None = None
    headers, reading = 0, ""
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:   # type: ignore[call-overload]
            for info in tar:
                headers += 1
                if not info.isfile():                      # folders, links, devices
                    if info.islnk() or info.issym():       # unread, as webdataset skips them
                        kind = "a hard" if info.islnk() else "a symbolic"
                        walked.links.append((info.name, f"{kind} link to {info.linkname}"))
                    else:
                        walked.others.append(info.name)
                    continue
                key, suffix = base_plus_ext(info.name)
                # a macOS metadata file (._NAME) in a folder splits as key "folder/": stray
                # wherever it is, as at the tar's root (where webdataset finds no key)
                if key is None or suffix is None or \
                        info.name.rpartition("/")[2].startswith("._"):
                    walked.stray.append(info.name)
                    continue
                suffix = suffix.lower()                    # as webdataset's group_by_keys
                reading = key
                if current is not None and current.key != key:
                    yield current                          # complete: the next one begins
                    current = None
                member = tar.extractfile(info)
                assert member is not None                  # a regular file
                data = member.read()
                if len(data) != info.size:
                    raise tarfile.ReadError(f"unexpected end of data in {info.name}")
                if current is None:
                    current = Sample(key, {})
                if suffix in current.members:
                    current.duplicates.append(info.name)
                    continue
                current.members[suffix] = Member(info.offset_data, info.size, zlib.crc32(data),
                                                 data)
            end = tar.offset
        stopped = end if stream.at(end, _BLOCK) != bytes(_BLOCK) else None
    except tarfile.ReadError as exc:
        reason = None if headers else _not_a_tar(stream.at(0, _BLOCK), name)
        if reason is not None:
            raise NotATarError(reason) from None
        walked.truncated = f"the tar ends inside a member ({exc})"
        walked.cut_key = reading
        stopped = None
    # past the end-of-archive blocks a tar holds NULs alone; data there (a tar appended with
    # `cat`) is read by neither tarfile nor webdataset
    after = None if walked.truncated or stopped is not None else end + 2 * _BLOCK
    walked.sha256, data_at = stream.drain(after)
    walked.bytes = stream.size
    if data_at is not None:
        walked.trailing = (end, data_at)
    if stopped is not None:         # the file's size tells a cut header from a damaged one
        walked.truncated = (
            f"a damaged tar header at byte {stopped} (the file goes on to byte {stream.size}): "
            "the rest of the file cannot be read" if stream.size >= stopped + _BLOCK else
            f"the tar ends at byte {stream.size} without its end-of-archive block (a header "
            f"cut short at byte {stopped})")
        walked.cut_key = reading
    if current is not None and not walked.truncated:
        yield current
