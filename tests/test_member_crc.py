"""Every member read for training is checked against the crc32 ``samples.parquet`` records:
20 KB zeroed inside three JPEG members of a shard still decode with Pillow (so they would train
silently), but the image rank's loader stops at the first with the shard, sample, member and
what to do; a mismatch that a second read does not repeat (a transient storage fault) is not an
error; a dataset whose samples.parquet has no crc32 is read unchecked."""

from __future__ import annotations

import io
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from conftest import CORPUS_DIR, build_dataset, preprocess_config_file, rewrite_samples_parquet
from mimo_data.loading.loader import build_loader
from mimo_data.shards.index import DatasetError
from mimo_data.shards.reader import ShardReader

ZEROED = 20_000


@pytest.fixture
def dataset(tmp_path):
    out = tmp_path / "shards"
    build_dataset([CORPUS_DIR / "llava.jsonl"], out)
    return out


def _large_jpegs(reader: ShardReader, count: int) -> list[tuple[int, str, int, int]]:
    """(position, member, offset, size) of ``count`` JPEG members of at least 3 x ZEROED."""
    found = []
    for position in range(len(reader)):
        for name, (offset, size, _) in reader.table.members(position).items():
            if name.endswith(".jpg") and size >= 3 * ZEROED:
                found.append((position, name, offset, size))
    assert len(found) >= count, found
    return found[:count]


def _zero_inside(shard: str, offset: int, size: int) -> None:
    with open(shard, "r+b") as f:
        f.seek(offset + size // 3)
        f.write(b"\0" * ZEROED)


def test_zeroed_jpeg_bytes_stop_the_image_loader_naming_the_member(dataset, tmp_path):
    reader = ShardReader(str(dataset))
    damaged = _large_jpegs(reader, 3)
    for position, _name, offset, size in damaged:
        _zero_inside(str(dataset / reader.table.shard(position)), offset, size)
    position, name, offset, size = damaged[0]
    data = os.pread(os.open(dataset / reader.table.shard(position), os.O_RDONLY), size, offset)
    Image.open(io.BytesIO(data)).load()            # Pillow decodes it without a complaint
    config = preprocess_config_file(tmp_path / "p.yaml", image={"max_pixels": 50176})
    loader = build_loader(str(dataset), config, "image=dp1;language=dp1", 0, 2, 4, 4, seed=0)
    with pytest.raises(DatasetError) as stopped:
        for _ in loader:
            pass
    message = str(stopped.value)
    keys = {reader.table.key(p): n for p, n, _, _ in damaged}
    assert any(f"sample {key} member {key}.{member}" in message for key, member in keys.items())
    assert "crc32 differs" in message and f"mimo-shard verify {dataset}" in message


def test_a_shard_cut_short_names_the_dataset_sample_and_member(dataset):
    """A shard truncated after the reader opened its index: the read names the shard, the
    sample and member, and the verify command for the dataset."""
    reader = ShardReader(str(dataset))
    position = len(reader) - 1
    shard = dataset / reader.table.shard(position)
    offset, size, _ = reader.table.members(position)["json"]
    os.truncate(shard, offset + size // 2)
    with pytest.raises(DatasetError) as stopped:
        reader.read_member(position, "json")
    key = reader.table.key(position)
    # (the bytes that arrived: the record's size, odd or even, follows the build's paths)
    assert str(stopped.value).startswith(f"{shard}: cut short, {size // 2} of {size} "
                                         f"bytes at byte {offset} (sample {key} member "
                                         f"{key}.json); run `mimo-shard verify {dataset}`")


def test_a_mismatch_read_once_is_read_again(dataset, monkeypatch):
    reader = ShardReader(str(dataset))
    position, name, _, _ = _large_jpegs(reader, 1)[0]
    expected = reader.read_member(position, name)
    reads = []
    original = os.pread

    def flaky(fd, size, offset):
        data = original(fd, size, offset)
        reads.append(offset)
        return b"\0" * size if len(reads) == 1 else data      # the first read comes back zeroed
    monkeypatch.setattr(os, "pread", flaky)
    assert reader.read_member(position, name) == expected and len(reads) == 2


def test_a_dataset_without_recorded_crc32_is_read_unchecked(dataset):
    parquet = dataset / "samples.parquet"
    table = pq.read_table(parquet)
    members = table.column("members").combine_chunks()
    flat = members.flatten()
    plain = pa.StructArray.from_arrays([flat.field(n) for n in ("name", "offset", "size")],
                                       names=["name", "offset", "size"])
    older = table.set_column(table.schema.get_field_index("members"), "members",
                             pa.ListArray.from_arrays(members.offsets, plain))
    copy = dataset.parent / "older"
    shutil.copytree(dataset, copy)
    rewrite_samples_parquet(copy, older)
    reader = ShardReader(str(copy))
    position, name, offset, size = _large_jpegs(reader, 1)[0]
    assert reader.table.members(position)[name][2] == -1
    _zero_inside(str(copy / reader.table.shard(position)), offset, size)
    assert reader.read_member(position, name).count(0) >= ZEROED     # no check: bytes as read
