"""``mimo-shard index``: existing WebDataset and Energon tars indexed where they are.

The tars are written by webdataset's own ``ShardWriter`` with real corpus photos, in
img2dataset's layout (``KEY.jpg`` + ``KEY.txt`` + ``KEY.json``) and in a conversation layout
(``KEY.json`` with a conversation, ``KEY.jpg`` or ``KEY.0.jpg``, ``KEY.1.png``); an Energon
folder is made by energon's own ``prepare``. Asserted:

- every kept sample's record (caption pair or conversation, media in marker order) and every
  member's bytes as the reader returns them equal the tar's own (read with ``tarfile``);
- a corrupt image, an image without its caption and a caption without its image are counted
  by reason and left out; a truncated tar keeps the samples it holds completely;
- nothing is written beside the tars (a read-only folder); without ``--output`` the index goes
  to the cache and the command says where; an interrupted run leaves no ``index.json``;
- the files are byte-identical whatever ``--workers``, and the same from the tars in a bucket;
- ``mimo-shard verify`` checks the tars where they are and names a changed member;
  ``mimo-inspect report`` on the conversations indexed in place equals the build's;
- training on the conversations indexed in place gives the losses of the same conversations
  built by ``mimo-shard build`` (within 1e-6), and resumes from its checkpoint;
- interleaved documents (``KEY.json`` with ``texts`` + ``images``) become the document records
  ``mimo-shard build`` makes of the same documents.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import stat
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import webdataset

from conftest import (REPO, chat, cli_main, file_bytes, flip_byte, read_json, scratch,
                      write_jsonl, write_tar)
from support.runs import assert_continues, copy_checkpoint, train, train_records

PER_TAR = 4
FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"
BUCKET = "mimo-test-shard-index"          # moto's buckets are process-wide: a name of its own
DATASET_FILES = ("index.json", "samples.parquet", "records.parquet", "report.json")
CONFIG = "images_language_noncolocated.yaml"
PREPROCESS = REPO / "configs" / "preprocess_images.yaml"    # CONFIG's own


@dataclass
class Pairs:
    src: Path                              # the img2dataset-style tars (read-only)
    out: Path                              # their index
    stderr: str
    captions: dict[str, str]               # key -> caption of every good sample
    members: dict[str, dict[str, bytes]]   # key -> its members, as the tars hold them
    listing: dict[str, tuple[int, int]]    # src files -> (size, mtime_ns) before indexing


def _extension(name: str) -> str:
    return "jpg" if name.endswith(".jpg") else name.rsplit(".", 1)[1]


def _tar_members(path: Path) -> dict[str, dict[str, bytes]]:
    """``{key: {suffix: bytes}}`` of a complete tar, read with ``tarfile`` (not mimo)."""
    found: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for info in tar:
            key, _, suffix = info.name.partition(".")
            member = tar.extractfile(info)
            assert member is not None
            found.setdefault(key, {})[suffix] = member.read()
    return found


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def _read_only(folder: Path) -> None:
    for path in [*folder.rglob("*"), folder]:
        path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH |
                   (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH if path.is_dir() else 0))


def _writable(folder: Path) -> None:
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _pair_tars(src: Path, photos: list[tuple]) -> tuple[dict[str, str], list[str]]:
    """img2dataset's layout: 10 good pairs, a corrupt image, an image without its caption and a
    caption without its image in tars of PER_TAR; then a tar of 3 pairs cut inside the third
    one's image and one of 2 pairs cut inside the header of the second one's caption. Returns
    the good samples' captions and the bad samples' keys."""
    captions = {}
    with webdataset.ShardWriter(str(src / "pairs-%06d.tar"), maxcount=PER_TAR,
                                verbose=0) as writer:
        for number, (name, data, _, _) in enumerate(photos[:13]):
            key = f"{number:09d}"
            caption = f"A photo of {name.rsplit('.', 1)[0].replace('_', ' ')}."
            meta = {"url": f"https://example.com/{name}", "key": key, "status": "success"}
            sample = {"__key__": key, _extension(name): data, "txt": caption, "json": meta}
            if number == 10:
                sample[_extension(name)] = data[:len(data) // 3]        # corrupt image
            elif number == 11:
                del sample["txt"]                                       # no caption
            elif number == 12:
                del sample[_extension(name)]                            # no image
            else:
                captions[key] = caption
            writer.write(sample)
    cut = src / "pairs-000004.tar"
    with webdataset.TarWriter(str(cut)) as writer:
        for number, (name, data, _, _) in enumerate(photos[13:16], start=13):
            writer.write({"__key__": f"{number:09d}", _extension(name): data,
                          "txt": f"Photo {number}."})
    whole = cut.read_bytes()
    last_image = whole.index(photos[15][1][:4096])
    cut.write_bytes(whole[:last_image + 1000])          # cut inside the third image's data
    cut = src / "pairs-000005.tar"
    with webdataset.TarWriter(str(cut)) as writer:
        for number, (name, data, _, _) in enumerate(photos[16:18], start=16):
            writer.write({"__key__": f"{number:09d}", _extension(name): data,
                          "txt": f"Photo {number}."})
    with tarfile.open(cut) as tar:
        last_caption = tar.getmember("000000017.txt").offset
    cut.write_bytes(cut.read_bytes()[:last_caption + 256])   # inside the last caption's header
    captions.update({f"{n:09d}": f"Photo {n}." for n in (13, 14, 16)})
    return captions, [f"{n:09d}" for n in (10, 11, 12, 15, 17)]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, corpus_photos) -> Pairs:
    from mimo_data.shards.in_place import IndexOptions, index
    root = tmp_path_factory.mktemp("index-pairs")
    src = root / "laion"
    src.mkdir()
    captions, _ = _pair_tars(src, corpus_photos)
    members: dict[str, dict[str, bytes]] = {}
    for path in sorted(src.glob("pairs-00000[0-3].tar")):
        members.update(_tar_members(path))
    listing = _listing(src)
    _read_only(src)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        index([str(src)], str(root / "index"), IndexOptions(workers=0, progress=False))
    yield Pairs(src, root / "index", err.getvalue(), captions, members, listing)
    _writable(src)


def test_pairs_become_caption_records_and_bad_samples_are_counted(pairs, corpus_photos,
                                                                 tmp_path):
    from mimo_data.shards import in_place
    from mimo_data.shards.reader import ShardReader
    from mimo_data.shards.stops import StrictStop

    assert "layout pairs (detected" in pairs.stderr
    report = json.loads((pairs.out / "report.json").read_text())
    by_reason = {reason: entry["count"] for reason, entry in report["skipped_by_reason"].items()}
    assert by_reason == {"corrupt_image": 1, "missing_text": 1, "missing_media": 1,
                         "truncated_tar": 2}
    first = {reason: entry["first"][0]["location"]
             for reason, entry in report["skipped_by_reason"].items()}
    assert first == {"corrupt_image": "pairs-000002.tar:000000010",
                     "missing_text": "pairs-000002.tar:000000011",
                     "missing_media": "pairs-000003.tar:000000012",
                     "truncated_tar": "pairs-000004.tar:000000015"}
    # each cut tar names the sample it ends in: inside an image's data, in a caption's header
    assert [(f["location"], f["detail"].endswith(f"the one being read ({f['location'][-9:]}) is "
                                                 "left out"))
            for f in report["skipped_by_reason"]["truncated_tar"]["first"]] == [
        ("pairs-000004.tar:000000015", True), ("pairs-000005.tar:000000017", True)]
    assert (report["records_read"], report["samples_written"]) == (18, 13)
    index = json.loads((pairs.out / "index.json").read_text())
    assert (index["version"], index["shard_root"]) == (2, str(pairs.src))
    assert [(s["name"], s["samples"]) for s in index["shards"]] == [
        ("pairs-000000.tar", 4), ("pairs-000001.tar", 4), ("pairs-000002.tar", 2),
        ("pairs-000003.tar", 0), ("pairs-000004.tar", 2), ("pairs-000005.tar", 1)]
    assert [s["bytes"] for s in index["shards"]] == [
        (pairs.src / s["name"]).stat().st_size for s in index["shards"]]
    sizes = {f"{n:09d}": meta for n, (_, _, meta, _) in enumerate(corpus_photos)}
    reader = ShardReader(str(pairs.out))
    records = [reader.record(position) for position in range(len(reader))]
    assert {r["key"]: r["text"] for r in records} == pairs.captions
    for record in records:
        assert record["kind"] == "caption" and "messages" not in record
        [item] = record["media"]
        assert (item["width"], item["height"]) == (sizes[record["key"]]["width"],
                                                   sizes[record["key"]]["height"])
        assert record["source"]["file"].startswith("pairs-")
        if record["source"]["file"] < "pairs-000004.tar":
            assert record["source"]["url"].startswith("https://example.com/")
    # --strict: the first record skipped stops it, no index written, no folder left
    with pytest.raises(StrictStop, match=r"^pairs-000002.tar:000000010: corrupt_image: .* "
                       r"\(--strict stops at the first bad record\)$"):
        with contextlib.redirect_stderr(io.StringIO()):
            in_place.index([str(pairs.src)], str(tmp_path / "strict"),
                           in_place.IndexOptions(workers=0, progress=False, strict=True))
    assert not (tmp_path / "strict").exists()
    # mimo-inspect sample --key of a sample the index skipped (its key, or TAR/KEY): why
    from mimo_data.inspect.cli import main as inspect_main
    config = REPO / "configs" / "preprocess.yaml"
    for key in ("000000010", "10", "pairs-000002.tar/000000010"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = inspect_main(["sample", str(pairs.out), "--key", key, "--config",
                                 str(config)])
        assert code == 2 and ": the index skipped the sample pairs-000002.tar/000000010 (pairs-" \
            "000002.tar:000000010: corrupt_image: " in err.getvalue(), (key, err.getvalue())


def test_tables_derived_on_first_use_hold_the_indexs_parquet_and_a_full_cache_is_skipped(
        pairs, tmp_path, monkeypatch, capsys):
    """A reader whose cache is elsewhere reads the tables the indexing wrote beside the index
    where they are. Without them (an index of an earlier mimo) a reader derives them (a Parquet
    batch at a time): the sample table holds samples.parquet's keys, shards and members, the
    records table records.parquet's bytes. Where the cache is full it warns, maps a temporary
    copy and leaves nothing there."""
    import pyarrow.parquet as pq

    from mimo_data import files
    from mimo_data.shards import cache
    from mimo_data.shards.reader import ShardReader

    own = ShardReader(str(pairs.out), cache_dir=str(tmp_path / "elsewhere"))
    assert {Path(own.table.path).parent, Path(own.records.path).parent} == {
        pairs.out / cache.DATASET_CACHE}
    assert not [path for path in (tmp_path / "elsewhere").rglob("*") if path.is_file()]
    earlier = tmp_path / "index"
    shutil.copytree(pairs.out, earlier)
    for table in (earlier / cache.DATASET_CACHE).glob("*.arrow"):
        table.unlink()
    monkeypatch.setattr(files, "PARQUET_BATCH", 4)          # 13 samples: four batches
    samples = pq.read_table(earlier / "samples.parquet").to_pylist()
    records = pq.read_table(earlier / "records.parquet").column("json").to_pylist()
    write_table = cache.write_table

    def full_disk(path, *args):
        if path.startswith(str(tmp_path / "full")):
            raise OSError(28, "No space left on device")
        write_table(path, *args)
    monkeypatch.setattr(cache, "write_table", full_disk)
    for folder, saved in (("fresh", True), ("full", False)):
        reader = ShardReader(str(earlier), cache_dir=str(tmp_path / folder))
        assert (reader.table.path is not None, reader.records.path is not None) == (saved, saved)
        table = reader.table
        assert [table.key(p) for p in range(len(table))] == [row["key"] for row in samples]
        assert [table.shard(p) for p in range(len(table))] == [row["shard"] for row in samples]
        for position, row in enumerate(samples):
            start, stop = table.member_starts[position], table.member_starts[position + 1]
            assert [(table.member_names[table.member_name_ids[i]], table.member_offsets[i],
                     table.member_sizes[i], table.member_crcs[i]) for i in range(start, stop)] \
                == [(m["name"], m["offset"], m["size"], m["crc32"]) for m in row["members"]]
        assert [reader.records[p] for p in range(len(reader))] == records
    assert capsys.readouterr().err.count("could not save") == 2
    assert [path.name for path in (tmp_path / "full").rglob("*") if path.is_file()] == []


def test_a_read_error_while_deriving_a_table_is_itself_not_a_full_cache(tmp_path, capsys):
    """Only a cache that cannot take the table (full, read-only) sends the table to a temporary
    copy; an error reading what it is derived from (a shard's URL) reaches the caller as is,
    once."""
    from mimo_data.shards import cache
    from mimo_data.shards.storage import StorageError

    calls = []

    def derive(path):
        calls.append(path)
        raise StorageError("s3://bucket/ds/samples.parquet: read failed after 5 tries")
    with pytest.raises(StorageError, match="s3://bucket/ds/samples.parquet"):
        cache.obtain(str(tmp_path / "ds"), "samples-x.arrow", "v2-x", cache.Labels("samples", "x"),
                     derive, str(tmp_path / "cache"))
    assert len(calls) == 1 and "could not save" not in capsys.readouterr().err


def test_the_reader_returns_the_tars_bytes(pairs):
    from mimo_data.shards.reader import ShardReader

    reader = ShardReader(str(pairs.out))
    checked = 0
    for position in range(len(reader)):
        key = reader.table.key(position)
        if key not in pairs.members:        # the truncated tar: tarfile cannot list it
            continue
        for suffix, data in pairs.members[key].items():
            assert reader.read_member(position, suffix) == data, (key, suffix)
            checked += 1
        record = reader.record(position)
        assert reader.media(position, record) == {
            item["member"]: pairs.members[key][item["member"]] for item in record["media"]}
    assert checked == 10 * 3


def test_nothing_is_written_beside_the_tars(pairs, capsys, tmp_path, monkeypatch):
    """The source folder is read-only: its files are the same after two indexings (the second
    without --output: into the cache, which the command names)."""
    assert _listing(pairs.src) == pairs.listing
    monkeypatch.setenv("MIMO_CACHE_DIR", str(tmp_path / "cache"))
    code, _, err = cli_main(capsys, "index", pairs.src, "--workers", "0", "--no-progress")
    assert code == 0, err
    where = err.split("no --output: the index goes to ")[1].split("\n")[0]
    assert Path(where).parent == tmp_path / "cache" / "indexes"
    assert (Path(where) / "index.json").is_file()
    assert _listing(pairs.src) == pairs.listing
    code, out, _ = cli_main(capsys, "info", where)              # says where the tars are
    assert code == 0 and f"\ntars      {pairs.src} (indexed where they are" in out, out
    # the tars' folder given where the index is meant: the index it has is named
    code, _, err = cli_main(capsys, "info", pairs.src)
    assert code == 1 and f"`mimo-shard index {pairs.src}` (no --output) wrote their index " \
        f"to {where}: give that folder instead" in err, err
    assert "\nindexed   " in out and "\nbuild " not in out, out
    # again: the folder it names is the cache's, not an --output the command was not given
    code, _, err = cli_main(capsys, "index", pairs.src, "--workers", "0", "--no-progress")
    assert code == 2 and f"error: the index folder {where} (no --output given) already holds " \
        "an index of these tars, read the same way; train from it as it is, pass --overwrite" \
        in err, err
    # an index older than an option (not recorded: its default then), or one made with
    # --strict that skipped nothing, is the same; the option given now is not
    written = (Path(where) / "index.json").read_bytes()
    older = json.loads(written)
    del older["build"]["markers_first"], older["build"]["check"]
    older["build"]["strict"] = True
    older["report"]["records_skipped"] = 0
    (Path(where) / "index.json").write_text(json.dumps(older))
    code, _, err = cli_main(capsys, "index", pairs.src, "--workers", "0", "--no-progress")
    assert code == 2 and "an index of these tars, read the same way" in err, err
    code, _, err = cli_main(capsys, "index", pairs.src, "--check", "header", "--workers", "0",
                            "--no-progress")
    (Path(where) / "index.json").write_bytes(written)
    assert code == 2 and "read another way (check 'decode' then, 'header' now)" in err, err
    # the same tars read another way: said, not "as it is"
    code, _, err = cli_main(capsys, "index", pairs.src, "--text-member", "json[url]",
                            "--check", "header", "--workers", "0", "--no-progress")
    assert code == 2 and "already holds an index of these tars read another way (text_member " \
        "'txt' then, 'json[url]' now; check 'decode' then, 'header' now); pass " \
        "--overwrite" in err, err
    # the folder grown by a tar since (a copy: the fixture's stays as it is): said, not "as it is"
    grown = tmp_path / "grown"
    shutil.copytree(pairs.src, grown)
    assert cli_main(capsys, "index", grown, "-o", tmp_path / "grown-idx", "--workers", "0",
                    "--no-progress")[0] == 0
    shutil.copy(grown / "pairs-000000.tar", grown / "pairs-000009.tar")
    code, _, err = cli_main(capsys, "index", grown, "-o", tmp_path / "grown-idx")
    assert code == 2 and f"--output {tmp_path / 'grown-idx'} already holds an index of other " \
        "tars: the sources now have 1 tar(s) it lacks (pairs-000009.tar); pass --overwrite" \
        in err, err
    code, _, err = cli_main(capsys, "index", pairs.src, "--output", pairs.src / "idx")
    assert code == 2 and "nothing is written beside the shards" in err
    # two folders (two downloads), or a folder and a tar: one folder at a time, not a traceback
    for sources in ([pairs.src, pairs.src.parent], [pairs.src, pairs.src / "pairs-000000.tar"]):
        code, _, err = cli_main(capsys, "index", *sources, "--output", tmp_path / "two")
        assert code == 2 and f"{sources[0]} is a folder, given with other sources" in err, err
        assert "Traceback" not in err and not (tmp_path / "two").exists()
    code, _, err = cli_main(capsys, "index", pairs.src.parent / "*", "--output", tmp_path / "two")
    assert code == 2 and f"matches the folder {pairs.src.parent}" in err, err
    # `index SRC OUT` as cp reads it: the output named as an option to give
    code, _, err = cli_main(capsys, "index", pairs.src, tmp_path / "out")
    assert code == 2 and f"{tmp_path / 'out'}: no such tar or folder to index; to write the " \
        f"index there, give it as --output: mimo-shard index {pairs.src} --output " \
        f"{tmp_path / 'out'}" in err, err
    # with --output given, a missing tar is a missing tar
    code, _, err = cli_main(capsys, "index", pairs.src / "pairs-000000.tar", tmp_path / "no",
                            "--output", tmp_path / "out")
    assert code == 2 and "give it as --output" not in err and f"{tmp_path / 'no'}: no such " \
        "file" in err, err


def test_tars_it_keeps_nothing_of_leave_their_report_alone(pairs, capsys, tmp_path):
    """As a build: exit 1 naming the report, no dataset, and the indexing of the fixed tars
    goes to the same output without --overwrite; over an index (--overwrite), that stays."""
    write_tar(tmp_path / "bad" / "data-000000.tar",
              {"a.jpg": b"not a jpeg", "a.txt": b"a caption"})
    out = tmp_path / "index"
    code, _, err = cli_main(capsys, "index", tmp_path / "bad", "--output", out, "--workers", "0",
                            "--no-progress")
    assert code == 1 and "no sample written, all 1 record(s) skipped" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "skipped.jsonl"]
    assert json.loads((out / "report.json").read_text())["skipped_by_reason"]["corrupt_image"]
    assert json.loads((out / "skipped.jsonl").read_text())["location"] == "data-000000.tar:a"
    code, _, err = cli_main(capsys, "index", pairs.src, "--output", out, "--workers", "0",
                            "--no-progress")
    assert code == 0 and json.loads((out / "index.json").read_text())["totals"]["samples"], err
    # with --overwrite over that index: it stays whole, the report beside it, named
    before = file_bytes(out)
    code, _, err = cli_main(capsys, "index", tmp_path / "bad", "--output", out, "--workers",
                            "0", "--no-progress", "--overwrite")
    assert code == 1 and f"(see {out / 'report.failed.json'}; skipped.failed.jsonl beside it " \
        f"lists every skipped record); the index at {out} is as it was" in err, err
    assert json.loads((out / "report.failed.json").read_text())["records_skipped"] == 1
    failed = ("report.failed.json", "skipped.failed.jsonl")
    assert {n: b for n, b in file_bytes(out).items() if n not in failed} == before
    code, _, err = cli_main(capsys, "index", pairs.src, "--output", out, "--workers", "0",
                            "--no-progress", "--overwrite")
    assert code == 0 and not any((out / name).exists() for name in failed), err
    # a disk that fills up: exit 1 saying so, the index there whole
    from mimo_data.shards import in_place

    def disk_full(self, *_):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / ".staging" / "x"))

    before = file_bytes(out)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(in_place._Tables, "add", disk_full)
        code, _, err = cli_main(capsys, "index", pairs.src, "--output", out, "--workers", "0",
                                "--no-progress", "--overwrite")
    assert code == 1 and f"error: no room left on the disk of --output {out} (No space left " \
        "on device, writing x): " in err, err
    assert "the dataset there is as it was" in err and file_bytes(out) == before


def test_the_index_is_the_same_whatever_the_workers(pairs, capsys, tmp_path):
    code, _, err = cli_main(capsys, "index", pairs.src, "--output", tmp_path / "w2",
                            "--workers", "2", "--no-progress")
    assert code == 0, err
    assert "records/s" in err and "per worker (2 worker(s))" in err
    for name in DATASET_FILES:
        assert (tmp_path / "w2" / name).read_bytes() == (pairs.out / name).read_bytes(), name
    tables = sorted(p.name for p in (pairs.out / ".mimo-cache").iterdir())
    assert [n.split("-")[0] for n in tables] == ["records", "samples"]
    for name in tables:
        assert (tmp_path / "w2" / ".mimo-cache" / name).read_bytes() == \
            (pairs.out / ".mimo-cache" / name).read_bytes(), name


def test_an_interrupted_run_leaves_no_index(pairs, tmp_path, monkeypatch):
    from mimo_data.shards import in_place

    real, calls = in_place.index_shard, []

    def interrupted(job):
        calls.append(job.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(job)
    monkeypatch.setattr(in_place, "index_shard", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        in_place.index([str(pairs.src)], str(out),
                       in_place.IndexOptions(workers=0, progress=False))
    assert not out.exists()        # nothing left, the folder it made neither
    monkeypatch.setattr(in_place, "index_shard", real)
    in_place.index([str(pairs.src)], str(out), in_place.IndexOptions(workers=0, progress=False))
    assert (out / "index.json").read_bytes() == (pairs.out / "index.json").read_bytes()


def test_readers_refuse_an_index_they_cannot_place(pairs):
    from mimo_data.shards.index import DatasetError, parse_index

    index = json.loads((pairs.out / "index.json").read_text())
    with pytest.raises(DatasetError, match="without its shard_root"):
        parse_index("x", json.dumps({**index, "shard_root": None}).encode())
    with pytest.raises(DatasetError, match="version 3; this mimo reads 'mimo-shards' "
                                           "versions 1, 2"):
        parse_index("x", json.dumps({**index, "version": 3}).encode())


def test_tars_in_a_bucket_give_the_same_index(pairs, local_s3, tmp_path, monkeypatch):
    import fsspec

    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.reader import ShardReader
    local_s3.make_bucket(BUCKET)
    fs = fsspec.filesystem("s3", **local_s3.storage_options)
    for path in sorted(pairs.src.glob("*.tar")):
        fs.pipe_file(f"{BUCKET}/laion/{path.name}", path.read_bytes())
    # left out as a local folder's walk leaves them (the index's bytes equal the local one's,
    # below): a hidden folder's tar, macOS's ._NAME beside a tar, a hidden tar
    fs.pipe_file(f"{BUCKET}/laion/.old/{path.name}", path.read_bytes())
    fs.pipe_file(f"{BUCKET}/laion/._{path.name}", b"\x00\x05\x16\x07Mac OS X")
    fs.pipe_file(f"{BUCKET}/laion/.{path.name}", path.read_bytes())
    url = f"s3://{BUCKET}/laion"
    monkeypatch.setenv("MIMO_CACHE_DIR", str(tmp_path / "cache"))
    index([url], str(tmp_path / "idx"), IndexOptions(workers=0, progress=False),
          local_s3.storage_options)
    from mimo_data.shards.tar_sources import IndexInputError, _glob
    # a pattern leaves hidden names out as Python's glob does (fsspec's matches them)
    assert [p.rpartition("/")[2] for p in _glob(f"{url}/*.tar", local_s3.storage_options)] \
        == sorted(p.name for p in pairs.src.glob("*.tar"))
    with pytest.raises(IndexInputError, match=f"{url} is a folder, given with other sources"):
        index([url, f"{url}/pairs-000000.tar"], str(tmp_path / "two"),
              IndexOptions(workers=0, progress=False), local_s3.storage_options)
    # an index to a bucket (taken for ./s3:/... before), a bucket that is not there: said
    with pytest.raises(IndexInputError, match=f"--output {url}-idx: the index goes to a local "
                       "directory"):
        index([url], f"{url}-idx", IndexOptions(workers=0, progress=False),
              local_s3.storage_options)
    with pytest.raises(IndexInputError, match="^s3://mimo-no-such-bucket/laion: not there .*"
                       "check the bucket and the prefix"):
        index(["s3://mimo-no-such-bucket/laion"], str(tmp_path / "none"),
              IndexOptions(workers=0, progress=False), local_s3.storage_options)
    for tars in ("s3://mimo-no-such-bucket/laion/shard-{000000..000001}.tar",
                 "s3://mimo-no-such-bucket/laion/*.tar"):
        with pytest.raises(IndexInputError, match=r"^s3://mimo-no-such-bucket/laion/shard-000000"
                           r"\.tar: its bucket does not exist at the endpoint http://127\.0\.0\.1:"
                           r"\d+: check the URL and the endpoint$"
                           if "{" in tars else r"^s3://mimo-no-such-bucket/laion/\*\.tar: its "
                           "bucket does not exist"):
            index([tars], str(tmp_path / "none"), IndexOptions(workers=0, progress=False),
                  local_s3.storage_options)
    with pytest.raises(IndexInputError, match=re.escape(
            f"{url}/pairs-000009.tar: no such file (of the pattern {url}/pairs-00000{{0,9}}.tar)")):
        index([f"{url}/pairs-00000{{0,9}}.tar"], str(tmp_path / "none"),
              IndexOptions(workers=0, progress=False), local_s3.storage_options)
    for name in ("samples.parquet", "records.parquet", "report.json"):
        assert (tmp_path / "idx" / name).read_bytes() == (pairs.out / name).read_bytes()
    assert json.loads((tmp_path / "idx" / "index.json").read_text())["shard_root"] == url
    # the sources as given are recorded (a pattern, not the folder it names tars of)
    pattern = f"{url}/pairs-00000{{0..1}}.tar"
    index([pattern], str(tmp_path / "pattern"), IndexOptions(workers=0, progress=False),
          local_s3.storage_options)
    built = json.loads((tmp_path / "pattern" / "index.json").read_text())
    assert (built["build"]["inputs"], built["shard_root"], len(built["shards"])) == (
        [pattern], url, 2)
    shutil.rmtree(tmp_path / "idx" / ".mimo-cache")     # derived again by the reader
    reader = ShardReader(str(tmp_path / "idx"), storage_options=local_s3.storage_options)
    reader.prefetch(range(len(reader)))
    for position in range(4):
        key = reader.table.key(position)
        record = reader.record(position)
        assert reader.media(position, record) == {
            item["member"]: pairs.members[key][item["member"]] for item in record["media"]}
    reader.close()
    # a tar written again in the bucket since its indexing, its size the same (a caption
    # edited: training reads the text from the index, the old one): its ETag differs, so its
    # samples' text is read at start-up; the same bytes written again keep it (S3's ETag is
    # their MD5): nothing read
    from mimo_data.shards.index import DatasetError
    tar = bytearray((pairs.src / "pairs-000000.tar").read_bytes())
    key, (offset, _, _) = reader.table.key(0), reader.table.members(0)["txt"]
    tar[offset] ^= 0xFF
    fs.pipe_file(f"{BUCKET}/laion/pairs-000000.tar", bytes(tar))
    with pytest.raises(DatasetError, match=rf"pairs-000000.tar: sample {key} member {key}.txt: "
                       "its bytes changed"):
        ShardReader(str(tmp_path / "idx"),
                    storage_options=local_s3.storage_options).check_shards()
    tar[offset] ^= 0xFF
    fs.pipe_file(f"{BUCKET}/laion/pairs-000000.tar", bytes(tar))
    read: list = []
    monkeypatch.setattr(ShardReader, "read_member", lambda self, *member: read.append(member))
    ShardReader(str(tmp_path / "idx"), storage_options=local_s3.storage_options).check_shards()
    assert read == []
    monkeypatch.undo()
    # tars on an HTTP server: the version is its ETag (fsspec's HTTP file keeps none: looked
    # up), and a text byte changed behind it is found the same way
    from tools.object_store import LocalHTTP
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(pairs.src / "pairs-000000.tar", served)
    with LocalHTTP(served) as http, contextlib.redirect_stderr(io.StringIO()):
        index([f"{http.url}/pairs-000000.tar"], str(tmp_path / "http-idx"),
              IndexOptions(workers=0, progress=False))
        [shard] = json.loads((tmp_path / "http-idx" / "index.json").read_text())["shards"]
        assert shard["version"].startswith("etag "), shard
        flip_byte(served / "pairs-000000.tar", offset)
        with pytest.raises(DatasetError, match=rf"sample {key} member {key}.txt: its bytes "
                           "changed"):
            ShardReader(str(tmp_path / "http-idx")).check_shards()


@pytest.mark.filterwarnings(FORK_WARNING)       # energon prepare's worker pool
def test_an_energon_folder_is_read_by_its_field_map(pairs, tmp_path, capsys):
    """``energon prepare`` (its own CLI, in process) on two of the good tars with a
    CaptioningSample field map reading the caption from the JSON member."""
    from megatron.energon.tools.prepare import command

    folder = tmp_path / "energon"
    folder.mkdir()
    for name in ("pairs-000000.tar", "pairs-000001.tar"):
        members = _tar_members(pairs.src / name)
        with webdataset.TarWriter(str(folder / name)) as writer:
            for key, sample in members.items():
                meta = {**json.loads(sample["json"]), "caption": sample["txt"].decode()}
                writer.write({"__key__": key, "jpg": sample["jpg"], "json": meta}
                             if "jpg" in sample else
                             {"__key__": key, "png": sample["png"], "json": meta})
    command.main(args=[str(folder), "--non-interactive", "--split-ratio", "1,0,0",
                       "--sample-type", "CaptioningSample", "--num-workers", "1",
                       "--field-map", '{"image": "jpg,png", "caption": "json[caption]"}'],
                 standalone_mode=False)
    assert (folder / ".nv-meta" / "split.yaml").is_file()
    with open(folder / ".nv-meta" / "dataset.yaml", "a") as dataset:   # not used by mimo
        dataset.write("subflavors: {source: coco}\n")
    written = (folder / ".nv-meta" / "dataset.yaml").read_text()
    (folder / ".nv-meta" / "dataset.yaml").write_text(written.replace(
        "field_map:\n", "field_map:\n  alt: json[alt_text]\n"))
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 0, err
    assert "layout energon" in err and "dataset.yaml's subflavors are not read" in err, err
    assert f"{folder / '.nv-meta' / 'dataset.yaml'}: field_map.alt names no field of a " \
        "CaptioningSample (its fields: image, caption; Energon refuses it): not read" in err, err
    (folder / ".nv-meta" / "dataset.yaml").write_text(written)
    assert "warning" not in err, err        # the tars hold what energon prepare counted
    from mimo_data.shards.reader import ShardReader
    reader = ShardReader(str(tmp_path / "idx"))
    records = [reader.record(p) for p in range(len(reader))]
    assert {r["key"]: r["text"] for r in records} == {
        key: text for key, text in pairs.captions.items() if int(key) < 8}
    assert all(r["kind"] == "caption" for r in records)
    # its metadata folder given for a dataset: the dataset to index named, not a build of the
    # .info.json in it
    code, _, err = cli_main(capsys, "info", folder / ".nv-meta")
    assert code == 2 and err.strip().endswith(
        f"{folder / '.nv-meta'} is the metadata folder of the Energon dataset {folder}, not a "
        f"dataset mimo reads: index that dataset where it is (`mimo-shard index {folder} "
        "--output DIR`) and give DIR"), err
    # a folder of its tars given (not indexed): the dataset to index is named, not the folder
    # (which mimo-shard index refuses, being inside it)
    (folder / "more").mkdir()
    shutil.copy(folder / "pairs-000000.tar", folder / "more")
    for given in (folder / "more", "more"):        # a relative path too
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(folder)
            code, _, err = cli_main(capsys, "info", given)
        assert f"tars with no index.json, of the Energon dataset {folder}: index that " \
            f"dataset where it is (`mimo-shard index {folder} --output DIR`) and give DIR" \
            in err, err
    shutil.rmtree(folder / "more")
    # members named on the command line are the field map's to name (unless --layout says
    # otherwise), and a tar split.yaml lists must be there
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx-named",
                            "--text-member", "json[alt_text]", "--workers", "0", "--no-progress")
    assert code == 2 and "--text-member: an Energon folder's field_map names" in err, err
    split = (folder / ".nv-meta" / "split.yaml").read_text()
    (folder / ".nv-meta" / "split.yaml").write_text(
        split.replace("pairs-{000000..000001}.tar", "pairs-{000000..000001}.tar\n  - "
                      "pairs-000009.tar"))
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx-named",
                            "--workers", "0", "--no-progress")
    assert code == 2 and "lists 1 tar(s) not in" in err and "pairs-000009.tar" in err, err
    (folder / ".nv-meta" / "split.yaml").write_text(split)
    # a tar changed since energon prepare counted its samples is said, and indexed as it is
    info = json.loads((folder / ".nv-meta" / ".info.json").read_text())
    assert info["shard_counts"] == {"pairs-000000.tar": 4, "pairs-000001.tar": 4}
    (folder / ".nv-meta" / ".info.json").write_text(json.dumps(
        {**info, "shard_counts": {**info["shard_counts"], "pairs-000000.tar": 40}}))
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx-changed",
                            "--workers", "0", "--no-progress")
    assert code == 0 and "warning: 1 tar(s) hold another number of samples than " \
        f"{folder / '.nv-meta' / '.info.json'} says (pairs-000000.tar: 4, it says 40)" in err, err
    # counts that do not read are said, and index nothing less
    (folder / ".nv-meta" / ".info.json").write_text(json.dumps(
        {**info, "shard_counts": {**info["shard_counts"], "pairs-000000.tar": None}}))
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx-unread",
                            "--workers", "0", "--no-progress")
    assert code == 0 and ".info.json: not read as energon prepare's sample counts" in err \
        and "the tars' sample counts are not checked" in err, err
    (folder / ".nv-meta" / ".info.json").write_text(json.dumps(info))
    # A tar split.yaml does not list (another split's) is left out under any --layout; a JSON
    # member without the first alternative's field falls back to the next one (Energon's way).
    shutil.copy(pairs.src / "pairs-000002.tar", folder / "val-000000.tar")
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx-pairs",
                            "--layout", "pairs", "--text-member", "json[alt_text],json[caption]",
                            "--workers", "0", "--no-progress")
    assert code == 0, err
    assert "2 train tar(s) of" in err and "split.yaml" in err
    reader = ShardReader(str(tmp_path / "idx-pairs"))
    assert {reader.record(p)["key"]: reader.record(p)["text"] for p in range(len(reader))} == {
        key: text for key, text in pairs.captions.items() if int(key) < 8}
    # --split val: the validation split's tars (a data.valid set), the train split's left out
    (folder / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train: [pairs-000000.tar]\n  val: [pairs-000001.tar]\n  test: []\n")
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx-val",
                            "--split", "val", "--workers", "0", "--no-progress")
    assert code == 0 and "1 val tar(s)" in err, err
    reader = ShardReader(str(tmp_path / "idx-val"))
    assert {reader.record(p)["key"] for p in range(len(reader))} == {
        key for key in pairs.captions if 4 <= int(key) < 8}
    assert json.loads((tmp_path / "idx-val" / "index.json").read_text())["build"]["split"] == \
        "val"
    # a split it lacks (or one empty) names those it has; --split on other tars is refused
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx-test",
                            "--split", "test", "--workers", "0", "--no-progress")
    assert code == 2 and "no test split_parts (its splits: train, val: --split names one)" \
        in err, err
    code, _, err = cli_main(capsys, "index", pairs.src, "--output", tmp_path / "idx-other",
                            "--split", "val", "--workers", "0", "--no-progress")
    assert code == 2 and "--split val: a split of an Energon dataset's split.yaml" in err, err
    code, _, err = cli_main(capsys, "index", tmp_path, "--output", tmp_path / "idx-above",
                            "--split", "val", "--workers", "0", "--no-progress")
    assert code == 2 and f"holds the Energon dataset {folder}: give that folder" in err, err
    (folder / ".nv-meta" / "split.yaml").write_text(split)


@pytest.mark.parametrize("dataset, why", [
    ("__module__: megatron.energon\n__class__: CrudeWebdataset\nsubflavors: {}\n",
     "a CrudeSample's samples are made by code mimo does not run"),
    ("sample_type: {__module__: megatron.energon, __class__: CaptioningSample}\n"
     "sample_loader: sample_loader.py:sample_loader\npart_filter: sample_loader.py:part_filter\n",
     "a sample_loader is Python code mimo does not run"),
    ("sample_type: {__module__: megatron.energon, __class__: InterleavedSample}\n"
     "field_map: {sequence: json}\n", "sample type InterleavedSample with fields sequence"),
    # one of Energon's own sample types is no misspelling of one mimo reads
    ("sample_type: {__module__: megatron.energon, __class__: OCRSample}\n"
     "field_map: {image: jpg, text: txt}\n", "sample type OCRSample with fields image, text"),
    # a class of one's own named as Energon's: not read as Energon's
    ("sample_type: {__module__: my_project.samples, __class__: CaptioningSample}\n"
     "field_map: {image: jpg, caption: txt}\n", "sample type my_project.samples."
     "CaptioningSample, a class of your own (not Energon's)")])
def test_an_energon_dataset_mimo_cannot_read_is_refused_with_what_to_do(tmp_path, dataset, why):
    from mimo_data.shards import energon
    from mimo_data.shards.sources import SourceError

    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "dataset.yaml").write_text(dataset)
    with pytest.raises(SourceError) as caught:
        energon.member_map(str(tmp_path))
    assert why in str(caught.value) and "--layout pairs|conversation|documents" in \
        str(caught.value), caught.value


@pytest.mark.parametrize("split, why", [
    ("exclude: parts/data-1.tar\nsplit_parts: {train: ['parts/data-{0..2}.tar']}\n",
     "exclude is 'parts/data-1.tar'; energon reads a list of tar names or brace patterns"),
    ("split_parts: {train: 'parts/data-{0..2}.tar'}\n",
     "split_parts.train is 'parts/data-{0..2}.tar'; energon reads a list of tar names or "
     "brace patterns (`train: [\"parts/data-{0..9}.tar\"]`, a pattern quoted inside [ ]"),
    # the advice taken as YAML would read it: the pattern quoted
    ("split_parts:\n  train: [parts/data-{0..2}.tar]\n",
     "not YAML (while parsing a flow sequence"),
    ("split_parts:\n  train: [parts/data-{0..2}.tar]\n",
     "a brace pattern inside [ ] must be quoted: [\"parts/data-{0..9}.tar\"]"),
    ("split_parts: {train: ['parts/data-{0..2.tar']}\n", "split_parts.train: Unbalanced braces"),
    ("split_parts: {train: ['parts/data-{0..2}.tar', parts/data-0.tar]}\n",
     "split_parts.train lists parts/data-0.tar more than once")])
def test_a_split_yaml_energon_would_not_read_is_refused(tmp_path, split, why):
    """What energon refuses too (a string where a list belongs: read letter by letter, the
    excluded tar was trained on; an unbalanced brace; a brace pattern unquoted inside [ ],
    which YAML cannot read), and a tar listed twice (its samples read
    twice, the index's counts of it wrong): one error naming the key."""
    from mimo_data.shards import energon
    from mimo_data.shards.sources import SourceError

    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "split.yaml").write_text(split)
    with pytest.raises(SourceError, match=re.escape(why)):
        energon.split_tars(str(tmp_path))


def test_another_yaml_error_beside_a_mapping_in_a_list_says_nothing_of_braces(tmp_path):
    from mimo_data.shards import energon
    from mimo_data.shards.sources import SourceError

    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train: [{name: a}]\n  val: ['b\n")
    with pytest.raises(SourceError, match="found unexpected end of stream") as refused:
        energon.split_tars(str(tmp_path))
    assert "brace pattern" not in str(refused.value), refused.value


def test_a_field_map_naming_no_single_member_is_refused(tmp_path):
    """energon maps a field to one member name (alternatives comma-separated in it): a list
    is refused up front, not met by every worker."""
    from mimo_data.shards import energon
    from mimo_data.shards.sources import SourceError

    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type: {__module__: megatron.energon, __class__: CaptioningSample}\n"
        "field_map: {image: [jpg, png], caption: txt}\n")
    with pytest.raises(SourceError, match=re.escape("field_map.image is ['jpg', 'png']; "
                                                    "energon maps each field to one member")):
        energon.member_map(str(tmp_path))


def test_energon_split_excludes_drop_samples_and_are_counted(pairs, tmp_path):
    """split.yaml's ``exclude`` drops ``TAR/KEY`` samples as energon does (brace-expanded, TAR
    as split.yaml names it), counted by name in the report; one naming no sample is harmless.
    The dataset's tars, or their folder, given instead are refused."""
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.tar_sources import IndexInputError
    from mimo_data.shards.reader import ShardReader
    from mimo_data.shards.sources import SourceError

    (tmp_path / "ds" / "shards").mkdir(parents=True)
    (tmp_path / "ds" / ".nv-meta").mkdir()
    for number in (0, 1):
        shutil.copy(pairs.src / f"pairs-00000{number}.tar",
                    tmp_path / "ds" / "shards" / f"shard_00000{number}.tar")
    (tmp_path / "ds" / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type: {__module__: megatron.energon, __class__: CaptioningSample}\n"
        "field_map: {image: 'jpg,png', caption: txt}\n")
    (tmp_path / "ds" / ".nv-meta" / "split.yaml").write_text(
        "exclude: ['shards/shard_000000.tar/00000000{1,2}', 'shards/shard_000001.tar/nokey']\n"
        "split_parts: {train: ['shards/shard_{000000..000001}.tar'], val: [], test: []}\n")
    with contextlib.redirect_stderr(io.StringIO()):
        index([str(tmp_path / "ds")], str(tmp_path / "idx"),
              IndexOptions(workers=0, progress=False, check="header"))
    reader = ShardReader(str(tmp_path / "idx"))
    assert sorted(reader.record(p)["key"] for p in range(len(reader))) == [
        key for key in pairs.captions if int(key) < 8 and key not in ("000000001", "000000002")]
    excluded = json.loads((tmp_path / "idx" / "report.json").read_text())[
        "skipped_by_reason"]["excluded_by_split_yaml"]
    assert excluded["count"] == 2
    assert excluded["first"][0]["location"] == "shards/shard_000000.tar:000000001"
    assert [(entry["reason"], entry["location"]) for entry in map(json.loads, (
        tmp_path / "idx" / "skipped.jsonl").open())] == [
        ("excluded_by_split_yaml", f"shards/shard_000000.tar:00000000{n}") for n in (1, 2)]
    # mimo-inspect report counts them apart: the dataset's own choice fails no check (an
    # index that records no count, older than the check, neither)
    from mimo_data.inspect.checks import Thresholds
    from mimo_data.inspect.report import skipped_records
    check = skipped_records(str(tmp_path / "idx"), reader.index, Thresholds())
    assert check["passed"] and check["count"] == 0 and check["excluded_by_split_yaml"] == 2
    assert check["message"].endswith("within --max-skipped-records-fraction 0; 2 more left "
                                     "out by its split.yaml's excludes"), check["message"]
    assert skipped_records(str(tmp_path / "idx"), {}, Thresholds())["passed"]
    (tmp_path / "idx" / "report.json").rename(tmp_path / "report.json")   # not copied along
    assert skipped_records(str(tmp_path / "idx"), reader.index, Thresholds())[
        "excluded_by_split_yaml"] == 2
    (tmp_path / "report.json").rename(tmp_path / "idx" / "report.json")
    # a whole tar excluded: left out, and said
    split_yaml = tmp_path / "ds" / ".nv-meta" / "split.yaml"
    kept = split_yaml.read_text()
    split_yaml.write_text(kept.replace("'shards/shard_000001.tar/nokey'",
                                       "'shards/shard_000001.tar'"))
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        index([str(tmp_path / "ds")], str(tmp_path / "idx-one"),
              IndexOptions(workers=0, progress=False, check="header"))
    split_yaml.write_text(kept)
    assert f"{split_yaml}'s exclude leaves out 1 tar(s) of the train split: " \
        "shards/shard_000001.tar" in said.getvalue(), said.getvalue()
    assert len(ShardReader(str(tmp_path / "idx-one"))) == 2     # tar 0's 4, less the 2 keys
    # a field_map naming a member none of the first samples holds (caption: text, not txt):
    # refused before every tar is read and every record skipped
    dataset_yaml = tmp_path / "ds" / ".nv-meta" / "dataset.yaml"
    dataset_yaml.write_text(dataset_yaml.read_text().replace("caption: txt", "caption: text"))
    with pytest.raises(IndexInputError, match=f"shard_000000.tar: {dataset_yaml}'s field_map "
                       "caption text: none of its first .* samples holds that member"):
        index([str(tmp_path / "ds")], str(tmp_path / "misnamed"),
              IndexOptions(workers=0, progress=False, check="header"))
    dataset_yaml.write_text(dataset_yaml.read_text().replace("caption: text", "caption: txt"))
    # a metadataset's YAML given: told what to do
    metadataset = tmp_path / "metadataset.yaml"
    metadataset.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\n")
    with pytest.raises(IndexInputError, match="index each dataset folder it names"):
        index([str(metadataset)], str(tmp_path / "meta"), IndexOptions(workers=0,
                                                                       progress=False))
    # the dataset's own YAML given: its folder is named
    with pytest.raises(IndexInputError, match=f"a YAML file of the Energon dataset "
                       f"{tmp_path}/ds, not a tar: give that folder"):
        index([str(tmp_path / "ds" / ".nv-meta" / "dataset.yaml")], str(tmp_path / "meta"),
              IndexOptions(workers=0, progress=False))
    # its tars, or their folder, given instead of it, or a folder holding it: refused (naming
    # what was given), never read past split.yaml
    for given in (tmp_path / "ds" / "shards", tmp_path / "ds" / "shards" / "shard_000001.tar"):
        with pytest.raises(IndexInputError, match=f"^{given} is inside the Energon dataset "
                           f"{tmp_path}/ds"):
            index([str(given)], str(tmp_path / "tars"), IndexOptions(workers=0, progress=False))
    with pytest.raises(IndexInputError, match=f"holds the Energon dataset {tmp_path}/ds"):
        index([str(tmp_path)], str(tmp_path / "above"), IndexOptions(workers=0, progress=False))
    # one of its tars among others (a glob over datasets, or a list): that tar is named
    (tmp_path / "other").mkdir()
    shutil.copy(pairs.src / "pairs-000002.tar", tmp_path / "other" / "other-0.tar")
    inside = tmp_path / "ds" / "shards" / "shard_000001.tar"
    for given in ([str(tmp_path / "other" / "other-0.tar"), str(inside)],
                  [f"{tmp_path}/*/*/shard_000001.tar", f"{tmp_path}/other/*.tar"]):
        with pytest.raises(IndexInputError, match=f"^{inside} is inside the Energon dataset "
                           f"{tmp_path}/ds: .* \\(one of the 2 tars given\\)"):
            index(given, str(tmp_path / "tars"), IndexOptions(workers=0, progress=False))
    # a misspelt field: named, with the one meant
    dataset_yaml.write_text(dataset_yaml.read_text().replace("image:", "imgae:"))
    with pytest.raises(SourceError, match=re.escape(
            "field_map has no image, which a CaptioningSample needs; it has field_map.imgae, "
            "no field of a CaptioningSample (did you mean field_map.image?): set "
            "field_map.image in dataset.yaml, or index the folder with --layout pairs")):
        index([str(tmp_path / "ds")], str(tmp_path / "typo"), IndexOptions(workers=0,
                                                                           progress=False))


def test_a_compressed_tar_is_refused_not_read_as_truncated(pairs, tmp_path, capsys):
    """webdataset reads ``.tar.gz``, but a compressed tar's members have no byte offsets: the
    file is named and refused (exit 2, nothing written), not indexed as a tar cut short."""
    import gzip
    import zipfile

    (tmp_path / "gz").mkdir()
    packed = tmp_path / "gz" / "pairs-000000.tar.gz"
    packed.write_bytes(gzip.compress((pairs.src / "pairs-000000.tar").read_bytes()))
    plain = shutil.copy(pairs.src / "pairs-000000.tar", tmp_path / "gz" / "a.tar")
    for given in ([packed, "--layout", "pairs"], [packed], [plain, packed]):
        code, _, err = cli_main(capsys, "index", *given, "--output", tmp_path / "idx",
                                "--workers", "0", "--no-progress")
        assert code == 2 and f"{packed}: not a tar but gzip-compressed: decompress it into a " \
            f".tar (`gzip -dk {packed}`), then index that" in err, err
        assert not (tmp_path / "idx" / "index.json").exists()
    # a folder of both: refused, never its plain tars alone without a word
    code, _, err = cli_main(capsys, "index", tmp_path / "gz", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and "1 compressed tar(s) beside the 1 plain one(s) (e.g. " in err and \
        f"pairs-000000.tar.gz: decompress it into a .tar (`gzip -dk {packed}`), then index " \
        "that" in err, err
    os.remove(plain)
    code, _, err = cli_main(capsys, "index", tmp_path / "gz", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and "no *.tar files under it (1 compressed" in err, err
    # each compression's tar by its name's suffix, whatever its case, its tool's command
    # naming it; a zip given as a tar: unzipped
    from mimo_data.shards.tar_walk import not_in_place
    for name, command in (("a.TGZ", "gzip -dk a.TGZ"), ("a.tar.zst", "zstd -dk a.tar.zst"),
                          ("a.tar.bz2", "bzip2 -dk a.tar.bz2"), ("a.tar.xz", "xz -dk a.tar.xz")):
        assert not_in_place(name).startswith(f"decompress it into a .tar (`{command}`)"), name
    from mimo_data.files import compression_named, compression_suffix
    assert [compression_named(name) for name in ("a.TGZ", "a.tar.GZ", "a.Zip", "a.tar")] == \
        ["gzip", "gzip", "zip", None]
    assert compression_suffix("a.TAR.XZ") == ".xz" and compression_suffix("a.tar") == ""
    zipped = tmp_path / "gz" / "z.tar"
    with zipfile.ZipFile(zipped, "w") as archive:
        archive.write(pairs.src / "pairs-000000.tar", "pairs-000000.tar")
    code, _, err = cli_main(capsys, "index", zipped, "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and f"{zipped}: not a tar but a zip file: unzip it" in err, err
    # gzip bytes named .tar (gzip -dk refuses a name without .gz): written to another name
    disguised = tmp_path / "gz" / "s.tar"
    disguised.write_bytes(packed.read_bytes())
    code, _, err = cli_main(capsys, "index", disguised, "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and f"(`gzip -dc {disguised} > {tmp_path / 'gz' / 's'}.plain.tar`)" \
        in err, err
    # img2dataset's folder: a Parquet of each tar's metadata beside it, a glob taking both
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "i2d").mkdir()
    shutil.copy(pairs.src / "pairs-000000.tar", tmp_path / "i2d" / "00000.tar")
    pq.write_table(pa.table({"key": ["000000000"]}), tmp_path / "i2d" / "00000.parquet")
    code, _, err = cli_main(capsys, "index", f"{tmp_path / 'i2d'}/*", "--output",
                            tmp_path / "idx", "--workers", "0", "--no-progress")
    assert code == 2 and f"{tmp_path / 'i2d' / '00000.parquet'}: not a tar but a Parquet file " \
        "(img2dataset writes one beside each tar: give only the tars, e.g. 'DIR/*.tar'" in err, err


def test_a_small_file_that_is_no_tar_is_refused_not_read_as_truncated(pairs, tmp_path, capsys):
    """A file shorter than one tar header (img2dataset's ``*_stats.json``, an empty file) is
    named and refused (exit 2); a tar cut inside its first header still counts truncated."""
    from mimo_data.shards.tar_walk import Walked, walk

    (tmp_path / "src").mkdir()
    stats = tmp_path / "src" / "00000_stats.json"
    stats.write_text('{"count": 6, "successes": 6, "failed_to_download": 0}\n')
    tar = shutil.copy(pairs.src / "pairs-000000.tar", tmp_path / "src" / "00000.tar")
    (tmp_path / "src" / "empty.tar").write_bytes(b"")
    for given, why in (([stats, tar, "--layout", "pairs"],
                        f"{stats}: not a tar (54 bytes: shorter than one tar header"),
                       ([stats], f"{stats}: not a tar (54 bytes"),
                       ([tmp_path / "src" / "empty.tar"], "empty.tar: an empty file (0 bytes)")):
        code, _, err = cli_main(capsys, "index", *given, "--output", tmp_path / "idx",
                                "--workers", "0", "--no-progress")
        assert code == 2 and why in err, err
    walked = Walked()
    cut = (pairs.src / "pairs-000000.tar").read_bytes()[:300]
    assert list(walk(io.BytesIO(cut), walked, "cut.tar")) == [] and \
        "truncated header" in walked.truncated


@pytest.mark.filterwarnings(FORK_WARNING)       # energon prepare's worker pool
def test_an_energon_vqa_folder_becomes_conversations(pairs, tmp_path, capsys):
    """VQASample's ``image`` + ``context`` + ``answers`` (JSON fields) → a one-turn
    conversation about the image; of several answers the one ``answer_weights`` weighs most
    trains (the first of equals, or without weights), counted; one without its question is
    ``missing_member``."""
    from megatron.energon.tools.prepare import command

    from mimo_data.shards.reader import ShardReader
    folder = tmp_path / "vqa"
    folder.mkdir()
    members = _tar_members(pairs.src / "pairs-000000.tar")
    with webdataset.TarWriter(str(folder / "vqa-000000.tar")) as writer:
        for number, (key, sample) in enumerate(members.items()):
            image = next(name for name in sample if name in ("jpg", "png"))
            weights = {"weights": [1.0, 3.0] if number % 2 else [2.0, 2.0]} if number else {}
            writer.write({"__key__": key, image: sample[image],
                          "json": {"question": f"What is shown in {number}?",
                                   "answers": [f"Answer {number}.", f"Better {number}."],
                                   **weights}})
        writer.write({"__key__": "zz-no-question", image: sample[image],
                      "json": {"answers": ["An answer to nothing."]}})
    command.main(args=[str(folder), "--non-interactive", "--split-ratio", "1,0,0",
                       "--sample-type", "VQASample", "--num-workers", "1", "--field-map",
                       '{"image": "jpg,png", "context": "json[question]", '
                       '"answers": "json[answers]", "answer_weights": "json[weights]"}'],
                 standalone_mode=False)
    code, _, err = cli_main(capsys, "index", folder, "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 0, err
    reader = ShardReader(str(tmp_path / "idx"))
    assert [reader.record(p)["messages"] for p in range(len(reader))] == [
        [{"role": "user", "content": f"<image>\nWhat is shown in {n}?"},
         {"role": "assistant", "content": f"{'Better' if n % 2 else 'Answer'} {n}."}]
        for n in range(len(members))]
    report = read_json(tmp_path / "idx" / "report.json")
    assert report["counts"] == {"texts_chosen_from_several": len(members)}
    skipped = report["skipped_by_reason"]
    assert list(skipped) == ["missing_member"] and skipped["missing_member"]["count"] == 1
    assert "the question: member KEY.json has no json[question] (its keys there: answers)" \
        in skipped["missing_member"]["first"][0]["detail"], skipped
    assert [reader.record(p)["media"][0]["member"] for p in range(len(reader))] == \
        [next(name for name in sample if name in ("jpg", "png")) for sample in members.values()]


def test_a_question_s_marker_places_its_medium_and_stray_markers_or_bad_weights_skip():
    """A VQA sample's medium goes before its question, or where the question's one marker of
    it is; another marker in the question, or one in an answer, is a marker_mismatch (not a
    template mismatch at training); weights
    that are not one number a text are refused for a lone answer as for several."""
    from mimo_data.shards.layouts import MemberMap, synthesize
    from mimo_data.shards.records import RecordError
    vqa = MemberMap("vqa", media="jpg", question="json[question]", text="json[answers]",
                    weights="json[weights]")

    def sample(**fields) -> dict[str, bytes]:
        return {"jpg": b"", "json": json.dumps({"question": "What?", "answers": ["A cat."],
                                                **fields}).encode()}
    for weights in ([2.0], 2.0):               # a lone answer's weight, listed or not
        assert synthesize(sample(weights=weights), vqa).fields["messages"][1]["content"] == \
            "A cat."
    # an .npy weights member (webdataset decodes it for Energon) weighs as a JSON list
    npy = MemberMap("vqa", media="jpg", question="json[question]", text="json[answers]",
                    weights="weights.npy")
    two = {"jpg": b"", "json": json.dumps({"question": "What?", "answers": ["A", "B"]}).encode()}
    for weights, chosen in (([1.0, 3.0], "B"), ([3, 1], "A")):
        stored = io.BytesIO()
        np.save(stored, np.array(weights))
        assert synthesize({**two, "weights.npy": stored.getvalue()}, npy).fields["messages"][
            1]["content"] == chosen
    with pytest.raises(RecordError, match=re.escape("the answer's weights (KEY.weights.txt) "
                                                    "are b'1 3': give a number for each of "
                                                    "its 2 texts (a JSON list or a .npy")):
        synthesize({**two, "weights.txt": b"1 3"}, replace(npy, weights="weights.txt"))
    # the question's one marker of its medium places it (LLaVA-style data in Energon's form)
    assert synthesize(sample(question="<image>\nWhat is shown?"), vqa).fields["messages"][0] == \
        {"role": "user", "content": "<image>\nWhat is shown?"}
    assert synthesize(sample(), vqa).fields["messages"][0] == \
        {"role": "user", "content": "<image>\nWhat?"}
    for fields, said in (
            ({"question": "<image> or <image>?"}, "the question (KEY.json[question]) holds 2 "
             "media marker(s) for the sample's one image (<image>): give it one <image>"),
            ({"question": "What does <audio> say?"}, "the question (KEY.json[question]) holds "
             "1 media marker(s) for the sample's one image"),
            ({"answers": ["The <audio> says."]}, "the answer (KEY.json[answers]) holds a media "
             "marker")):
        with pytest.raises(RecordError, match=re.escape(said)) as caught:
            synthesize(sample(**fields), vqa)
        assert caught.value.reason == "marker_mismatch"
    with pytest.raises(RecordError, match=re.escape("the answer's weights (KEY.json) are "
                                                    "[1.0, 2.0]: give a number for each of its "
                                                    "1 text")):
        synthesize(sample(weights=[1.0, 2.0]), vqa)


# ------------------------------------------------------------------------- conversations

def _conversations(photos: list[tuple], folder: Path) -> tuple[list[dict], list[dict]]:
    """12 conversations (every third about two images) as ``mimo-shard build`` input records
    and as ShardWriter samples (``KEY.json`` + ``KEY.jpg``, or ``KEY.0.jpg`` + ``KEY.1.png``)."""
    jsonl, samples = [], []
    images = folder / "images"
    images.mkdir()
    for number in range(12):
        chosen = [photos[number]] + ([photos[(number + 5) % len(photos)]] if number % 3 == 2
                                     else [])
        paths = []
        for name, data, _, _ in chosen:
            (images / name).write_bytes(data)
            paths.append(str(images / name))
        question = ("<image>" * len(chosen)) + f"\nWhat is in picture {number}?"
        turns = chat(question, f"Picture {number} shows {chosen[0][0].split('.')[0]}.")
        if number % 4 == 1:          # a follow-up out of the loss (OpenAI's weight 0)
            turns += [{"from": "human", "value": "Sure?"},
                      {"from": "gpt", "value": "I think so.", "weight": 0}]
        jsonl.append({"id": f"c{number}", "images": paths, "conversations": turns})
        sample = {"__key__": f"c{number:04d}", "json": {"id": f"c{number}",
                                                        "conversations": turns}}
        if len(chosen) == 1:
            sample[_extension(chosen[0][0])] = chosen[0][1]
        else:
            for item, (name, data, _, _) in enumerate(chosen):
                sample[f"{item}.{_extension(name)}"] = data
        samples.append(sample)
    return jsonl, samples


@pytest.fixture(scope="module")
def conversations(tmp_path_factory, corpus_photos):
    from mimo_data.shards.build import BuildOptions, build
    from mimo_data.shards.in_place import IndexOptions, index
    with scratch(tmp_path_factory, "index-conversations") as root:
        jsonl, samples = _conversations(corpus_photos, root)
        (root / "tars").mkdir()
        with webdataset.ShardWriter(str(root / "tars" / "chat-%06d.tar"), maxcount=PER_TAR,
                                    verbose=0) as writer:
            for sample in samples:
                writer.write(sample)
        build([str(write_jsonl(root / "chat.jsonl", jsonl))], str(root / "built"),
              BuildOptions(max_samples_per_shard=PER_TAR, workers=0, progress=False))
        index([str(root / "tars" / "chat-{000000..000002}.tar")], str(root / "indexed"),
              IndexOptions(workers=0, progress=False))
        yield root, samples


def test_conversations_keep_their_messages_and_media_order(conversations):
    from mimo_data.shards.reader import ShardReader

    root, samples = conversations
    built, indexed = ShardReader(str(root / "built")), ShardReader(str(root / "indexed"))
    assert len(built) == len(indexed) == 12
    for made in ("built", "indexed"):       # both reports count the answers out of the loss
        assert read_json(root / made / "report.json")["counts"] == {
            "answers_out_of_the_loss": 3}, made
    assert [m.get("weight") for m in indexed.record(1)["messages"]] == [None, None, None, 0]
    for position, sample in enumerate(samples):
        ours, theirs = indexed.record(position), built.record(position)
        assert ours["key"] == sample["__key__"] and ours["id"] == sample["json"]["id"]
        assert ours["messages"] == theirs["messages"]
        media = [m for m in sample if m not in ("__key__", "json")]
        assert [item["member"] for item in ours["media"]] == media     # 0.jpg before 1.png
        assert [indexed.read_member(position, item["member"]) for item in ours["media"]] == \
            [built.read_member(position, item["member"]) for item in theirs["media"]]
        for item, other in zip(ours["media"], theirs["media"]):
            assert {k: v for k, v in item.items() if k not in ("member", "path")} == \
                {k: v for k, v in other.items() if k not in ("member", "path")}


def test_several_media_members_are_ordered_by_the_number_ending_their_names():
    """Eleven images as mimo's build names them (``img0.jpg`` ... ``img10.jpg``: as strings
    ``img10`` sorts before ``img2``) and ``image_N.png`` go to the markers by number; members
    of one modality without an order (``jpg`` beside ``0.jpg``, two numbered 1) are refused,
    never given to the markers in a guessed order."""
    from mimo_data.shards.layouts import MemberMap, synthesize
    from mimo_data.shards.records import RecordError

    def media(members: dict[str, bytes], images: int) -> list[str]:
        conversation = {"conversations": chat("<image>" * images + "\nCount.", "Done.")}
        found = synthesize({"json": json.dumps(conversation).encode(), **members},
                           MemberMap("conversation"))
        return [member for _, member in found.media]

    built = [f"img{n}.jpg" for n in range(11)]
    assert media(dict.fromkeys(reversed(built), b""), 11) == built
    assert media(dict.fromkeys(["image_10.png", "image_2.png", "image_9.png"], b""), 3) == \
        ["image_2.png", "image_9.png", "image_10.png"]
    for unordered in (["jpg", "0.jpg"], ["1.jpg", "img1.png"]):
        with pytest.raises(RecordError) as caught:
            media(dict.fromkeys(unordered, b""), 2)
        assert caught.value.reason == "malformed_record" and "no order" in str(caught.value)


def test_media_members_the_json_names_go_to_the_markers_in_its_order():
    """A conversation JSON naming its sample's members (``"images": ["k0.1.jpg", "k0.0.jpg"]``:
    the clock first) or a document's ``images`` naming them: the markers take them in that
    order, not by number. Names that are the source's own paths (kept as metadata) leave the
    numbers to order them, also where they end like a member (``scene/1.jpg``); this sample's
    files named, but not each member once, are refused."""
    from mimo_data.shards.layouts import MemberMap, synthesize
    from mimo_data.shards.records import RecordError
    members = {"0.jpg": b"moon", "1.jpg": b"clock"}

    def media(images=None, key="k0", given=members, text="<image> is a clock, <image> the moon.",
              ) -> list[str]:
        conversation = {"conversations": chat(text, "Yes."),
                        **({} if images is None else {"images": images})}
        found = synthesize({"json": json.dumps(conversation).encode(), **given},
                           MemberMap("conversation"), key)
        return [member for _, member in found.media]

    assert media(["k0.1.jpg", "shards/k0.0.jpg"]) == ["1.jpg", "0.jpg"]
    assert media(["1.JPG", "0.jpg"]) == ["1.jpg", "0.jpg"]
    for paths in (["coco/clock.jpg", "coco/moon.jpg"], ["scene/1.jpg", "scene/2.jpg"],
                  ["scene_b/1.jpg", "scene_a/0.jpg"], None):
        assert media(paths) == ["0.jpg", "1.jpg"], paths
    assert media(["coco/a.jpg", "coco/b.jpg"], given={"jpg": b"one"},
                 text="<image> is one.") == ["jpg"]
    with pytest.raises(RecordError, match=re.escape("KEY.json's 'images' names ['k0.1.jpg', "
                                                    "'k0.1.jpg'], but the sample's members")):
        media(["k0.1.jpg", "k0.1.jpg"])
    document = {"texts": ["A clock:", "", "the moon:", None], "images": [None, "d2.1.jpg", "",
                                                                          "d2.0.jpg"]}
    found = synthesize({"json": json.dumps(document).encode(), **members},
                       MemberMap("documents"), "d2")
    assert [member for _, member in found.media] == ["1.jpg", "0.jpg"]
    assert found.fields["text"].index("clock") < found.fields["text"].index("<image>")
    document["images"] = [None, "https://example.com/p/77/1.jpg", None,
                          "https://example.com/p/77/2.jpg"]
    found = synthesize({"json": json.dumps(document).encode(), **members},
                       MemberMap("documents"), "d2")
    assert [member for _, member in found.media] == ["0.jpg", "1.jpg"]


def test_a_conversation_or_document_json_mimo_cannot_find_says_why():
    """A key with a dot leaves the JSON a member ``v1.json``: the missing_json detail says
    webdataset's first-dot rule; a JSON with other top-level keys names them, as build does."""
    from mimo_data.shards.layouts import MemberMap, synthesize
    from mimo_data.shards.records import RecordError
    for layout in ("conversation", "documents"):
        with pytest.raises(RecordError, match="the sample has a member 'v1.json': webdataset's "
                           "key ends at the first dot") as caught:
            synthesize({"v1.json": b"{}", "v1.jpg": b""}, MemberMap(layout))
        assert caught.value.reason == "missing_json"
    with pytest.raises(RecordError, match=re.escape("KEY.json has the keys 'conversation', "
                                                    "'id', and a conversation's are")):
        synthesize({"json": json.dumps({"id": 1, "conversation": chat("Hi.", "Yo.")}).encode()},
                   MemberMap("conversation"))
    # both forms with different turns: refused as mimo-shard build refuses the record
    both = {"conversations": chat("Hi.", "From conversations."),
            "messages": chat("Hi.", "From messages.")}
    with pytest.raises(RecordError, match="gives both 'conversations' and 'messages', with "
                       "different turns") as caught:
        synthesize({"json": json.dumps(both).encode()}, MemberMap("conversation"))
    assert caught.value.reason == "malformed_record"
    # a prompt without its answer: no_trained_tokens, as mimo-shard build skips it
    with pytest.raises(RecordError, match="the conversation has no assistant turn") as caught:
        synthesize({"json": json.dumps({"messages": chat("Hi.", "Yo.")[:1]}).encode()},
                   MemberMap("conversation"))
    assert caught.value.reason == "no_trained_tokens"
    with pytest.raises(RecordError, match=r"every trained answer \(1\) is empty") as caught:
        synthesize({"json": json.dumps({"messages": chat("Hi.", "")}).encode()},
                   MemberMap("conversation"))
    assert caught.value.reason == "empty_answers"
    # an answer without text that calls a tool trains its call: kept
    calls = [{"type": "function", "function": {"name": "zoom", "arguments": {"factor": 2}}}]
    made = synthesize({"json": json.dumps({"messages": [
        {"role": "user", "content": "Zoom in."},
        {"role": "assistant", "content": "", "tool_calls": calls}]}).encode()},
        MemberMap("conversation"))
    assert made.fields["messages"][1]["tool_calls"][0]["function"]["name"] == "zoom"
    # a JSON member that is not UTF-8: invalid_utf8, as a text member's or a JSONL line's
    with pytest.raises(RecordError, match=re.escape(
            "member KEY.json is not UTF-8 (nor UTF-16/32) text")) as caught:
        synthesize({"json": b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'},
                   MemberMap("conversation"))
    assert caught.value.reason == "invalid_utf8"
    # UTF-16/32 and a BOM are JSON's own encodings (webdataset's decoder reads them): read
    text = json.dumps({"messages": chat("Hi.", "Café.")})
    for data in (text.encode("utf-16"), text.encode("utf-32-le"), b"\xef\xbb\xbf" +
                 text.encode()):
        assert synthesize({"json": data}, MemberMap("conversation")).fields["messages"][1][
            "content"] == "Café."


def test_a_conversation_member_listing_tools_keeps_them():
    """Read in place, a sample whose conversation lists tools has them on its first message,
    as at build (``records.normalize_messages``): never trained without the tools its
    template writes."""
    from mimo_data.shards.layouts import MemberMap, synthesize
    from mimo_data.shards.records import RecordError
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    conversation = {"conversations": chat("Weather?", "Sunny."), "tools": tools,
                    "system": "Use tools."}
    made = synthesize({"json": json.dumps(conversation).encode()}, MemberMap("conversation"))
    assert made.fields["messages"][0] == {"role": "system", "content": "Use tools.",
                                          "tools": tools}
    del conversation["system"]
    conversation["tools"] = []
    assert synthesize({"json": json.dumps(conversation).encode()},
                      MemberMap("conversation")).fields["messages"][1]["content"] == "Sunny."
    # ms-swift's grounding objects for placeholders: refused here as at build
    grounded = {"conversations": chat("Find it.", "<ref-object><bbox>"),
                "objects": {"ref": ["a dog"], "bbox": [[1, 2, 3, 4]]}}
    with pytest.raises(RecordError, match="grounding 'objects'"):
        synthesize({"json": json.dumps(grounded).encode()}, MemberMap("conversation"))


def test_a_video_marked_as_llava_next_marks_it_is_read_as_a_video(tmp_path, corpus_videos):
    """LLaVA-Video-178K's samples in a WebDataset (``KEY.json`` + ``KEY.mp4``, the video's
    marker LLaVA-NeXT's ``<image>``) index as they build: the marker is the video's, and the
    report counts it."""
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.reader import ShardReader

    clip, rotated = corpus_videos["pan_h264_24"], corpus_videos["rotated_h264_24"]
    assert rotated.rotation and not clip.rotation
    (tmp_path / "tars").mkdir()
    with webdataset.ShardWriter(str(tmp_path / "tars" / "video-%06d.tar"), verbose=0) as writer:
        writer.write({"__key__": "v0", "mp4": clip.data, "json": {
            "id": "v0", "data_source": "0_30_s_academic_v0_1",
            "conversations": chat("<image>\nWhat happens?", "A slow pan.")}})
        # a phone clip with rotation metadata: counted, as the build counts it
        writer.write({"__key__": "v1", "mp4": rotated.data, "json": {
            "id": "v1", "conversations": chat("<video>\nWhat happens?", "A turn.")}})
    index([str(tmp_path / "tars" / "video-000000.tar")], str(tmp_path / "indexed"),
          IndexOptions(workers=0, progress=False))
    assert read_json(tmp_path / "indexed" / "report.json")["counts"] == {
        "videos_marked_with_image": 1, "videos_rotated": 1}
    reader = ShardReader(str(tmp_path / "indexed"))
    record = reader.record(0)
    assert record["messages"][0]["content"] == "<video>\nWhat happens?"
    assert [(item["modality"], item["frames"]) for item in record["media"]] == \
        [("video", clip.frames)]
    assert reader.read_member(0, "mp4") == clip.data


def test_markers_first_places_a_conversations_missing_markers(tmp_path, corpus_photos):
    """A conversation WebDataset whose texts name no image (``KEY.json`` + ``KEY.jpg``):
    without ``--markers-first`` a counted marker_mismatch naming the flag; with it the image's
    marker goes before the first user text, counted."""
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.reader import ShardReader
    from mimo_data.shards.tar_sources import IndexInputError

    name, data, _, _ = next(p for p in corpus_photos if p[0].endswith(".jpg"))
    (tmp_path / "tars").mkdir()
    with webdataset.ShardWriter(str(tmp_path / "tars" / "chat-%06d.tar"), verbose=0) as writer:
        writer.write({"__key__": "c0", "jpg": data,
                      "json": {"conversations": chat("What is shown?", "A photo.")}})
    tar = str(tmp_path / "tars" / "chat-000000.tar")
    index([tar], str(tmp_path / "plain"), IndexOptions(workers=0, progress=False))
    [skip] = read_json(tmp_path / "plain" / "report.json")["skipped_by_reason"][
        "marker_mismatch"]["first"]
    assert "--markers-first" in skip["detail"], skip
    index([tar], str(tmp_path / "first"), IndexOptions(workers=0, progress=False,
                                                       markers_first=True))
    assert read_json(tmp_path / "first" / "report.json")["counts"] == {
        "markers_placed_first": 1}
    record = ShardReader(str(tmp_path / "first")).record(0)
    assert record["messages"][0]["content"] == "<image>\nWhat is shown?"
    assert [item["member"] for item in record["media"]] == ["jpg"]
    # a caption pair's member options on conversations: refused, never silently unused
    with pytest.raises(IndexInputError, match="its samples are conversations, and "
                       "--media-member / --text-member name a caption pair's members"):
        index([tar], str(tmp_path / "media"), IndexOptions(workers=0, progress=False,
                                                           media_member="jpg"))
    # caption pairs have no markers to place: the flag is refused, never silently unused
    with webdataset.ShardWriter(str(tmp_path / "tars" / "pairs-%06d.tar"), verbose=0) as writer:
        writer.write({"__key__": "p0", "jpg": data, "txt": "A photo."})
    with pytest.raises(IndexInputError, match="the layout is pairs"):
        index([str(tmp_path / "tars" / "pairs-000000.tar")], str(tmp_path / "pairs"),
              IndexOptions(workers=0, progress=False, markers_first=True))


def test_a_pair_without_its_medium_says_what_to_do():
    """Samples named with dots (``sample.000.jpg``: webdataset's key ends at the first dot,
    so they are one sample) and a field map naming a member the sample lacks."""
    from mimo_data.shards.layouts import MemberMap, synthesize
    from mimo_data.shards.records import RecordError

    dotted = {"000.jpg": b"", "000.txt": b"a", "001.jpg": b"", "001.txt": b"b"}
    with pytest.raises(RecordError) as caught:
        synthesize(dotted, MemberMap("pairs"))
    assert "KEY.000.jpg and KEY.001.jpg are one sample" in caught.value.detail
    with pytest.raises(RecordError) as caught:   # img_001.v2.jpg + img_001.v2.txt: one dot more
        synthesize({"v2.jpg": b"", "v2.txt": b"a"}, MemberMap("pairs"))
    assert caught.value.reason == "missing_text"
    assert "key ends at the first dot" in caught.value.detail, caught.value.detail
    assert "index with --media-member v2.jpg --text-member v2.txt" in caught.value.detail
    # an image without its caption member: the members the sample has are named
    with pytest.raises(RecordError) as caught:
        synthesize({"jpg": b"", "caption": b"a"}, MemberMap("pairs"))
    assert caught.value.detail.startswith("KEY.jpg has no KEY.txt beside it (an image without "
                                          "its caption; the sample has caption, jpg)")
    with pytest.raises(RecordError) as caught:
        synthesize({"png": b"", "txt": b"a"}, MemberMap("pairs", media="jpg"))
    assert caught.value.reason == "missing_media"
    assert "(no KEY.jpg member; the sample has png, txt)" in caught.value.detail
    with pytest.raises(RecordError) as caught:       # a medium of an extension mimo reads not
        synthesize({"m4a": b"", "txt": b"a"}, MemberMap("pairs"))
    assert caught.value.reason == "missing_media"
    assert "the sample has m4a, txt; a medium's member ends in one of " in \
        caught.value.detail and " jpg," in caught.value.detail, caught.value.detail
    with pytest.raises(RecordError) as caught:       # a json alone: neither of a pair
        synthesize({"json": b"{}"}, MemberMap("pairs"))
    assert caught.value.reason == "missing_media"
    assert caught.value.detail.startswith("the sample has neither a medium nor KEY.txt (the "
                                          "sample has json;"), caught.value.detail


@pytest.mark.parametrize("hashes", ["blake2b", "all alike"])
def test_a_key_in_two_tars_is_kept_once_and_counted_once(corpus_photos, tmp_path, capsys,
                                                         monkeypatch, hashes):
    """Tars of two downloads that number keys alike: the first tar's sample is kept, the
    other counted ``duplicate_key``, and the index's totals, modality counts and per-tar
    counts are of the kept samples (the tables rewritten a row a batch here). Keys whose
    hashes are alike are compared themselves (every hash made alike: the same result). Tars
    that number their samples each on their own take ``--keys-per-tar``: every sample kept,
    its key ``TAR/KEY``, and the index verifies."""
    from mimo_data import files
    from mimo_data.shards import in_place
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.reader import ShardReader
    from mimo_data.shards.verify import verify

    monkeypatch.setattr(files, "PARQUET_BATCH", 1)
    if hashes == "all alike":
        real = in_place._key_hashes
        monkeypatch.setattr(in_place, "_key_hashes", lambda path: real(path) * 0)

    photo = next(data for name, data, _, _ in corpus_photos if name.endswith(".jpg"))
    write_tar(tmp_path / "src" / "a.tar", {"1.jpg": photo, "1.txt": b"First one.",
                                           "2.jpg": photo, "2.txt": b"Second."})
    write_tar(tmp_path / "src" / "b.tar", {"1.jpg": photo, "1.txt": b"Another first.",
                                           "3.jpg": photo, "3.txt": b"Third."})
    with contextlib.redirect_stderr(io.StringIO()):
        built = index([str(tmp_path / "src")], str(tmp_path / "idx"),
                      IndexOptions(workers=0, progress=False))
    reader = ShardReader(str(tmp_path / "idx"))
    assert [(reader.record(p)["key"], reader.record(p)["text"]) for p in range(len(reader))] \
        == [("1", "First one."), ("2", "Second."), ("3", "Third.")]
    assert built["totals"]["samples"] == 3
    assert [(shard["name"], shard["samples"]) for shard in built["shards"]] == [
        ("a.tar", 2), ("b.tar", 1)]
    assert built["modalities"]["image"] == {"samples": 3, "items": 3}
    assert built["modalities"]["text_only"] == {"samples": 0}
    report = json.loads((tmp_path / "idx" / "report.json").read_text())
    assert (report["records_read"], report["samples_written"], report["records_skipped"]) \
        == (4, 3, 1)
    [skip] = report["skipped_by_reason"]["duplicate_key"]["first"]
    assert skip["location"] == "b.tar:1"
    assert skip["detail"].startswith("the key occurs in an earlier tar too (a.tar), whose "
                                     "sample is kept"), skip
    assert "index them with --keys-per-tar (each sample's key read as TAR/KEY)" in \
        skip["detail"], skip
    # and in the list of every skipped record (the advice in the first five lines alone)
    assert [json.loads(line) for line in (tmp_path / "idx" / "skipped.jsonl").open()] == [
        {"reason": "duplicate_key", **skip}]
    code, _, err = cli_main(capsys, "index", tmp_path / "src", "--output", tmp_path / "per-tar",
                            "--keys-per-tar", "--workers", "0", "--no-progress")
    assert code == 0, err
    reader = ShardReader(str(tmp_path / "per-tar"))
    assert [(reader.table.key(p), reader.record(p)["key"], reader.record(p)["text"])
            for p in range(len(reader))] == [
        ("a.tar/1", "a.tar/1", "First one."), ("a.tar/2", "a.tar/2", "Second."),
        ("b.tar/1", "b.tar/1", "Another first."), ("b.tar/3", "b.tar/3", "Third.")]
    assert reader.read_member(reader.table.position("b.tar/1"), "jpg") == photo
    assert verify(str(tmp_path / "per-tar"), progress=False) == []
    # mimo-inspect sample --key: TAR/KEY, or a KEY one tar has; one two tars have is said
    from mimo_data.inspect.cli import main as inspect_main
    config = REPO / "configs" / "preprocess.yaml"
    for key, found in (("b.tar/1", "b.tar/1"), ("3", "b.tar/3"), ("1", None)):
        capsys.readouterr()
        code = inspect_main(["sample", str(tmp_path / "per-tar"), "--key", key, "--config",
                             str(config), "--color", "never"])
        out, err = capsys.readouterr()
        assert (code, out.startswith(f"sample {found} ") if found else
                "mimo-inspect sample: error: 2 tars have the key '1' (a.tar/1, b.tar/1): give "
                "TAR/KEY" in err) == (0 if found else 2, True), (key, out, err)
    from mimo_data.shards.stops import StrictStop
    with pytest.raises(StrictStop, match="^b.tar:1: duplicate_key: the key occurs in an "
                       "earlier tar too"):
        with contextlib.redirect_stderr(io.StringIO()):
            index([str(tmp_path / "src")], str(tmp_path / "strict"),
                  IndexOptions(workers=0, progress=False, strict=True))
    assert not (tmp_path / "strict").exists()


def test_a_key_twice_in_one_tar_apart_is_kept_once_and_counted(corpus_photos, tmp_path):
    """One tar holding a key's members twice with another sample between (1, 2, 1): the first
    is kept, the second skipped ``duplicate_key`` saying the key occurs twice in the tar.
    Where the first run is left out (a suffix twice), the later one is kept, and verified."""
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.reader import ShardReader

    photo = next(data for name, data, _, _ in corpus_photos if name.endswith(".jpg"))
    write_tar(tmp_path / "src" / "a.tar", {"1.jpg": photo, "1.txt": b"First one.",
                                           "2.jpg": photo, "2.txt": b"Second."})
    write_tar(tmp_path / "src" / "a.tar", {"1.jpg": photo, "1.txt": b"Another first."},
              append=True)                                          # 1 again, after 2
    with contextlib.redirect_stderr(io.StringIO()):
        built = index([str(tmp_path / "src")], str(tmp_path / "idx"),
                      IndexOptions(workers=0, progress=False))
    reader = ShardReader(str(tmp_path / "idx"))
    assert [(reader.record(p)["key"], reader.record(p)["text"]) for p in range(len(reader))] \
        == [("1", "First one."), ("2", "Second.")]
    assert built["totals"]["samples"] == 2
    report = json.loads((tmp_path / "idx" / "report.json").read_text())
    assert (report["records_read"], report["samples_written"], report["records_skipped"]) \
        == (3, 2, 1)
    [skip] = report["skipped_by_reason"]["duplicate_key"]["first"]
    assert skip["location"] == "a.tar:1"
    assert skip["detail"].startswith("the key occurs twice in the tar (not one after the "
                                     "other); the first is kept"), skip
    # the key's first run left out (a suffix twice: 1.txt, 1.TXT), its later one kept: the
    # index verifies, each kept sample checked where the table says, not the left-out run's
    from mimo_data.shards.verify import verify
    write_tar(tmp_path / "twice" / "a.tar", {"1.jpg": photo, "1.txt": b"First one.",
                                             "1.TXT": b"Its twin.", "2.jpg": photo,
                                             "2.txt": b"Second."})
    write_tar(tmp_path / "twice" / "a.tar", {"1.jpg": photo, "1.txt": b"Another first."},
              append=True)
    with contextlib.redirect_stderr(io.StringIO()):
        index([str(tmp_path / "twice")], str(tmp_path / "idx2"),
              IndexOptions(workers=0, progress=False))
    reader = ShardReader(str(tmp_path / "idx2"))
    assert [reader.record(p)["text"] for p in range(len(reader))] == ["Second.", "Another first."]
    assert verify(str(tmp_path / "idx2"), progress=False) == []


def test_a_key_in_two_tars_leaves_the_report_counts_of_the_kept_sample(corpus, tmp_path):
    """What the dropped duplicates held (an answer out of the loss, a rotated clip) is not in
    the report's counts: they are of the samples kept."""
    from mimo_data.shards.format import OUT_OF_LOSS, VIDEOS_ROTATED
    from mimo_data.shards.in_place import IndexOptions, index

    clip = (corpus / "videos" / "rotated_h264_24.mp4").read_bytes()
    weighted = json.dumps({"messages": [
        {"role": "user", "content": "<video>What is it?"},
        {"role": "assistant", "content": "A guess.", "weight": 0},
        {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "A clip."}]})
    for tar in ("a", "b"):
        write_tar(tmp_path / "src" / f"{tar}.tar", {"1.mp4": clip, "1.json": weighted.encode()})
    with contextlib.redirect_stderr(io.StringIO()):
        built = index([str(tmp_path / "src")], str(tmp_path / "idx"),
                      IndexOptions(workers=0, progress=False))
    assert built["totals"]["samples"] == 1
    assert built["report"]["counts"] == {OUT_OF_LOSS: 1, VIDEOS_ROTATED: 1}
    assert json.loads((tmp_path / "idx" / "report.json").read_text())["counts"] == {
        OUT_OF_LOSS: 1, VIDEOS_ROTATED: 1}


def test_a_tar_of_another_layout_than_the_first_is_refused_by_name(corpus_photos, tmp_path,
                                                                   capsys):
    """The layout is detected from the first tar; a later tar of conversations would be read as
    caption pairs and skipped whole (each sample ``missing_text``) under exit 0: refused,
    naming it, unless --layout says how to read every tar."""
    photo = next(data for name, data, _, _ in corpus_photos if name.endswith(".jpg"))
    conversation = json.dumps({"conversations": [{"from": "human", "value": "<image>What?"},
                                                 {"from": "gpt", "value": "A photo."}]})
    write_tar(tmp_path / "src" / "a.tar", {"1.jpg": photo, "1.txt": b"A caption."})
    write_tar(tmp_path / "src" / "b.tar", {"2.jpg": photo, "2.json": conversation.encode()})
    code, _, err = cli_main(capsys, "index", tmp_path / "src", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and f"{tmp_path / 'src' / 'b.tar'}: its samples are conversations, and " \
        "those of a.tar, which the layout was detected from, caption pairs" in err, err
    assert not (tmp_path / "idx").exists()       # the folder it made is not left behind
    code, _, err = cli_main(capsys, "index", tmp_path / "src", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress", "--layout", "pairs")
    assert code == 0 and "1 record skipped (missing_text 1)" in err, err


def test_an_empty_first_tar_decides_no_layout(corpus_photos, tmp_path, capsys):
    """A failed download's empty tar first in the folder: the layout comes from the next tar's
    samples; tars holding no sample at all are said to be so (exit 2)."""
    photo = next(data for name, data, _, _ in corpus_photos if name.endswith(".jpg"))
    write_tar(tmp_path / "src" / "a.tar", {})
    write_tar(tmp_path / "src" / "b.tar", {"1.jpg": photo, "1.txt": b"A caption."})
    code, _, err = cli_main(capsys, "index", tmp_path / "src", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 0 and "layout pairs (detected from the first samples of b.tar)" in err, err
    assert "1 sample written" in err, err
    (tmp_path / "src" / "b.tar").unlink()
    code, _, err = cli_main(capsys, "index", tmp_path / "src", "--output", tmp_path / "idx2",
                            "--workers", "0", "--no-progress")
    assert code == 2 and "no sample in its 1 tar(s) (empty, or cut short within their first " \
        "member)" in err, err


def test_a_tar_appended_with_cat_is_said_not_read_past_its_end(corpus_photos, tmp_path,
                                                              capsys):
    """`cat a.tar b.tar > ab.tar`: tarfile and webdataset stop at a.tar's end-of-archive
    block, so b.tar's samples are not indexed; the data after the block is counted, not
    dropped without a word. A tar padded with NULs alone (its record size) says nothing."""
    photo = next(data for name, data, _, _ in corpus_photos if name.endswith(".jpg"))
    write_tar(tmp_path / "parts" / "a.tar", {"1.jpg": photo, "1.txt": b"One."})
    write_tar(tmp_path / "parts" / "b.tar", {"2.jpg": photo, "2.txt": b"Two."})
    (tmp_path / "src").mkdir()
    first = (tmp_path / "parts" / "a.tar").read_bytes()
    (tmp_path / "src" / "ab.tar").write_bytes(first + (tmp_path / "parts" / "b.tar").read_bytes())
    code, _, err = cli_main(capsys, "index", tmp_path / "src", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 0 and "1 sample written, 1 member ignored (trailing_data 1)" in err, err
    [aside] = read_json(tmp_path / "idx" / "report.json")["members_ignored_by_reason"][
        "trailing_data"]["first"]
    assert aside["location"] == "ab.tar" and f"followed by data at byte {len(first)}" in \
        aside["detail"] and "tar --concatenate" in aside["detail"], aside
    code, _, err = cli_main(capsys, "index", tmp_path / "parts" / "a.tar", "--output",
                            tmp_path / "idx-a", "--workers", "0", "--no-progress")
    assert code == 0 and "ignored" not in err, err


def test_a_tar_whose_keys_members_are_apart_is_said_to_be_so(corpus_photos, tmp_path, capsys):
    """``tar cf x.tar *.jpg *.txt``: every image, then every caption. webdataset would read
    each key as two samples; detection says the members are apart and how to write the tar,
    not that the samples are of no layout (exit 2), even where a whole sample among them
    decides one."""
    photo = next(data for name, data, _, _ in corpus_photos if name.endswith(".jpg"))
    write_tar(tmp_path / "src" / "apart.tar", {"0.jpg": photo, "1.jpg": photo,
                                                "0.txt": b"A photo.", "1.txt": b"Again."})
    code, _, err = cli_main(capsys, "index", tmp_path / "src", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and "apart.tar: the members of one key are apart (key '0' comes back " \
        "after other keys, with none of its members before)" in err and "tar -cf x.tar " \
        "--sort=name -C FOLDER ." in err, err
    # tar cf in a folder's listing order: one whole sample first decides a layout (pairs),
    # and the others' members apart are still refused, not indexed as skipped halves
    write_tar(tmp_path / "listed" / "apart.tar", {
        "1.jpg": photo, "1.txt": b"One.", "0.jpg": photo, "2.jpg": photo, "0.txt": b"Zero.",
        "2.txt": b"Two."})
    code, _, err = cli_main(capsys, "index", tmp_path / "listed", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and "apart.tar: the members of one key are apart (key '0' comes back " \
        "after other keys, with none of its members before)" in err, err
    # a sample written again further on with a member more (tar rf): a duplicate, counted,
    # not halves apart
    write_tar(tmp_path / "again" / "a.tar", {"a.jpg": photo, "a.txt": b"A.", "b.jpg": photo,
                                             "b.txt": b"B.", "c.jpg": photo, "c.txt": b"C."})
    write_tar(tmp_path / "again" / "a.tar", {"a.jpg": photo, "a.txt": b"A again.",
                                             "a.json": b"{}"}, append=True)
    code, _, err = cli_main(capsys, "index", tmp_path / "again", "--output",
                            tmp_path / "idx-again", "--workers", "0", "--no-progress")
    assert code == 0 and "duplicate_key 1" in err, err
    # more samples than detection reads: each of them one jpg
    write_tar(tmp_path / "many" / "apart.tar", {
        **{f"{n}.jpg": photo for n in range(20)}, **{f"{n}.txt": b"A." for n in range(20)}})
    code, _, err = cli_main(capsys, "index", tmp_path / "many", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and "apart.tar: each of its first 16 samples is one jpg member. If the " \
        "tar holds their other files further on, the members of one key are apart" in err, err
    # such a tar after a good one: refused as the first is (each member was skipped alone,
    # "KEY.jpg has no KEY.txt beside it", read as 40 records of 20 samples)
    write_tar(tmp_path / "later" / "a.tar", {"0.jpg": photo, "0.txt": b"A photo."})
    shutil.copy(tmp_path / "many" / "apart.tar", tmp_path / "later" / "b.tar")
    write_tar(tmp_path / "later-split" / "a.tar", {"0.jpg": photo, "0.txt": b"A photo."})
    shutil.copy(tmp_path / "src" / "apart.tar", tmp_path / "later-split" / "b.tar")
    for folder, said in (("later", "b.tar: each of its first 16 samples is one jpg member"),
                         ("later-split", "b.tar: the members of one key are apart (key '0' "
                                         "comes back")):
        code, _, err = cli_main(capsys, "index", tmp_path / folder, "--output",
                                tmp_path / f"idx-{folder}", "--workers", "0", "--no-progress")
        assert code == 2 and said in err and "tar -cf x.tar --sort=name" in err, err
    # ... but a short later tar's one sample without its caption is that sample's skip
    write_tar(tmp_path / "short" / "a.tar", {"0.jpg": photo, "0.txt": b"A photo."})
    write_tar(tmp_path / "short" / "b.tar", {"9.jpg": photo})
    code, _, err = cli_main(capsys, "index", tmp_path / "short", "--output",
                            tmp_path / "idx-short", "--workers", "0", "--no-progress")
    assert code == 0 and "1 record skipped (missing_text 1)" in err, err
    # tar cf x.tar *.json *.jpg: conversations whose <image> markers have no medium beside
    # them (each would be dropped), not taken for text-only conversations
    turns = json.dumps({"conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                                          {"from": "gpt", "value": "A photo."}]}).encode()
    write_tar(tmp_path / "talk" / "apart.tar", {
        **{f"{n}.json": turns for n in range(20)}, **{f"{n}.jpg": photo for n in range(20)}})
    code, _, err = cli_main(capsys, "index", tmp_path / "talk", "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 2 and "apart.tar: each of its first 16 samples is a KEY.json conversation " \
        "with media markers and no medium beside it" in err and "are apart" in err, err
    # text-only conversations (no marker) are what they look like
    write_tar(tmp_path / "text" / "plain.tar", {f"{n}.json": turns.replace(b"<image>\\n", b"")
                                                for n in range(20)})
    code, _, err = cli_main(capsys, "index", tmp_path / "text", "--output", tmp_path / "idx3",
                            "--workers", "0", "--no-progress")
    assert code == 0 and "20 samples written" in err, err


def test_uppercase_suffixes_are_read_as_webdataset_lowercases_them(corpus_photos, tmp_path):
    """``KEY.JPG`` + ``KEY.TXT`` (cameras, Windows) and ``.jpg`` / ``.JPG`` in one tar: the
    layout is detected and every pair kept, its bytes read from the tar's own members; a
    sample holding ``KEY.jpg`` and ``KEY.JPG`` is counted ``duplicate_member``."""
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.layouts import MemberMap, synthesize
    from mimo_data.shards.reader import ShardReader

    photos = [data for name, data, _, _ in corpus_photos if name.endswith(".jpg")][:3]
    names = [("0.JPG", "0.TXT"), ("1.jpg", "1.Txt"), ("2.JPG", "2.txt", "2.jpg")]
    (tmp_path / "src").mkdir()
    with tarfile.open(tmp_path / "src" / "UPPER.TAR", "w") as tar:     # a folder's .TAR too
        for number, members in enumerate(names):
            for name in members:
                data = f"Photo {number}.".encode() if "txt" in name.lower() else photos[number]
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        index([str(tmp_path / "src")], str(tmp_path / "idx"),
              IndexOptions(workers=0, progress=False, check="header"))
    assert "layout pairs (detected" in err.getvalue(), err.getvalue()
    reader = ShardReader(str(tmp_path / "idx"))
    records = [reader.record(p) for p in range(len(reader))]
    assert [(r["key"], r["text"]) for r in records] == [("0", "Photo 0."), ("1", "Photo 1.")]
    assert [reader.media(p, r) for p, r in enumerate(records)] == [
        {"jpg": photos[0]}, {"jpg": photos[1]}]
    skipped = json.loads((tmp_path / "idx" / "report.json").read_text())["skipped_by_reason"]
    assert list(skipped) == ["duplicate_member"] and "['2.jpg']" in \
        skipped["duplicate_member"]["first"][0]["detail"]
    # member names a map gives (--media-member JPG, an Energon field_map's) are lowercased too
    made = synthesize({"jpg": photos[0], "txt": b"A photo.", "json": b'{"url": "u"}'},
                      MemberMap("pairs", media="JPG", text="TXT", json="JSON"))
    assert made.media == [("image", "jpg")] and made.source == {"url": "u"}
    # a caption a Windows editor saved starts with a BOM, which is not caption text
    made = synthesize({"jpg": photos[0], "txt": "\ufeffA photo.".encode()}, MemberMap("pairs"))
    assert made.fields["text"] == "A photo."


def test_link_members_are_counted_as_members_their_samples_lack(corpus_photos, tmp_path,
                                                                capsys):
    """A tar where GNU tar stored a photo's second name as a hard link (and one symbolic
    link): the link holds no data, so its sample lacks the image; each link is counted
    ``link_member`` by name, saying how to write the tar instead, never dropped unsaid. Links
    and members of no sample (macOS ``._*``, in a folder too, a name without suffix) are
    members set aside, not records: the tar's 3 samples are the records read, and ``info``
    says both."""
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.info import dataset_info, format_info
    from mimo_data.shards.reader import ShardReader

    photo = next(data for name, data, _, _ in corpus_photos if name.endswith(".jpg"))
    (tmp_path / "src").mkdir()
    with tarfile.open(tmp_path / "src" / "links.tar", "w") as tar:
        for name, data in (("0.jpg", photo), ("0.txt", b"A photo."), ("._0.jpg", b"\0" * 9),
                           ("sub/._0.jpg", b"\0" * 9), ("LICENSE", b"CC0"),
                           ("1.txt", b"Again."), ("2.txt", b"Once more.")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, kind in (("1.jpg", tarfile.LNKTYPE), ("2.jpg", tarfile.SYMTYPE)):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "0.jpg"
            tar.addfile(info)
    with contextlib.redirect_stderr(io.StringIO()):
        index([str(tmp_path / "src")], str(tmp_path / "idx"),
              IndexOptions(workers=0, progress=False, check="header", layout="pairs"))
    reader = ShardReader(str(tmp_path / "idx"))
    assert [reader.record(p)["key"] for p in range(len(reader))] == ["0"]
    report = json.loads((tmp_path / "idx" / "report.json").read_text())
    assert (report["records_read"], report["records_skipped"]) == (3, 2)
    assert set(report["skipped_by_reason"]) == {"missing_media"}
    aside = report["members_ignored_by_reason"]
    assert [entry["location"] for entry in aside["stray_member"]["first"]] == [
        "links.tar:._0.jpg", "links.tar:sub/._0.jpg", "links.tar:LICENSE"]
    assert aside["stray_member"]["first"][1]["detail"] == "a macOS metadata file (._*), no data"
    assert "indexed   3 records read, 2 skipped (missing_media 2), 5 tar member(s) ignored " \
        "(links, or of no sample)" in format_info(dataset_info(str(tmp_path / "idx")))
    links = aside["link_member"]
    assert links["count"] == 2
    assert [entry["location"] for entry in links["first"]] == ["links.tar:1.jpg",
                                                               "links.tar:2.jpg"]
    assert links["first"][0]["detail"].startswith("1.jpg is a hard link to 0.jpg: a link holds "
                                                  "no data of its own")
    assert "--hard-dereference" in links["first"][0]["detail"]
    assert "a symbolic link to 0.jpg" in links["first"][1]["detail"]
    # a tar of such members alone: said so, not "the inputs hold no record"
    write_tar(tmp_path / "strays" / "a.tar", {"LICENSE": b"CC0", "README": b"Photos."})
    code, _, err = cli_main(capsys, "index", tmp_path / "strays", "--output",
                            tmp_path / "idx2", "--layout", "pairs", "--workers", "0",
                            "--no-progress")
    assert code == 1 and "no sample written, the tars hold no sample, only 2 member(s) " \
        "ignored (the report named above says which)" in err, err


def test_keys_with_dots_are_indexed_by_the_member_options_alone(corpus_photos, tmp_path):
    """Keys with dots (``img_000.v2``: webdataset splits at the first dot, members ``v2.jpg``
    and ``v2.txt``): detection names the members it saw; ``--media-member`` and
    ``--text-member``, the pairs layout's options, index them without ``--layout``."""
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.reader import ShardReader
    from mimo_data.shards.tar_sources import IndexInputError

    photos = [data for name, data, _, _ in corpus_photos if name.endswith(".jpg")][:2]
    (tmp_path / "src").mkdir()
    with webdataset.TarWriter(str(tmp_path / "src" / "dotted-000000.tar")) as writer:
        for number, photo in enumerate(photos):
            writer.write({"__key__": f"img_{number:03d}", "v2.jpg": photo,
                          "v2.txt": f"Photo {number}."})
    with pytest.raises(IndexInputError, match="of members v2.jpg, v2.txt .after each key's "
                       "first dot., are neither caption pairs.* name them as listed. .here: "
                       "--layout pairs --text-member v2.txt.$"):
        index([str(tmp_path / "src")], str(tmp_path / "no"),
              IndexOptions(workers=0, progress=False))
    with contextlib.redirect_stderr(io.StringIO()):     # the options the refusal names
        index([str(tmp_path / "src")], str(tmp_path / "hinted"), IndexOptions(
            workers=0, progress=False, layout="pairs", text_member="v2.txt"))
    assert len(ShardReader(str(tmp_path / "hinted"))) == len(photos)
    (tmp_path / "labels").mkdir()           # ImageNet-style: a class number, no caption
    with webdataset.TarWriter(str(tmp_path / "labels" / "labels-000000.tar")) as writer:
        for number, photo in enumerate(photos):
            writer.write({"__key__": f"img_{number:03d}", "jpg": photo, "cls": b"7"})
    with pytest.raises(IndexInputError) as refused:
        index([str(tmp_path / "labels")], str(tmp_path / "no-labels"),
              IndexOptions(workers=0, progress=False))
    assert "of members cls, jpg" in str(refused.value) and "here:" not in str(refused.value)
    turns = json.dumps({"conversations": [{"from": "human", "value": "<image>\nWhat?"},
                                          {"from": "gpt", "value": "A photo."}]})

    def refusal(name: str, key: str, **members) -> str:
        """What indexing a tar of ``members`` beside each photo, under keys ``key`` (a
        format of the number), is refused with."""
        (tmp_path / name).mkdir()
        with webdataset.TarWriter(str(tmp_path / name / f"{name}-000000.tar")) as writer:
            for number, photo in enumerate(photos):
                writer.write({"__key__": key.format(number), "jpg": photo, **members})
        with pytest.raises(IndexInputError) as refused:
            index([str(tmp_path / name)], str(tmp_path / f"no-{name}"),
                  IndexOptions(workers=0, progress=False))
        return str(refused.value)
    # conversations under keys with dots (x.0, x.1: one sample x to webdataset), which no
    # option reads apart: the dots named, not the --*-member options
    said = refusal("talk", "x.{}", json=turns)
    assert said.endswith(
        "its keys hold a dot (a member '0.json'): webdataset's key ends at the first dot of a "
        "file name, so samples x.0 and x.1 are read as one sample x (no option reads them "
        "apart): write the tar again with keys without dots"), said
    # one JSON member named otherwise (KEY.conv.json, its key without a dot): its option said;
    # two (KEY.conv.json, KEY.meta.json): both named, no dots said
    said = refusal("conv", "x{}", **{"conv.json": turns})
    assert said.endswith("(here, where one is a conversation: --layout conversation "
                         "--json-member conv.json)"), said
    said = refusal("multi", "x{}", **{"conv.json": turns, "meta.json": '{"source": "x"}'})
    assert said.endswith("--json-member conv.json or meta.json)"), said
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        index([str(tmp_path / "src")], str(tmp_path / "idx"), IndexOptions(
            workers=0, progress=False, media_member="v2.jpg", text_member="v2.txt"))
    assert "layout pairs (from the --media-member / --text-member options)" in err.getvalue()
    reader = ShardReader(str(tmp_path / "idx"))
    assert [reader.record(p)["text"] for p in range(len(reader))] == ["Photo 0.", "Photo 1."]
    # a member no first sample holds: refused before any tar is read whole (every record
    # would be skipped), naming the members they hold; as given with --layout pairs too
    for layout in ("auto", "pairs"):
        with pytest.raises(IndexInputError, match=r"dotted-000000.tar: --text-member v2.caption"
                           ": none of its first 2 samples holds that member .they hold v2.jpg, "
                           "v2.txt, after each key's first dot.: name one of those"):
            index([str(tmp_path / "src")], str(tmp_path / "no"), IndexOptions(
                workers=0, progress=False, layout=layout, media_member="v2.jpg",
                text_member="v2.caption"))
        assert not (tmp_path / "no").exists()
    # a JSON member's field no first sample has (misspelt): refused the same way, naming the
    # keys the JSON has
    with webdataset.TarWriter(str(tmp_path / "src" / "dotted-000000.tar")) as writer:
        for number, photo in enumerate(photos):
            writer.write({"__key__": f"img_{number:03d}", "jpg": photo,
                          "json": {"caption": f"Photo {number}.", "width": 8}})
    with pytest.raises(IndexInputError, match=r"dotted-000000.tar: none of its first 2 samples "
                       r"has the field \(--text-member: member KEY.json has no json\[captoin\] "
                       r"\(its keys there: caption, width\)\): name a field they have"):
        index([str(tmp_path / "src")], str(tmp_path / "no"), IndexOptions(
            workers=0, progress=False, text_member="json[captoin]"))
    # the pairs' member options with a layout that reads no pair: refused, not left unused
    for layout in ("conversation", "documents"):
        with pytest.raises(IndexInputError, match=f"--layout {layout} reads each sample's "
                           "KEY.json and the media beside it: leave them out"):
            index([str(tmp_path / "src")], str(tmp_path / "no"), IndexOptions(
                workers=0, progress=False, layout=layout, text_member="json[caption]"))
    assert not (tmp_path / "no").exists()


def test_a_folder_with_a_held_out_split_is_refused(corpus_photos, tmp_path):
    """A folder of ``train/`` and ``val/`` tars indexed whole would train on the validation
    split: refused naming it; the training folder, or a pattern naming both, is indexed."""
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.tar_sources import IndexInputError

    _, photo, _, _ = corpus_photos[0]
    for split in ("train", "val"):
        (tmp_path / "src" / split).mkdir(parents=True)
        with webdataset.TarWriter(str(tmp_path / "src" / split / "part-0.tar")) as writer:
            writer.write({"__key__": f"{split}0", "jpg": photo, "txt": "A photo."})
    options = IndexOptions(workers=0, progress=False, check="header")
    with pytest.raises(IndexInputError, match="tars under val/ too, a split held out"):
        index([str(tmp_path / "src")], str(tmp_path / "no"), options)
    for sources, samples in (([tmp_path / "src" / "train"], 1),
                             ([f"{tmp_path}/src/{{train,val}}/part-0.tar"], 2)):
        with contextlib.redirect_stderr(io.StringIO()):
            built = index([str(s) for s in sources], str(tmp_path / f"idx{samples}"), options)
        assert built["totals"]["samples"] == samples


def test_tars_under_a_linked_folder_are_indexed_once(corpus_photos, tmp_path):
    """A dataset's parts mounted as linked folders are under it: indexed; a link back up
    (a loop) reads each real folder once. Hidden tars are left out, said so."""
    from mimo_data.shards.in_place import IndexOptions, index

    _, photo, _, _ = corpus_photos[0]
    for part in ("src/part0", "elsewhere/part1"):
        (tmp_path / part).mkdir(parents=True)
        with webdataset.TarWriter(str(tmp_path / part / "data-0.tar")) as writer:
            writer.write({"__key__": part.replace("/", "-"), "jpg": photo, "txt": "A photo."})
    (tmp_path / "src" / "part1").symlink_to(tmp_path / "elsewhere" / "part1")
    (tmp_path / "src" / "part0" / "up").symlink_to(tmp_path / "src")
    # hidden files left out, as `DIR/*.tar` leaves them: macOS's ._NAME beside a tar copied
    # off a Mac (no tar: it refused the folder), a hidden tar (indexed, trained)
    (tmp_path / "src" / "part0" / "._data-0.tar").write_bytes(b"\x00\x05\x16\x07" * 1024)
    shutil.copy(tmp_path / "src" / "part0" / "data-0.tar", tmp_path / "src" / ".data-1.tar")
    with contextlib.redirect_stderr(io.StringIO()) as said:
        built = index([str(tmp_path / "src")], str(tmp_path / "idx"),
                      IndexOptions(workers=0, progress=False, check="header"))
    assert built["totals"]["samples"] == 2 and built["totals"]["shards"] == 2, built["totals"]
    assert f"{tmp_path / 'src'}: 2 hidden tar(s) left out, e.g. .data-1.tar (1 of them " \
        "macOS's ._NAME, the metadata it writes beside each file it copies: no tar): name a " \
        "hidden tar to index it" in said.getvalue()


def test_a_tif_member_is_read_as_an_image(corpus_photos, tmp_path):
    """``KEY.tif`` + ``KEY.txt`` (a TIFF under its other common name): indexed, its image
    probed from its bytes, not refused as a sample without a medium."""
    from PIL import Image

    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.reader import ShardReader

    _, data, _, _ = corpus_photos[0]
    tiff = io.BytesIO()
    with Image.open(io.BytesIO(data)) as photo:
        photo.convert("RGB").save(tiff, format="TIFF")
        size = photo.size
    (tmp_path / "src").mkdir()
    with webdataset.TarWriter(str(tmp_path / "src" / "tif-000000.tar")) as writer:
        writer.write({"__key__": "t0", "tif": tiff.getvalue(), "txt": "A photo."})
    with contextlib.redirect_stderr(io.StringIO()):
        index([str(tmp_path / "src")], str(tmp_path / "idx"),
              IndexOptions(workers=0, progress=False))
    [item] = ShardReader(str(tmp_path / "idx")).record(0)["media"]
    assert (item["member"], item["format"], (item["width"], item["height"])) == \
        ("tif", "tiff", size)


def test_a_caption_read_from_the_json_keeps_its_url_in_the_source():
    """``--text-member 'json[caption]'``: the caption is the JSON's field, and the same JSON's
    ``url`` and ``key`` still go to the record's ``source``."""
    from mimo_data.shards.layouts import MemberMap, synthesize

    meta = b'{"url": "https://example.com/a.jpg", "key": "000", "caption": "A cat."}'
    made = synthesize({"jpg": b"", "json": meta}, MemberMap("pairs", text="json[caption]"))
    assert made.fields["text"] == "A cat." and made.counts == {}
    assert made.source == {"url": "https://example.com/a.jpg", "key": "000"}
    # the JSON without the field: a medium without its caption, missing_text
    from mimo_data.shards.records import RecordError
    with pytest.raises(RecordError) as caught:
        synthesize({"jpg": b"", "json": meta}, MemberMap("pairs", text="json[alt_text]"))
    assert (caught.value.reason, caught.value.detail) == (
        "missing_text",
        "the caption: member KEY.json has no json[alt_text] (its keys there: caption, key, url)")
    # several captions (LAION-CLAP's ``text`` list): the first trains, counted
    made = synthesize({"flac": b"", "json": b'{"text": ["A man reads.", "Speech."]}'},
                      MemberMap("pairs", text="json[text]"))
    assert made.fields["text"] == "A man reads."
    assert made.counts == {"texts_chosen_from_several": 1}
    # a field map naming JSON members whole (Energon decodes them): a list, not its text
    made = synthesize({"jpg": b"", "question.txt": b"What is it?",
                       "answers.json": b'["Bricks.", "A wall."]', "weights.json": b"[1, 2]"},
                      MemberMap("vqa", media="jpg", question="question.txt",
                                text="answers.json", weights="weights.json"))
    assert made.fields["messages"][1] == {"role": "assistant", "content": "A wall."}
    assert made.counts == {"texts_chosen_from_several": 1}
    # weights cut short: the sample's fault (malformed_json), not a sample without weights
    with pytest.raises(RecordError) as caught:
        synthesize({"jpg": b"", "question.txt": b"What is it?",
                    "answers.json": b'["Bricks.", "A wall."]', "weights.json": b"[1, 2"},
                   MemberMap("vqa", media="jpg", question="question.txt",
                             text="answers.json", weights="weights.json"))
    assert caught.value.reason == "malformed_json", caught.value


def test_inspect_reports_the_index_as_the_build(conversations, capsys, tmp_path, monkeypatch):
    """``mimo-inspect report`` on both: the same token counts, every check passing (media
    metadata against samples.parquet too), with the cache beside the index."""
    from mimo_data.inspect.cli import main

    root, _ = conversations
    reports = {}
    for name in ("built", "indexed"):
        out = tmp_path / f"{name}.json"
        code = main(["report", str(root / name), "--config", str(PREPROCESS), "--json",
                     str(out), "--no-progress"])
        assert code == 0, capsys.readouterr().err
        reports[name] = json.loads(out.read_text())
    indexed, built = reports["indexed"], reports["built"]
    assert indexed["passed"] and all(check["passed"] for check in indexed["checks"])
    assert (indexed["samples"], indexed["kept"]) == (built["samples"], built["kept"]) == (12, 12)
    assert indexed["tokens"] == built["tokens"]
    assert {m: d["tokens"] for m, d in indexed["modalities"].items()} == \
        {m: d["tokens"] for m, d in built["modalities"].items()}
    # the build's own folder given to index: a dataset already, not tars to index again
    code, _, err = cli_main(capsys, "index", root / "built", "--output", tmp_path / "again")
    assert code == 2 and f"{root / 'built'} is a mimo dataset already (its index.json" in err \
        and not (tmp_path / "again").exists(), err
    # a build stopped before its index (its tars and its claim, as a killed bucket build
    # leaves them): no dataset to index, nor said to be tars to index
    import shutil

    from mimo_data.shards.index import DatasetError
    from mimo_data.shards.reader import ShardReader
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    for tar in (root / "built").glob("*.tar"):
        shutil.copy(tar, stopped)
    (stopped / ".mimo-claim").write_text("{}")
    code, _, err = cli_main(capsys, "index", stopped, "--output", tmp_path / "again")
    assert code == 2 and f"{stopped} holds a mimo-shard build's claim (.mimo-claim): its tars " \
        "are a build still running, or one stopped before its index.json" in err \
        and not (tmp_path / "again").exists(), err
    with pytest.raises(DatasetError, match="no index.json, so this is not a complete dataset "
                       r"\(an interrupted build or indexing\?\)"):
        ShardReader(str(stopped))
    # its index.json unread for a store that kept failing: that failure, not its tars indexed
    from mimo_data.shards import storage

    def failing(location, *args, **kwargs):
        raise storage.StorageError(f"reading {location}: still failing after 5 tries")
    monkeypatch.setattr(storage, "read_bytes", failing)
    code, _, err = cli_main(capsys, "index", root / "built", "--output", tmp_path / "again")
    assert code == 1 and f"{root / 'built'}/index.json: still failing" in err \
        and not (tmp_path / "again").exists(), err


# ------------------------------------------------------------------------------ documents

def test_documents_become_document_records_as_the_build_makes_them(corpus_photos, tmp_path):
    """OBELICS-shaped documents as tar members (``KEY.json`` with ``texts`` + ``images``, the
    images ``KEY.jpg`` or ``KEY.0.jpg``, ``KEY.1.png``): each record's text is the texts and an
    ``<image>`` per image joined by newlines (written out here by hand), its media the members
    by number, and both equal ``mimo-shard build``'s records of the same documents; a document
    whose image count disagrees with its members and one without text are counted."""
    from mimo_data.shards.build import BuildOptions, build
    from mimo_data.shards.in_place import IndexOptions, index
    from mimo_data.shards.reader import ShardReader

    (a, a_data, _, _), (b, b_data, _, _), (c, c_data, _, _) = corpus_photos[:3]
    (tmp_path / "images").mkdir()
    for name, data in ((a, a_data), (b, b_data), (c, c_data)):
        (tmp_path / "images" / name).write_bytes(data)
    documents = [  # (texts, images, members, the text expected)
        (["A first paragraph.", None, "Between the two.", None, "The end."],
         [None, a, None, b, None], {f"0.{_extension(a)}": a_data, f"1.{_extension(b)}": b_data},
         "A first paragraph.\n<image>\nBetween the two.\n<image>\nThe end."),
        ([None, "Only after an image."], [c, None], {_extension(c): c_data},
         "<image>\nOnly after an image."),
        (["No image at all."], [None], {}, "No image at all."),
        (["Two images named,", None, None], [None, a, b], {_extension(a): a_data}, None),
        ([None, None], [a, b], {"0.jpg": a_data, "1.jpg": b_data}, None),
    ]
    jsonl = []
    (tmp_path / "tars").mkdir()
    with webdataset.ShardWriter(str(tmp_path / "tars" / "docs-%06d.tar"), maxcount=PER_TAR,
                                verbose=0) as writer:
        for number, (texts, images, members, _) in enumerate(documents):
            writer.write({"__key__": f"d{number:04d}",
                          "json": {"id": f"d{number}", "texts": texts, "images": images},
                          **members})
            jsonl.append({"id": f"d{number}", "texts": texts,
                          "images": [None if i is None else str(tmp_path / "images" / i)
                                     for i in images]})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        index([str(tmp_path / "tars" / "docs-*.tar")], str(tmp_path / "indexed"),
              IndexOptions(workers=0, progress=False))
    assert "layout documents (detected" in err.getvalue()
    report = json.loads((tmp_path / "indexed" / "report.json").read_text())
    assert {reason: entry["count"] for reason, entry in report["skipped_by_reason"].items()} \
        == {"marker_mismatch": 1, "empty_document": 1}
    build([str(write_jsonl(tmp_path / "docs.jsonl", jsonl[:3]))], str(tmp_path / "built"),
          BuildOptions(workers=0, progress=False))
    indexed, built = ShardReader(str(tmp_path / "indexed")), ShardReader(str(tmp_path / "built"))
    assert len(indexed) == len(built) == 3
    for position, (_, _, members, text) in enumerate(documents[:3]):
        ours, theirs = indexed.record(position), built.record(position)
        assert (ours["kind"], ours["text"], ours["id"]) == ("document", text, f"d{position}")
        assert (theirs["kind"], theirs["text"]) == ("document", text)
        assert [item["member"] for item in ours["media"]] == list(members)
        assert [indexed.read_member(position, item["member"]) for item in ours["media"]] == \
            list(members.values())
        for item, other in zip(ours["media"], theirs["media"], strict=True):
            assert {k: v for k, v in item.items() if k not in ("member", "path")} == \
                {k: v for k, v in other.items() if k not in ("member", "path")}


def test_training_on_the_index_equals_training_on_the_build(ranks, conversations):
    """Non-colocated (the tower's rank reads media by offset, the language rank records
    only): the same per-step losses from both datasets; resumed from the index's step-2
    checkpoint, step 3 again. New jobs: no existing run reads a dataset indexed in place."""
    root, _ = conversations
    common = ["layout=image=dp1;language=dp1", "train.steps=3", "train.global_batch_size=4",
              "train.micro_batch_size=2", "checkpoint.interval=2"]
    runs = {name: train(ranks, root, name, CONFIG, f"data.datasets=[{root / name}]", *common,
                        f"checkpoint.dir={root / name}-ckpt", nproc=2)
            for name in ("built", "indexed")}
    losses = {name: [(r["step"], r["tokens"], r["loss"]) for r in train_records(records)]
              for name, records in runs.items()}
    assert [step for step, _, _ in losses["indexed"]] == [1, 2, 3]
    for (_, tokens, loss), (_, built_tokens, built_loss) in zip(losses["indexed"],
                                                                losses["built"]):
        assert tokens == built_tokens > 0
        assert abs(loss - built_loss) <= 1e-6, losses
    resume = copy_checkpoint(root / "indexed-ckpt" / "step_0000002", root / "resume")
    resumed = train(ranks, root, "resumed", CONFIG, f"data.datasets=[{root / 'indexed'}]",
                    *common, f"checkpoint.dir={resume}", nproc=2)
    assert_continues(resumed, runs["indexed"], [3], loss=1e-6, grad_norm_rel=1e-6)


def test_a_tar_written_again_since_its_indexing_is_said(pairs, capsys, tmp_path, monkeypatch):
    """A tar written again in place after its indexing, at the same size (its text member
    edited: training reads the text from the index, so it would train the old one without a
    word): the start-up check reads its samples' text, names the member that changed and
    says to index again; indexing again into that folder says to pass --overwrite, not to
    train from it as it is. The same bytes written again (a copy) start. An index made before
    indexes recorded the tars' versions is read as before (unchecked). A copy's check is kept;
    an edit after it is read again."""
    from mimo_data.shards.index import DatasetError
    from mimo_data.shards.reader import ShardReader
    (tmp_path / "tars").mkdir()
    tar = tmp_path / "tars" / "pairs-000001.tar"
    shutil.copy(pairs.src / "pairs-000001.tar", tar)
    # beside it a tar of no kept sample (its one sample repeats a suffix): in the index, not
    # in the sample table
    write_tar(tmp_path / "tars" / "dup.tar", {"1.jpg": b"x", "1.txt": b"a", "1.TXT": b"b"})
    made = ("index", tmp_path / "tars", "--output", tmp_path / "idx", "--workers", "0",
            "--no-progress")
    code, _, err = cli_main(capsys, *made)
    assert code == 0, err
    reader = ShardReader(str(tmp_path / "idx"))
    read: list = []
    monkeypatch.setattr(ShardReader, "read_member", lambda self, *member: read.append(member))
    reader.check_shards()                                    # as indexed: nothing read
    dup = tmp_path / "tars" / "dup.tar"
    os.utime(dup, ns=(dup.stat().st_mtime_ns + 10**9,) * 2)
    capsys.readouterr()
    reader.check_shards()                                    # written again, of no sample
    assert read == [] and "written again" not in capsys.readouterr().err
    monkeypatch.undo()
    key = reader.table.key(3)
    offset, size, _ = reader.table.members(3)["txt"]
    flip_byte(tar, offset)
    later = tar.stat().st_mtime_ns + 10**9
    os.utime(tar, ns=(later, later))
    with pytest.raises(DatasetError, match=rf"pairs-000001.tar: sample {key} member {key}.txt: "
                       r"its bytes changed since its indexing .*index the tars again where "
                       r"they are now"):
        ShardReader(str(tmp_path / "idx")).check_shards()
    # mimo-inspect sample shows the index's text: it checks the tars first, as a run does
    from mimo_data.inspect.cli import main as inspect_main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = inspect_main(["sample", str(tmp_path / "idx"), "--key", key, "--config",
                             str(REPO / "configs" / "preprocess.yaml")])
    assert code == 1 and f"sample {key} member {key}.txt: its bytes changed" in err.getvalue(), \
        err.getvalue()
    code, _, err = cli_main(capsys, *made)
    assert code == 2 and "already holds an index of these tars, but 2 of them were written " \
        "again since (dup.tar, pairs-000001.tar): their text may differ from the index's, " \
        "which a run checks at start-up; pass --overwrite to index them again" in err, err
    # one of them grown since (another size): said as what a run does with it, refuse
    size = tar.stat().st_size
    with open(tar, "ab") as grown:
        grown.write(b"\0" * 512)
    code, _, err = cli_main(capsys, *made)
    assert code == 2 and "(dup.tar, pairs-000001.tar): 1 of another size, which a run refuses " \
        "the index for; pass --overwrite to index them again" in err, err
    os.truncate(tar, size)
    os.utime(tar, ns=(later, later))
    # the same bytes at another time of writing (a copy): the text found as indexed, read
    # once (said), not at the next start-up
    flip_byte(tar, offset)
    os.utime(tar, ns=(later, later))
    capsys.readouterr()
    ShardReader(str(tmp_path / "idx")).check_shards()
    said = capsys.readouterr().err
    assert f"{tmp_path / 'idx'}: 2 tars were written again since their indexing (dup.tar, " \
        f"pairs-000001.tar; a copy?): reading their {reader.table.shard_sizes()[0]} samples' " \
        "text to check it against the index's, once" in said, said
    monkeypatch.setattr(ShardReader, "read_member", lambda self, *member: read.append(member))
    ShardReader(str(tmp_path / "idx")).check_shards()
    assert read == [] and "written again" not in capsys.readouterr().err
    monkeypatch.undo()
    # its text edited after that check (written again, at the same size): read again, not
    # passed by the copy's check kept
    flip_byte(tar, offset)
    os.utime(tar, ns=(later + 10**9, later + 10**9))
    with pytest.raises(DatasetError, match=rf"pairs-000001.tar: sample {key} member {key}.txt: "
                       r"its bytes changed"):
        ShardReader(str(tmp_path / "idx")).check_shards()
    flip_byte(tar, offset)
    # a cache that takes no table (read-only): the text is read once all the same, said once
    import errno

    from mimo_data.shards import cache
    os.utime(tar, ns=(later + 2 * 10**9, later + 2 * 10**9))
    write_table, refused = cache.write_table, []

    def read_only(path, *args):
        if not refused:
            refused.append(path)
            raise OSError(errno.EROFS, "Read-only file system", path)
        write_table(path, *args)
    monkeypatch.setattr(cache, "write_table", read_only)
    read_member, read = ShardReader.read_member, []
    monkeypatch.setattr(ShardReader, "read_member",
                        lambda self, *member: read.append(member) or read_member(self, *member))
    capsys.readouterr()
    ShardReader(str(tmp_path / "idx")).check_shards()
    said = capsys.readouterr().err
    assert refused and said.count("samples' text to check it") == 1, said
    assert len(read) == len(set(read)) == reader.table.shard_sizes()[0] * 2, read
    monkeypatch.undo()
    index = json.loads((tmp_path / "idx" / "index.json").read_text())
    for shard in index["shards"]:
        del shard["version"]
    (tmp_path / "idx" / "index.json").write_text(json.dumps(index))
    flip_byte(tar, offset)
    ShardReader(str(tmp_path / "idx")).check_shards()
    code, _, err = cli_main(capsys, *made)
    assert code == 2 and "an index of these tars, read the same way" in err, err


def test_verify_checks_the_tars_where_they_are(pairs, capsys, tmp_path):
    """The whole index verifies (its left-out samples and truncated tars as indexed); a byte
    changed inside an indexed tar's image is named by its sample and member."""
    from mimo_data.shards.reader import ShardReader

    code, out, err = cli_main(capsys, "verify", pairs.out, "--no-progress")
    assert code == 0 and "OK" in out, err
    (tmp_path / "tars").mkdir()
    shutil.copy(pairs.src / "pairs-000001.tar", tmp_path / "tars")
    code, _, err = cli_main(capsys, "index", tmp_path / "tars" / "pairs-000001.tar", "--output",
                            tmp_path / "idx", "--workers", "0", "--no-progress")
    assert code == 0, err
    reader = ShardReader(str(tmp_path / "idx"))
    key = reader.table.key(2)
    [item] = reader.record(2)["media"]
    offset, size, _ = reader.table.members(2)[item["member"]]
    flip_byte(tmp_path / "tars" / "pairs-000001.tar", offset + size // 2)
    code, _, err = cli_main(capsys, "verify", tmp_path / "idx", "--no-progress")
    assert code == 1
    assert f"sample {key} member {key}.{item['member']}: its bytes changed" in err
    assert "pairs-000001.tar: sha256 differs from the index (the file changed after its " \
        "indexing)" in err, err
    # a sample appended to the tar since (tar rf) past its padding: said so, with what to do,
    # once
    shutil.copy(pairs.src / "pairs-000001.tar", tmp_path / "tars")
    size = (tmp_path / "tars" / "pairs-000001.tar").stat().st_size
    with tarfile.open(tmp_path / "tars" / "pairs-000001.tar", "a") as tar:
        added = tarfile.TarInfo("zzz.txt")
        added.size = 30_000
        tar.addfile(added, io.BytesIO(b"A" * added.size))
    grown = (tmp_path / "tars" / "pairs-000001.tar").stat().st_size - size
    code, _, err = cli_main(capsys, "verify", tmp_path / "idx", "--no-progress")
    assert code == 1 and f"pairs-000001.tar: {grown:,} bytes longer than the index says" in err \
        and "index the tars again (`mimo-shard index ... --overwrite`)" in err, err
    assert "FAILED, 1 problem(s)" in err and "every member sits" not in err, err
    assert err.rstrip().endswith("or index the tars again where they are now (`mimo-shard "
                                 "index`)"), err
    # the tars moved: verify says where it looked, and to index them where they are now
    shutil.move(tmp_path / "tars", tmp_path / "moved")
    code, _, err = cli_main(capsys, "verify", tmp_path / "idx", "--no-progress")
    assert code == 1 and f"pairs-000001.tar: missing, not at {tmp_path / 'tars'}/pairs-000001" \
        ".tar, where the index says the tars are (moved? index them again" in err, err
    # and a reader (training, the report's pages) says to index them again, not to rebuild
    from mimo_data.shards.index import DatasetError
    with pytest.raises(DatasetError, match=r"then restore the shards or index the tars again "
                       r"where they are now \(`mimo-shard index`\)"):
        ShardReader(str(tmp_path / "idx")).check_shards()


def test_a_tar_that_lost_samples_since_its_indexing_names_each_one(pairs, capsys, tmp_path):
    """A tar written again with only its first samples (the end blocks after them): verify
    names each indexed sample the tar no longer holds, and does not say that every member sits
    where the table says with the change in headers or padding."""
    (tmp_path / "tars").mkdir()
    tar_path = tmp_path / "tars" / "pairs-000001.tar"
    shutil.copy(pairs.src / "pairs-000001.tar", tar_path)
    code, _, err = cli_main(capsys, "index", tar_path, "--output", tmp_path / "idx",
                            "--workers", "0", "--no-progress")
    assert code == 0, err
    with tarfile.open(tar_path) as tar:
        infos = tar.getmembers()
    keys = list(dict.fromkeys(info.name.partition(".")[0] for info in infos))
    assert len(keys) == PER_TAR
    cut = next(info.offset for info in infos if info.name.startswith(keys[2] + "."))
    tar_path.write_bytes(tar_path.read_bytes()[:cut] + bytes(2 * 512))
    code, _, err = cli_main(capsys, "verify", tmp_path / "idx", "--no-progress")
    assert code == 1, err
    for key in keys[2:]:
        assert f"shard pairs-000001.tar: sample {key} is not in the tar" in err, err
    for key in keys[:2]:
        assert f"sample {key}" not in err, err
    assert "every member sits" not in err and "headers or padding" not in err, err


def test_a_vqa_ocr_sample_s_ocr_fields_are_said_as_not_read(tmp_path):
    """A VQAOCRSample's OCR fields (its text, words) are Energon's, not mimo's: said."""
    from mimo_data.shards import energon
    (tmp_path / ".nv-meta").mkdir()
    (tmp_path / ".nv-meta" / "dataset.yaml").write_text(
        "sample_type: {__module__: megatron.energon, __class__: VQAOCRSample}\n"
        "field_map: {image: jpg, context: 'json[q]', answers: 'json[a]', text: 'json[ocr]'}\n")
    mapping, unread = energon.member_map(str(tmp_path))
    assert mapping.layout == "vqa" and unread == [
        f"{tmp_path / '.nv-meta' / 'dataset.yaml'}: field_map.text (a VQAOCRSample's OCR) is "
        "not read: mimo trains the question and its answer"]

