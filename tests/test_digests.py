"""The integrity manifest with the hashing spread over the ranks
(``mimo_train.components.digests``): each writer hashes only its own files, the readers' shares
cover every file once in about equal bytes, and the manifest is megatron-core's, readable by its own
verifier. The multi-rank paths (a 3-rank save, a damaged checkpoint refused on every rank) run in
tests/test_train_run.py."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from mimo_train.components import digests
from mimo_train.errors import IntegrityError


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dcp_metadata(names: list[str]) -> bytes:
    """torch.distributed.checkpoint's ``.metadata`` naming each of the data files ``names``
    (one tensor in each), as its FileSystemWriter pickles it."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    return pickle.dumps(Metadata(state_dict_metadata={}, storage_data={
        MetadataIndex(f"tensor{i}"): _StorageInfo(name, 0, 1) for i, name in enumerate(names)}))


DATA = {"__0_0.distcp": b"a" * 300, "__1_0.distcp": b"b" * 500, "__1_1.distcp": b"c" * 10,
        "__2_0.distcp": b"d" * 200}


@pytest.fixture
def checkpoint(tmp_path):
    """A torch_dist-like directory written by 3 ranks: their data files, rank 0's index."""
    files = {**DATA, ".metadata": _dcp_metadata(list(DATA)), "metadata.json": b"{}"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path, files


def test_each_writer_hashes_only_its_own_files(checkpoint, monkeypatch):
    directory, files = checkpoint
    hashed = []
    original = digests.file_sha256
    monkeypatch.setattr(digests, "file_sha256",
                        lambda path: hashed.append(os.path.basename(path)) or original(path))
    digests.write_part(str(directory), 1)
    assert sorted(hashed) == ["__1_0.distcp", "__1_1.distcp"]
    part = json.loads((directory / "integrity.1.json").read_text())
    assert part == {name: _sha(files[name]) for name in ("__1_0.distcp", "__1_1.distcp")}


def test_the_manifest_merges_the_parts_and_megatron_reads_it(checkpoint, monkeypatch):
    from mimo_train import mcore  # noqa: F401  (megatron-core imported quietly)
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    directory, files = checkpoint
    for rank in range(3):
        digests.write_part(str(directory), rank)
    hashed = []
    original = digests.file_sha256
    monkeypatch.setattr(digests, "file_sha256",
                        lambda path: hashed.append(os.path.basename(path)) or original(path))
    digests.write_manifest(str(directory))
    assert sorted(hashed) == [".metadata", "metadata.json"]        # rank 0's own, small files
    manifest = json.loads((directory / "integrity.json").read_text())
    assert manifest == {"algorithm": "sha256",
                        "files": {name: _sha(data) for name, data in sorted(files.items())},
                        "sizes": {name: len(data) for name, data in sorted(files.items())}}
    assert sorted(p.name for p in directory.iterdir()) == sorted([*files, "integrity.json"])
    verify_integrity_manifest(str(directory))            # megatron-core's own check accepts it
    digests.verify(str(directory))


def test_a_data_file_without_its_writers_digests_fails_the_save(checkpoint):
    directory, _ = checkpoint
    digests.write_part(str(directory), 0)
    digests.write_part(str(directory), 1)              # rank 2's writer never finished
    with pytest.raises(IntegrityError, match=r"__2_0.distcp has no digest from rank 2"):
        digests.write_manifest(str(directory))
    assert not (directory / "integrity.json").exists()


def test_a_data_file_deleted_before_its_writer_hashed_fails_the_save(checkpoint):
    """Another run writing to the same checkpoint.dir deleted rank 1's files before rank 1's
    writer listed them: no part names them, but the save's .metadata does."""
    directory, _ = checkpoint
    for name in ("__1_0.distcp", "__1_1.distcp"):
        (directory / name).unlink()
    for rank in range(3):
        digests.write_part(str(directory), rank)
    with pytest.raises(IntegrityError, match=r"__1_0.distcp, __1_1.distcp, which its .metadata "
                       "names, went missing while it was saved"):
        digests.write_manifest(str(directory))
    assert not (directory / "integrity.json").exists()


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8])
def test_the_shares_cover_every_file_once_in_about_equal_bytes(ranks):
    sizes = {f"__{r}_0.distcp": 1000 + 37 * r for r in range(6)} | {".metadata": 40,
                                                                    "metadata.json": 2}
    split = digests.shares(sizes, ranks)
    assert len(split) == ranks
    assert sorted(name for share in split for name in share) == sorted(sizes)
    loads = [sum(sizes[name] for name in share) for share in split]
    # no share exceeds an equal share by more than one file (largest first, least loaded)
    assert max(loads) <= sum(sizes.values()) / ranks + max(sizes.values())
    assert split == digests.shares(dict(reversed(list(sizes.items()))), ranks)  # order-free


@pytest.mark.parametrize("workers", [1, 3])
def test_verify_names_every_changed_resized_and_missing_file(checkpoint, workers):
    directory, _ = checkpoint
    for rank in range(3):
        digests.write_part(str(directory), rank)
    digests.write_manifest(str(directory))
    (directory / "__1_0.distcp").write_bytes(b"b" * 499 + b"x")      # same size, changed
    (directory / "__2_0.distcp").unlink()
    (directory / "__0_0.distcp").write_bytes(b"a" * 120)
    (directory / "__1_1.distcp").write_bytes(b"")
    (directory / "metadata.json").write_bytes(b"{} ")
    with pytest.raises(IntegrityError) as refused:
        digests.verify(str(directory), workers=workers)
    message = str(refused.value)
    assert message.startswith("5 file(s) do not match integrity.json: "), message
    assert "__1_0.distcp: hash mismatch (expected " in message
    assert "__2_0.distcp: file missing or unreadable" in message
    assert "__0_0.distcp: truncated (120 bytes, 300 saved)" in message
    assert "__1_1.distcp: empty (0 bytes, 10 saved)" in message
    assert "metadata.json: longer than saved (3 bytes, 2 saved)" in message


def test_a_manifest_without_sizes_is_checked_by_digest_alone(checkpoint):
    """megatron-core's manifest (no sizes): a truncated file is a hash mismatch."""
    from mimo_train import mcore  # noqa: F401  (megatron-core imported quietly)
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    directory, _ = checkpoint
    save_integrity_manifest(str(directory))
    digests.verify(str(directory))
    (directory / "__0_0.distcp").write_bytes(b"a" * 120)
    with pytest.raises(IntegrityError, match=r"__0_0.distcp: hash mismatch \(expected "):
        digests.verify(str(directory))


def test_verify_refuses_an_unreadable_manifest(checkpoint):
    directory, _ = checkpoint
    (directory / "integrity.json").write_text("{not json")
    with pytest.raises(IntegrityError, match="integrity.json is unreadable"):
        digests.verify(str(directory))


def test_a_manifest_of_another_algorithm_is_refused_naming_it(checkpoint):
    """A manifest whose digests are not SHA-256 (``"algorithm": "md5"``) is refused naming its
    algorithm, not reported as a hash mismatch of every file."""
    directory, files = checkpoint
    (directory / "integrity.json").write_text(json.dumps(
        {"algorithm": "md5", "files": {name: hashlib.md5(data).hexdigest()
                                       for name, data in files.items()}}))
    with pytest.raises(IntegrityError) as refused:
        digests.verify(str(directory))
    assert str(refused.value) == (f"{directory / 'integrity.json'} uses 'md5', this reader "
                                  "knows 'sha256'")


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_raises_for_a_file_damaged_in_any_ranks_share(checkpoint, monkeypatch, rank):
    """Two ranks verify a checkpoint, each hashing its share, and exchange their verdicts: the
    rank whose share is sound raises the same error as the rank that found the damaged file
    (else it would go on loading while the other stops). In process: the process group
    stubbed, the other rank's verdicts its share's own."""
    from mimo_train.runtime import distributed

    directory, _ = checkpoint
    for writer in range(3):
        digests.write_part(str(directory), writer)
    digests.write_manifest(str(directory))
    expected, sizes = digests.read_manifest(str(directory))
    split = digests.shares(sizes, 2)
    assert "__1_0.distcp" in split[1]
    (directory / "__1_0.distcp").write_bytes(b"b" * 499 + b"x")      # in rank 1's share
    assert digests.mismatches(str(directory), split[0], expected, sizes) == []   # 0's: sound
    monkeypatch.setattr(distributed, "together", lambda: True)
    monkeypatch.setattr(distributed, "rank_and_size", lambda: (rank, 2))
    monkeypatch.setattr(distributed, "gather", lambda mine: [
        mine if r == rank else digests.mismatches(str(directory), split[r], expected, sizes)
        for r in range(2)])
    with pytest.raises(IntegrityError, match=r"^1 file\(s\) do not match integrity.json: "
                       r"__1_0.distcp: hash mismatch \(expected "):
        digests.verify(str(directory))


def test_a_bases_digest_covers_the_weight_files_transformers_loads(tmp_path, monkeypatch):
    """A LoRA base's digest (``weights_digest``): over the files transformers loads, so a
    ``.bin`` or ``consolidated.safetensors`` beside them changes nothing, a changed shard
    does; a hub cache's snapshot file is named by its blob (the file's SHA-256), not hashed
    again."""
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}

    def model(name: str, files: dict[str, bytes]) -> str:
        folder = tmp_path / name
        folder.mkdir()
        for file, data in files.items():
            (folder / file).write_bytes(data)
        return str(folder)

    single = digests.weights_digest(model("single", {"model.safetensors": b"w"}))
    assert digests.weights_digest(model("both", {"model.safetensors": b"w",
                                                 "pytorch_model.bin": b"other"})) == single
    assert digests.weights_digest(model("changed", {"model.safetensors": b"v"})) != single
    shards = {"model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2"}
    sharded = digests.weights_digest(model("sharded", {
        **shards, "model.safetensors.index.json": json.dumps(index).encode(),
        "consolidated.safetensors": b"mistral's copy"}))
    assert sharded == digests.weights_digest(model("shards", shards))
    # a sharded save into a folder that held a single file leaves it: transformers loads it
    assert digests.weights_digest(model("resaved", {
        **shards, "model.safetensors.index.json": json.dumps(index).encode(),
        "model.safetensors": b"w"})) == single
    # huggingface_hub's cache: snapshots/COMMIT/model.safetensors -> ../../blobs/SHA256
    repo = tmp_path / "hub" / "models--org--base"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "c0ffee"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / _sha(b"w")).write_bytes(b"w")
    (snapshot / "model.safetensors").symlink_to(os.path.join("..", "..", "blobs", _sha(b"w")))
    # a link to a 64-hex name outside a hub cache's blobs is hashed: its content may be other
    elsewhere = tmp_path / "store"
    elsewhere.mkdir()
    (elsewhere / _sha(b"w")).write_bytes(b"not w")
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "model.safetensors").symlink_to(elsewhere / _sha(b"w"))
    assert digests.weights_digest(str(tmp_path / "linked")) != single
    hashed = []
    monkeypatch.setattr(digests, "file_sha256", lambda path: hashed.append(path) or "")
    assert digests.weights_digest(str(snapshot)) == single and hashed == []


def test_a_local_bases_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    """A local base's weights (``hf download --local-dir``: no hub blobs) are hashed once and
    their digest kept in the mimo cache by the file's identity and times; a rewrite of the
    same size is hashed again, and a file changed in the last two seconds is not kept."""
    import time
    from types import SimpleNamespace

    from mimo_data.files import file_sha256
    monkeypatch.setenv("MIMO_CACHE_DIR", str(tmp_path / "cache"))
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"w" * 100)
    hashed = []
    monkeypatch.setattr(digests, "file_sha256", lambda path: hashed.append(path) or
                        file_sha256(path))
    monkeypatch.setattr(digests, "time", SimpleNamespace(time=time.time))
    first = digests.weights_digest(str(base))            # just written: hashed, not kept
    assert digests.weights_digest(str(base)) == first and len(hashed) == 2
    monkeypatch.setattr(digests, "time", SimpleNamespace(time=lambda: time.time() + 60))
    assert [digests.weights_digest(str(base)) for _ in range(3)] == [first] * 3
    assert len(hashed) == 3 and len(os.listdir(tmp_path / "cache" / "file-digests")) == 1
    (base / "model.safetensors").write_bytes(b"v" * 100)      # same size, other weights
    changed = digests.weights_digest(str(base))
    assert changed != first and changed == digests.weights_digest(str(base)) and len(hashed) == 4
    # written again with its times set back (cp -p, rsync -t): the ctime tells it apart
    before = os.stat(base / "model.safetensors")
    time.sleep(0.01)
    (base / "model.safetensors").write_bytes(b"u" * 100)
    os.utime(base / "model.safetensors", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert digests.weights_digest(str(base)) not in (first, changed) and len(hashed) == 5
