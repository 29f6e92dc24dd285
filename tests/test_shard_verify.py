"""`mimo-shard verify`: a clean build verifies; a changed byte or a missing shard fails it."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile

import pytest

from conftest import (REPO, build_dataset, cli_main, flip_byte, read_json,
                      rewrite_samples_parquet, run_cli, samples_table, write_tar)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, corpus_inputs):
    """The corpus in shards of 10 samples, built once for this module."""
    out = tmp_path_factory.mktemp("verify") / "dataset"
    build_dataset(corpus_inputs, out, max_samples_per_shard=10)
    return out


@pytest.fixture
def dataset(tmp_path, sharded):
    """A private copy to damage."""
    return shutil.copytree(sharded, tmp_path / "dataset")


def _member(directory, suffix: str) -> tuple[dict, dict]:
    """(row, member) of the first media member ending in ``suffix`` past the first shard."""
    rows = samples_table(directory)
    first_shard = rows[0]["shard"]
    for row in rows:
        for member in row["members"]:
            if row["shard"] != first_shard and member["name"].endswith(suffix):
                return row, member
    raise AssertionError(f"no {suffix} member outside the first shard")


def _other_shards(directory, shard: str) -> list[str]:
    return [s["name"] for s in read_json(directory / "index.json")["shards"] if s["name"] != shard]


def _verify(capsys, directory) -> str:
    """``mimo-shard verify`` in this process (its ``main``), expected to fail: its stderr."""
    code, _, err = cli_main(capsys, "verify", directory, "--no-progress")
    assert code == 1, err
    return err


def test_verify_passes_on_a_clean_build(sharded):
    """The console script itself, in a process of its own; the other checks call ``main``."""
    assert len(read_json(sharded / "index.json")["shards"]) > 2
    result = run_cli("verify", sharded, "--no-progress", check_rc=0)
    assert "OK" in result.stdout
    assert "FAILED" not in result.stderr


def test_verify_fails_on_one_flipped_byte_in_a_media_member(capsys, dataset):
    row, member = _member(dataset, ".jpg")
    flip_byte(dataset / row["shard"], member["offset"] + member["size"] // 2)
    err = _verify(capsys, dataset)
    assert row["shard"] in err
    assert "FAILED" in err
    for other in _other_shards(dataset, row["shard"]):
        assert other not in err, f"{other} was not damaged"


def test_verify_fails_when_a_shard_is_deleted(capsys, dataset):
    row, _ = _member(dataset, ".jpg")
    (dataset / row["shard"]).unlink()
    err = _verify(capsys, dataset)
    assert row["shard"] in err and "missing" in err
    for other in _other_shards(dataset, row["shard"]):
        assert other not in err


def test_a_shard_cut_inside_a_member_is_named_and_each_shard_is_read_once(capsys, dataset,
                                                                          monkeypatch):
    """A copy cut short inside a member: verify names the shard's size and where the tar
    ends, and the samples before the cut are still checked (none named). Each shard is read
    once: its sha256 comes from the walk, so no shard file is hashed a second time."""
    import mimo_data.shards.verify as verify_module
    hashed = []
    real = verify_module.file_sha256
    monkeypatch.setattr(verify_module, "file_sha256",
                        lambda path: hashed.append(path) or real(path))
    row, member = _member(dataset, ".jpg")
    with open(dataset / row["shard"], "r+b") as shard:
        shard.truncate(member["offset"] + member["size"] // 2)
    err = _verify(capsys, dataset)
    assert f"{row['shard']}: {member['offset'] + member['size'] // 2} bytes, the index says" \
        in err, err
    assert (f"shard {row['shard']}: the tar cannot be read: the tar ends inside a member"
            in err), err
    assert "sample " not in err, err
    assert not [path for path in hashed if path.endswith(".tar")], hashed


def test_a_damaged_header_and_a_folder_member_are_named_as_such(capsys, dataset):
    """A member's header damaged in a shard of full length is said as a damaged header, with
    where the file goes on to, not as a tar cut short; a folder added to a shard is named, and
    a file of no sample."""
    row, _ = _member(dataset, ".jpg")
    shard = dataset / row["shard"]
    # a member in the shard's middle (the first's header is the tar's first: no tar at all)
    header = sorted(m["offset"] for r in samples_table(dataset) if r["shard"] == row["shard"]
                    for m in r["members"])[3] - 512
    flip_byte(shard, header + 150)                  # inside its checksum field
    err = _verify(capsys, dataset)
    size = shard.stat().st_size
    assert (f"shard {row['shard']}: the tar cannot be read: a damaged tar header at byte "
            f"{header} (the file goes on to byte {size})") in err, err
    assert "without its end-of-archive block" not in err, err
    flip_byte(shard, header + 150)                  # back as built
    with tarfile.open(shard, "a") as tar:
        folder = tarfile.TarInfo("zzz")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    err = _verify(capsys, dataset)
    assert f"shard {row['shard']}: member zzz is no file (a folder?)" in err, err
    with tarfile.open(shard, "a") as tar:           # a file of no sample: a name without suffix
        stray = tarfile.TarInfo("README")
        stray.size = 5
        tar.addfile(stray, io.BytesIO(b"notes"))
    err = _verify(capsys, dataset)
    assert f"shard {row['shard']}: member README belongs to no sample (no suffix)" in err, err


def test_verify_decodes_media_even_when_the_checksum_was_updated(capsys, dataset):
    """A member corrupted before the checksums were taken (the index agrees with the bytes):
    only decoding the media finds it."""
    row, member = _member(dataset, ".png")
    shard = dataset / row["shard"]
    data = bytearray(shard.read_bytes())
    start = member["offset"]
    png = bytes(data[start:start + member["size"]])
    idat = png.index(b"IDAT") + 4 + int.from_bytes(png[png.index(b"IDAT") - 4:png.index(b"IDAT")],
                                                   "big") // 2
    data[start + idat] ^= 0xFF
    shard.write_bytes(bytes(data))
    index = read_json(dataset / "index.json")
    for entry in index["shards"]:
        if entry["name"] == row["shard"]:
            entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    (dataset / "index.json").write_text(json.dumps(index))

    err = _verify(capsys, dataset)
    assert (f"shard {row['shard']}: sample {row['key']} member {row['key']}.{member['name']}: "
            "does not decode") in err


@pytest.mark.parametrize("suffix", [".jpg", ".png", "json"])
def test_verify_names_the_sample_and_member_of_a_changed_byte(capsys, dataset, suffix):
    """One byte inside one member (a JPEG still decodes with it): the shard's sha256 fails and
    the member's crc32 names it."""
    row, member = _member(dataset, suffix)
    flip_byte(dataset / row["shard"], member["offset"] + member["size"] * 3 // 4)
    err = _verify(capsys, dataset)
    assert f"{row['shard']}: sha256 differs" in err
    named = (f"shard {row['shard']}: sample {row['key']} member "
             f"{row['key']}.{member['name']}: its bytes changed")
    assert named in err, err
    others = [line for line in err.splitlines()
              if line.startswith("verify: ") and row["key"] not in line and "sha256" not in line]
    assert not others, others


def test_a_samples_table_cut_short_is_named_by_verify_info_and_the_report(capsys, dataset):
    """A partial copy's samples.parquet (its footer gone): each command names the file and
    what to do, exit 1, no pyarrow traceback; the report's sample table derived from it too
    (no table cached)."""
    from mimo_data.inspect.cli import main as inspect_main
    with open(dataset / "samples.parquet", "r+b") as table:
        table.truncate(100)
    shutil.rmtree(dataset / ".mimo-cache", ignore_errors=True)
    assert "samples.parquet: 100 bytes, the index says" in _verify(capsys, dataset)
    code, _, err = cli_main(capsys, "info", dataset)
    said = f"{dataset}/samples.parquet cannot be read (Parquet magic bytes not found"
    assert code == 1 and said in err and f"`mimo-shard verify {dataset}`" in err, err
    assert "Traceback" not in err
    assert inspect_main(["report", str(dataset), "--config",
                         str(REPO / "configs" / "preprocess.yaml"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_a_missing_samples_table_is_listed_by_verify_which_the_others_point_to(capsys,
                                                                               dataset):
    """A copy without samples.parquet: info says so and points to verify, and verify lists
    it among the dataset's problems (exit 1) rather than say the same again."""
    (dataset / "samples.parquet").unlink()
    code, _, err = cli_main(capsys, "info", dataset)
    assert code == 1 and "samples.parquet missing (the dataset is incomplete)" in err and \
        f"`mimo-shard verify {dataset}` checks the rest" in err, err
    assert f"samples.parquet: missing, not at {dataset}/samples.parquet: restore it, or " \
        "rebuild the dataset" in _verify(capsys, dataset)


def test_verify_of_a_directory_without_index_fails(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, _, err = cli_main(capsys, "verify", tmp_path / "empty", "--no-progress")
    assert code == 1
    assert "index.json" in err


def test_an_edited_index_is_named_by_verify_info_and_the_report(capsys, dataset):
    """An index.json of the right format whose values are not what the readers take (shards
    not a list, a size as text, a file's hash gone), or that no longer lists a shard whose
    samples the table holds: each command names the index and the key, exit 1, no traceback;
    verify names the unlisted shard, whose size and hash it would not check. An index of a
    version this mimo does not read is refused by each, saying which versions it reads."""
    from mimo_data.inspect.cli import main as inspect_main
    original = read_json(dataset / "index.json")

    def edited(change) -> None:
        index = json.loads(json.dumps(original))
        change(index)
        (dataset / "index.json").write_text(json.dumps(index))

    for change, said in (
            (lambda index: index.update(shards=None),
             "shards is None (NoneType), expected a list of shards"),
            (lambda index: index["shards"][0].update(bytes=str(index["shards"][0]["bytes"])),
             f"shards[0].bytes is '{original['shards'][0]['bytes']}' (str), expected a whole "
             "number >= 0"),
            (lambda index: index["shards"][0].update(samples=-1),
             "shards[0].samples is -1 (int), expected a whole number >= 0"),
            (lambda index: index["files"]["samples.parquet"].pop("sha256"),
             "files['samples.parquet'].sha256 is missing (text)")):
        edited(change)
        said = f"{dataset}/index.json: {said} (an edited or damaged index): restore it, or " \
            "rebuild the dataset"
        for command in ("verify", "info"):
            code, _, err = cli_main(capsys, command, dataset, "--no-progress") \
                if command == "verify" else cli_main(capsys, command, dataset)
            assert code == 1 and said in err and "Traceback" not in err, err
        assert inspect_main(["report", str(dataset), "--config",
                             str(REPO / "configs" / "preprocess.yaml"), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err
    last = original["shards"][-1]["name"]
    edited(lambda index: index["shards"].pop())
    assert f"samples.parquet has samples in 1 shard(s) that index.json does not list ({last})" \
        in _verify(capsys, dataset)
    # an index of a version this mimo does not read (a newer mimo's): refused by each command
    edited(lambda index: index.update(version=99))
    said = f"{dataset}/index.json: format 'mimo-shards' version 99; this mimo reads " \
        "'mimo-shards' versions 1, 2 (a newer mimo wrote it?)"
    assert said in _verify(capsys, dataset)
    code, _, err = cli_main(capsys, "info", dataset)
    assert code == 1 and said in err and "Traceback" not in err, err
    assert inspect_main(["report", str(dataset), "--config",
                         str(REPO / "configs" / "preprocess.yaml"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_a_samples_table_of_another_length_than_the_index_is_refused(dataset):
    """A samples.parquet holding another number of rows than index.json's totals (another
    build's table put in its place, its size and hash recorded): a reader refuses the dataset,
    naming both counts and what to do, rather than read samples the index does not count."""
    import pyarrow.parquet as pq

    from mimo_data.shards.index import DatasetError
    from mimo_data.shards.reader import ShardReader
    table = pq.read_table(dataset / "samples.parquet")
    total = read_json(dataset / "index.json")["totals"]["samples"]
    assert table.num_rows == total
    rewrite_samples_parquet(dataset, table.slice(0, total - 1))
    with pytest.raises(DatasetError) as caught:
        ShardReader(str(dataset))
    assert str(caught.value) == (f"{dataset}: samples.parquet has {total - 1} rows, the index "
                                 f"says {total} samples; rebuild the dataset")


def test_a_shard_written_again_with_its_members_elsewhere_names_where_they_sit(capsys,
                                                                               dataset):
    """A shard written again by another tar writer (a pax header before each member): every
    member's bytes are as built, but not at the offsets readers read them by; verify names
    each member where it sits now against the table, not a change in headers or padding."""
    row, _ = _member(dataset, ".jpg")
    shard = dataset / row["shard"]
    with tarfile.open(shard) as tar:
        members = [(info, tar.extractfile(info).read()) for info in tar]
    with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.pax_headers = {"comment": "written again"}
            tar.addfile(info, io.BytesIO(data))
    first = next(r for r in samples_table(dataset) if r["shard"] == row["shard"])
    member = first["members"][0]
    with tarfile.open(shard) as tar:
        moved = tar.getmember(f"{first['key']}.{member['name']}").offset_data
    assert moved != member["offset"]
    err = _verify(capsys, dataset)
    assert (f"shard {row['shard']}: sample {first['key']} member {first['key']}."
            f"{member['name']}: at offset {moved} size {member['size']}, the table says "
            f"{member}") in err, err
    assert "every member sits" not in err, err


def test_media_metadata_the_json_misstates_is_named(capsys, dataset):
    """A sample's JSON whose image width is one more than the image's (its length unchanged):
    verify names the member, what it decodes to and what the JSON says."""
    rows = samples_table(dataset)
    for row in rows:
        names = [m["name"] for m in row["members"]]
        if "img0.jpg" in names and row["shard"] != rows[0]["shard"]:
            member = row["members"][names.index("json")]
            shard = dataset / row["shard"]
            data = shard.read_bytes()
            text = data[member["offset"]:member["offset"] + member["size"]]
            width = json.loads(text)["media"][0]["width"]
            if len(str(width + 1)) == len(str(width)):
                break
    else:
        raise AssertionError("no image whose width + 1 has as many digits")
    edited = text.replace(f'"width": {width},'.encode(), f'"width": {width + 1},'.encode(), 1)
    assert edited != text and len(edited) == len(text)
    shard.write_bytes(data[:member["offset"]] + edited + data[member["offset"] + len(text):])
    err = _verify(capsys, dataset)
    assert (f"shard {row['shard']}: sample {row['key']} member {row['key']}.img0.jpg: width is "
            f"{width}, the JSON says {width + 1}") in err, err


def test_a_byte_changed_in_the_end_padding_is_said_to_be_in_padding(capsys, dataset):
    """The shard's last byte (the record padding after its end-of-archive blocks) changed:
    its length is as built, so verify says every member is intact and the change is in
    headers or padding, not that the shard grew."""
    row, _ = _member(dataset, ".jpg")
    shard = dataset / row["shard"]
    size = shard.stat().st_size
    assert shard.read_bytes()[-1] == 0
    flip_byte(shard, size - 1)
    err = _verify(capsys, dataset)
    assert f"{row['shard']}: sha256 differs from the index (the file changed after the build)" \
        in err, err
    assert (f"shard {row['shard']}: every member sits where samples.parquet says, matches its "
            "crc32 (where recorded) and decodes: the changed bytes are in tar headers or "
            "padding, or in media without a recorded crc32") in err, err
    assert "bytes longer" not in err, err


def test_a_member_appended_to_the_last_sample_is_named_as_a_repeated_suffix(capsys, dataset):
    """``tar rf`` of a member with the shard's last sample's key and a suffix it has: read as
    part of that sample (webdataset would take one of the two), so verify names the member as
    repeating a suffix of its sample, not just the shard as grown."""
    row, _ = _member(dataset, ".jpg")
    shard = dataset / row["shard"]
    last = [r for r in samples_table(dataset) if r["shard"] == row["shard"]][-1]
    write_tar(shard, {f"{last['key']}.json": b"{}"}, append=True)
    err = _verify(capsys, dataset)
    assert f"shard {row['shard']}: member {last['key']}.json repeats a suffix of its sample" \
        in err, err
    assert "bytes longer" not in err, err
