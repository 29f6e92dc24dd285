"""Local-file helpers every part of mimo uses: atomic writes and content digests."""

from __future__ import annotations

import hashlib
import os


def write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` so that readers see either the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's bytes (shard indexes and checkpoint manifests record these)."""
    with open(path, "rb") as data:
        return hashlib.file_digest(data, "sha256").hexdigest()
