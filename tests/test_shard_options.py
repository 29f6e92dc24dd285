"""Build options: shard sizing, determinism (workers, shuffle seeds), overwrite protection."""

from __future__ import annotations

import errno
import math
import os
import shutil

import pytest

from conftest import (all_samples, build_dataset, cli_main, file_bytes, origin_of, read_json,
                      sample_records, shard_paths, tar_samples, write_jsonl)


def test_max_samples_per_shard(tmp_path, corpus_inputs, corpus_expected):
    n = len(corpus_expected)
    index = build_dataset(corpus_inputs, tmp_path / "out", max_samples_per_shard=3)
    shards = shard_paths(tmp_path / "out")
    assert len(shards) == math.ceil(n / 3) == len(index["shards"])
    counts = [len(tar_samples(path)) for path in shards]
    assert counts == [3] * (n // 3) + ([n % 3] if n % 3 else [])
    assert [s["samples"] for s in index["shards"]] == counts
    assert sum(s["samples"] for s in index["shards"]) == n == index["totals"]["samples"]


@pytest.mark.parametrize("limit", [150_000, 200_000, 300_000, 500_000])
def test_max_shard_bytes_bounds_every_shard_file(tmp_path, corpus_inputs, corpus_expected, limit):
    build_dataset(corpus_inputs, tmp_path / "out", max_shard_bytes=limit)
    shards = shard_paths(tmp_path / "out")
    counts = {path.name: len(tar_samples(path)) for path in shards}
    assert sum(counts.values()) == len(corpus_expected)
    assert len(shards) > 1 and max(counts.values()) > 1, "the limit should group some samples"
    for path in shards:
        size = os.path.getsize(path)
        assert size <= limit or counts[path.name] == 1, (
            f"{path.name}: {size} bytes > --max-shard-bytes {limit} with "
            f"{counts[path.name]} samples")


def test_no_shard_passes_max_shard_bytes_even_by_its_end_of_archive_blocks(tmp_path):
    """The writer closes a shard before a sample that would take it past the limit, counting
    what closing adds (two zero blocks, padding to a whole 10 KiB record): swept over limits
    and samples of many sizes, shards whose members end within a record's last 1024 bytes (the
    end blocks then take a record of their own) included, no shard of more than one sample is
    larger than the limit, and the sizes the writer records are the files'."""
    from mimo_data.shards.writer import ShardSet
    lengths = [700, 3000, 100, 9000, 1500, 4600, 20, 7000, 2500, 600, 11000, 300]
    tight = 0           # shards whose last record holds nothing but the end blocks
    for number, limit in enumerate(range(20_480, 20_480 + 20 * 9_728, 9_728)):
        folder = tmp_path / str(limit)
        folder.mkdir()
        shards = ShardSet(str(folder), "data", max_samples=1_000, max_bytes=limit)
        ends = {}
        for n in range(60):
            data = bytes([n]) * lengths[(n + number) % len(lengths)]
            name, [record] = shards.add(f"{n:06d}", {"bin": data})
            ends[name] = record["offset"] + record["size"]
        written = shards.close()
        assert sum(shard["samples"] for shard in written) == 60
        for shard in written:
            size = os.path.getsize(folder / shard["name"])
            assert size == shard["bytes"], shard
            assert size <= limit or shard["samples"] == 1, (
                f"{shard['name']}: {size} bytes > max_bytes {limit} with "
                f"{shard['samples']} samples")
            tight += -(-ends[shard["name"]] // 512) * 512 <= size - 10_240
    assert tight > 5, tight


def test_a_sample_larger_than_max_shard_bytes_gets_its_own_shard(tmp_path, corpus_inputs,
                                                                  corpus_expected):
    build_dataset(corpus_inputs, tmp_path / "out", max_shard_bytes=1)
    counts = [len(tar_samples(path)) for path in shard_paths(tmp_path / "out")]
    assert counts == [1] * len(corpus_expected)


def test_builds_are_byte_identical_whatever_the_workers(tmp_path, corpus_inputs, corpus_build):
    build_dataset(corpus_inputs, tmp_path / "w1", workers=1, max_samples_per_shard=20)
    build_dataset(corpus_inputs, tmp_path / "w2", workers=2, max_samples_per_shard=20)
    one, two = file_bytes(tmp_path / "w1"), file_bytes(tmp_path / "w2")
    assert sorted(one) == sorted(two)
    assert sum(name.endswith(".tar") for name in one) > 1
    for name in one:
        assert one[name] == two[name], f"{name} differs between --workers 1 and 2"
    # The index must not depend on where the dataset was written.
    for directory in (tmp_path / "w1", tmp_path / "w2", corpus_build):
        text = (directory / "index.json").read_text()
        assert str(directory) not in text
    # Same inputs and options as the session build, other directory: same bytes.
    build_dataset(corpus_inputs, tmp_path / "again")
    assert file_bytes(tmp_path / "again") == file_bytes(corpus_build)


def test_shuffle_seed_changes_the_order_not_the_samples(tmp_path, corpus_inputs, corpus_build):
    orders = {}
    for seed in (1, 2):
        build_dataset(corpus_inputs, tmp_path / f"seed{seed}", shuffle=True, seed=seed)
        orders[seed] = [origin_of(s) for s in sample_records(tmp_path / f"seed{seed}")]
    plain = [origin_of(s) for s in sample_records(corpus_build)]
    assert orders[1] != orders[2]
    assert orders[1] != plain and orders[2] != plain
    assert sorted(orders[1]) == sorted(orders[2]) == sorted(plain)
    assert len(set(orders[1])) == len(plain)
    # keys still follow the write order, so a shuffled dataset stays sorted by key
    keys = [key for _, key, _ in all_samples(tmp_path / "seed1")]
    assert keys == sorted(keys)


# ------------------------------------------------------------------------- overwrite rules

@pytest.fixture
def small_input(tmp_path, good_records):
    return write_jsonl(tmp_path / "small.jsonl", good_records)


def test_existing_dataset_needs_overwrite(capsys, tmp_path, corpus_build, small_input,
                                          good_records):
    out = tmp_path / "dataset"
    shutil.copytree(corpus_build, out)
    before = file_bytes(out)

    code, _, err = cli_main(capsys, "build", small_input, "-o", out, "--no-progress")
    assert code == 2
    assert "--overwrite" in err and str(out) in err
    assert file_bytes(out) == before, "a refused build changed the existing dataset"

    # --overwrite: a build that stops (--strict, at a bad record after good ones) or keeps no
    # sample leaves the old dataset whole; the latter's report beside it, named
    bad = dict(good_records[0], id="bad", image=str(tmp_path / "absent.jpg"))
    stops = write_jsonl(tmp_path / "stops.jsonl", [*good_records, bad])
    code, _, err = cli_main(capsys, "build", stops, "-o", out, "--no-progress", "--overwrite",
                            "--strict", "--max-samples-per-shard", "1")
    assert code == 1 and "absent.jpg" in err, err
    assert file_bytes(out) == before, "a failed build changed the dataset it was to replace"
    # a disk that fills up: exit 1 saying so, the old dataset whole, no traceback
    from mimo_data.shards import build as build_module

    def disk_full(self, *_):
        raise OSError(errno.ENOSPC, "No space left on device",
                      str(out / ".staging" / "data-000000.tar"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module._SamplesTable, "add", disk_full)
        code, _, err = cli_main(capsys, "build", small_input, "-o", out, "--no-progress",
                                "--overwrite")
    assert code == 1 and f"no room left on the disk of --output {out} (No space left on " \
        "device, writing data-000000.tar): " in err and " files free there now; the run's " \
        "files are removed, and the dataset there is as it was" in err, err
    assert "Traceback" not in err and file_bytes(out) == before
    nothing = write_jsonl(tmp_path / "nothing.jsonl", [bad])
    code, _, err = cli_main(capsys, "build", nothing, "-o", out, "--no-progress", "--overwrite")
    assert code == 1 and f"(see {out / 'report.failed.json'}; skipped.failed.jsonl beside it " \
        f"lists every skipped record); the dataset at {out} is as it was" in err, err
    after = file_bytes(out)
    assert read_json(out / "report.failed.json")["records_skipped"] == 1
    assert read_json(out / "skipped.failed.jsonl")["location"] == f"{nothing}:1"
    assert {n: b for n, b in after.items()
            if n not in ("report.failed.json", "skipped.failed.jsonl")} == before
    (out / ".staging").mkdir()                      # a later build that runs (or died)
    code, text, _ = cli_main(capsys, "info", out)
    assert code == 0 and "\nbeside    report.failed.json: the report of a later build with " \
        "--overwrite that kept no sample (this dataset stayed as it was; its skipped records " \
        "listed in skipped.failed.jsonl)\nbeside    .staging: " \
        "a later build's files (running, or it failed or was killed" in text, text
    (out / ".staging").rmdir()

    # one that completes replaces the old dataset's files alone: what a killed run left goes
    # (its staging, a cut index write), what appeared meanwhile (not the build's) stays
    (out / ".staging").mkdir()
    (out / ".staging" / "data-000007.tar").write_bytes(b"a killed build's shard")
    (out / "index.json.tmp-123").write_text("{")
    real_add = build_module._SamplesTable.add

    def meanwhile(self, *args):
        (out / "notes.txt").write_text("mine")
        real_add(self, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module._SamplesTable, "add", meanwhile)
        code, _, err = cli_main(capsys, "build", small_input, "-o", out, "--no-progress",
                                "--overwrite")
    assert code == 0, err
    assert read_json(out / "index.json")["totals"]["samples"] == len(good_records)
    assert [s["id"] for s in sample_records(out)] == [r["id"] for r in good_records]
    assert len(shard_paths(out)) == 1
    assert sorted(os.listdir(out)) == [".mimo-cache", "data-000000.tar", "index.json",
                                       "notes.txt", "report.json", "samples.parquet",
                                       "skipped.jsonl"]


def test_foreign_files_block_the_build_and_stay(capsys, tmp_path, small_input):
    out = tmp_path / "not-a-dataset"
    (out / "notes").mkdir(parents=True)
    (out / "README.txt").write_text("my notes\n")
    (out / "notes" / "todo.txt").write_text("keep me\n")
    before = file_bytes(out)

    for extra in ((), ("--overwrite",)):
        code, _, err = cli_main(capsys, "build", small_input, "-o", out, "--no-progress", *extra)
        assert code == 2
        assert "README.txt" in err
        assert file_bytes(out) == before
        assert sorted(os.listdir(out)) == ["README.txt", "notes"]
    # a WebDataset folder of the user's, its tars named as a build's shards are: nothing there
    # says a build wrote them (no index, staging, table or killed build's claim): they stay
    wds = tmp_path / "my-webdataset"
    wds.mkdir()
    for name in ("data-000000.tar", "shard-000001.tar", "skipped.jsonl"):    # (a list of its
        (wds / name).write_bytes(b"a user's tar\n")                # own, beside no report)
    before = file_bytes(wds)
    for extra in ((), ("--overwrite",)):
        code, _, err = cli_main(capsys, "build", small_input, "-o", wds, "--no-progress", *extra)
        assert code == 2 and "a build did not write (data-000000.tar, shard-000001.tar, " \
            "skipped.jsonl)" in err
        assert "`mimo-shard index`" in err, err
        assert file_bytes(wds) == before


def test_an_output_that_cannot_be_created_is_a_usage_error(capsys, tmp_path, small_input,
                                                           corpus_build, monkeypatch):
    """A file where a parent folder of --output should be: exit 2 with one line naming the
    output, for build and index alike, not a traceback."""
    (tmp_path / "afile").write_text("in the way\n")
    out = tmp_path / "afile" / "out"
    for args in (("build", small_input), ("index", f"{corpus_build}/*.tar")):
        code, _, err = cli_main(capsys, *args, "-o", out, "--no-progress")
        assert code == 2, err
        assert f"error: cannot create --output {out}: [Errno 20] Not a directory" in err, err
        assert "Traceback" not in err
    # a URL with one slash, a scheme no client serves: exit 2 naming them, no folder "s3:"
    monkeypatch.chdir(tmp_path)
    code, _, err = cli_main(capsys, "build", small_input, "-o", "s3:/team-data/x",
                            "--no-progress")
    assert code == 2 and "error: s3:/team-data/x: a URL with one slash after its scheme? " \
        "write s3://team-data/x" in err and not (tmp_path / "s3:").exists(), err
    code, _, err = cli_main(capsys, "info", "s4://team-data/x")
    assert code == 2 and "error: s4://team-data/x: no storage client knows the " \
        "scheme s4://" in err, err
    # a bucket and a prefix joined with a slash too many: another place in the store
    for args in (("info", "s3://team-data//x"), ("build", small_input, "-o", "s3://team-data//x",
                                                  "--no-progress")):
        code, _, err = cli_main(capsys, *args)
        assert code == 2 and "error: s3://team-data//x" in err and ": an empty part (//) " \
            "after the bucket: an object store keeps it in the key, a place other than the " \
            "one meant; write s3://team-data/x\n" in err, err
    from mimo_data.shards import storage
    for fine in ("s3://team-data/x?signed=a//b", "https://host//x", "memory://a//b"):
        storage.check_scheme(fine)          # a query's, HTTP's and no store's // are kept
    # a folder that takes no writes (read-only, another user's): the same, before any record,
    # at its first write (the claim) or its staging folder
    from mimo_data.shards import swap
    from mimo_data.shards.format import CLAIM_FILE

    def denied(folder, *_):
        raise PermissionError(errno.EACCES, "Permission denied", f"{folder}/.staging")

    real_open = os.open

    def claim_denied(path, *args, **kwargs):
        if str(path).endswith(CLAIM_FILE):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    for module, first_write, refusal in ((os, "open", claim_denied),
                                         (swap, "staging_in", denied)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, first_write, refusal)
            for args in (("build", small_input), ("index", f"{corpus_build}/*.tar")):
                code, _, err = cli_main(capsys, *args, "-o", tmp_path / "ro", "--no-progress")
                assert code == 2 and f"error: cannot write into --output {tmp_path / 'ro'}: " \
                    "[Errno 13] Permission denied" in err, err


def test_ctrl_c_is_one_line_and_leaves_nothing(capsys, tmp_path, small_input, monkeypatch):
    from mimo_data.shards import build as build_module

    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_module, "_build_into", interrupted)
    code, _, err = cli_main(capsys, "build", small_input, "-o", tmp_path / "out",
                            "--no-progress")
    assert (code, err) == (130, "mimo-shard build: interrupted: no new index was written "
                           "(under --overwrite the old dataset stays, unless its replacement "
                           "had begun); run it again\n")
    assert not (tmp_path / "out").exists()


def test_inputs_that_cannot_be_what_was_meant_are_refused(capsys, tmp_path, small_input,
                                                          good_records):
    """A --media-root that is no folder (exit 2: the records' relative paths would all be
    missing), a folder given as an input (2), inputs with no record at all (1: an export that
    failed); ids repeated across two inputs, each numbering its own records, are counted
    duplicates whose detail says to build each input into its own dataset; an input among
    several that gives no sample (empty, every record skipped) is warned of by name, and
    report.json's inputs say what each gave."""
    code, _, err = cli_main(capsys, "build", small_input, "-o", tmp_path / "a", "--no-progress",
                            "--media-root", tmp_path / "nowhere")
    assert code == 2 and f"--media-root {tmp_path / 'nowhere'} is not a folder" in err, err
    code, _, err = cli_main(capsys, "build", tmp_path, "-o", tmp_path / "b", "--no-progress")
    assert code == 2 and f"{tmp_path}: is a folder; give the records' files" in err, err
    # media paths relative to another folder than the input's: most records skipped as
    # missing_media, said with --media-root (given, the one given named)
    image, text = good_records[0], good_records[2]
    (tmp_path / "bare").mkdir()
    bare = write_jsonl(tmp_path / "bare" / "bare.jsonl",
                       [{**image, "image": os.path.basename(image["image"])}, text])
    images = os.path.dirname(image["image"])
    for flags, said in (([], "their media paths are read relative to each input file's "
                             "folder: where they are relative to another, give it as "
                             "--media-root"),
                        (["--media-root", tmp_path / "bare"], "are their media paths "
                         f"relative to --media-root {tmp_path / 'bare'}?"),
                        (["--media-root", images], None)):
        out = tmp_path / f"bare-{len(flags)}-{said is None}"
        code, _, err = cli_main(capsys, "build", bare, "-o", out, "--no-progress", *flags)
        assert code == 0 and (said is None) == ("missing_media" not in err), err
        if said is not None:
            assert f"warning: 1 of the 2 record(s) read were skipped as missing_media, their " \
                f"files not found: {said}" in err, err
    # media given as URLs (mimo downloads none): their own detail says so, no --media-root
    urls = write_jsonl(tmp_path / "bare" / "urls.jsonl",
                       [{**image, "image": "https://example.com/a.jpg"}, text])
    code, _, err = cli_main(capsys, "build", urls, "-o", tmp_path / "urls", "--no-progress")
    assert code == 0 and "missing_media" in err and "--media-root" not in err, err
    # a shard name that is no file name's start; a --seed that nothing would use
    for name in ("a/b", "", ".hidden"):
        with pytest.raises(SystemExit) as stopped:
            cli_main(capsys, "build", small_input, "-o", tmp_path / "b", "--name", name)
        assert stopped.value.code == 2 and f"argument --name: {name!r}: a shard name prefix " \
            "is letters, digits" in capsys.readouterr().err
    code, _, err = cli_main(capsys, "build", small_input, "-o", tmp_path / "b", "--seed", "5")
    assert code == 2 and "--seed is the seed of --shuffle: give --shuffle too" in err, err
    assert not (tmp_path / "b").exists()
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("none.json", "[]")):
        (tmp_path / name).write_text(text)
        code, _, err = cli_main(capsys, "build", tmp_path / name, "-o", tmp_path / f"o-{name}",
                                "--no-progress")
        assert code == 1 and "the inputs hold no record" in err, (name, err)
    # another input numbering its own records (other content: a copy is refused apart)
    other = write_jsonl(tmp_path / "other.jsonl", [{**record, "source": "other export"}
                                                   for record in good_records])
    code, _, err = cli_main(capsys, "build", small_input, other, "-o", tmp_path / "c",
                            "--no-progress")
    assert code == 0, err
    skipped = read_json(tmp_path / "c" / "report.json")["skipped_by_reason"]["duplicate_id"]
    assert skipped["count"] == len(good_records)
    assert skipped["first"][0]["detail"].startswith(
        f"id 'good-1' was already taken by {small_input}:1 in another input: ids are the "
        "dataset's, unique across its inputs; where each input numbers its own records, build "
        "each into its own dataset")
    # an input among several that gave no sample: said, and the report says what each gave
    assert f"warning: input {other}: all {len(good_records)} record(s) skipped" in err, err
    inputs = read_json(tmp_path / "c" / "report.json")["inputs"]
    assert [(i["input"], i["samples_written"]) for i in inputs] == [
        (str(small_input), read_json(tmp_path / "c" / "index.json")["totals"]["samples"]),
        (str(other), 0)]
    for options in ((), ("--shuffle", "--workers", "2")):
        code, _, err = cli_main(capsys, "build", tmp_path / "empty.jsonl", small_input, "-o",
                                tmp_path / "d", "--no-progress", "--overwrite", *options)
        assert code == 0 and err.startswith(
            f"warning: input {tmp_path / 'empty.jsonl'}: no record in it"), err
        assert "warning: input" not in err.replace("warning: input", "", 1), err
        assert [(i["records_read"], i["samples_written"]) for i in read_json(
            tmp_path / "d" / "report.json")["inputs"]] == [(0, 0), (len(good_records),) * 2]


def test_header_check_writes_the_same_samples_on_clean_input(tmp_path, corpus_inputs,
                                                              corpus_build):
    build_dataset(corpus_inputs, tmp_path / "header", check="header")
    header, decode = file_bytes(tmp_path / "header"), file_bytes(corpus_build)
    assert sorted(header) == sorted(decode)
    for name in decode:
        if name != "index.json":           # the index records the option itself
            assert header[name] == decode[name], name
    assert read_json(tmp_path / "header" / "index.json")["build"]["check"] == "header"


def test_header_check_still_catches_truncated_media(tmp_path, assets, good_records):
    jpeg, wav = assets["jpeg"].read_bytes(), assets["wav"].read_bytes()
    (tmp_path / "cut.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (tmp_path / "cut.wav").write_bytes(wav[:44])
    (tmp_path / "half.wav").write_bytes(wav[:len(wav) // 2])     # libsndfile reads it shorter
    bad_image = good_records[0] | {"id": "cut-image", "image": str(tmp_path / "cut.jpg")}
    bad_audio = good_records[1] | {"id": "cut-audio", "audio": str(tmp_path / "cut.wav")}
    half_audio = good_records[1] | {"id": "half-audio", "audio": str(tmp_path / "half.wav")}
    source = write_jsonl(tmp_path / "input.jsonl",
                         [bad_image, *good_records, bad_audio, half_audio])
    build_dataset([source], tmp_path / "out", check="header")
    report = read_json(tmp_path / "out" / "report.json")
    assert {k: v["count"] for k, v in report["skipped_by_reason"].items()} == {
        "corrupt_image": 1, "empty_audio": 1, "corrupt_audio": 1}
    assert [r["id"] for r in sample_records(tmp_path / "out")] == [r["id"] for r in good_records]
