"""Building the whole sample corpus: every record lands in standard WebDataset shards, with the
original media bytes, normalized messages, decoder-exact metadata and a random-access table."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest
import soundfile
import webdataset
from PIL import Image, ImageOps

from conftest import (all_samples, cli_main, image_size_after_exif, marker_modalities, origin_of,
                      read_json, sample_records, samples_table, shard_paths)

PIL_EXTENSION = {"JPEG": "jpg", "PNG": "png"}
SOUNDFILE_EXTENSION = {"WAV": "wav", "FLAC": "flac"}


def test_corpus_inputs_hold_every_kind_of_record(corpus_expected):
    # Guards the other tests against a corpus that silently lost what they rely on.
    kinds = Counter()
    for record in corpus_expected:
        modalities = set(marker_modalities(record.messages))
        kinds["image"] += "image" in modalities
        kinds["audio"] += "audio" in modalities
        kinds["both"] += modalities == {"image", "audio"}
        kinds["text"] += not modalities
        kinds["multi_image"] += len(record.images) > 1
        kinds["system"] += any(m["role"] == "system" for m in record.messages)
    assert all(kinds[k] for k in ("image", "audio", "both", "text", "multi_image", "system")), kinds
    assert {r.kind for r in corpus_expected} == {"line", "index", "row"}


def test_every_corpus_record_is_written(corpus_build, corpus_expected):
    report = read_json(corpus_build / "report.json")
    index = read_json(corpus_build / "index.json")
    assert report["records_read"] == len(corpus_expected)
    assert report["records_read"] == report["samples_written"] + report["records_skipped"]
    assert report["records_skipped"] == 0 and report["skipped_by_reason"] == {}
    assert report["samples_written"] == len(corpus_expected)
    assert index["totals"]["samples"] == len(corpus_expected)
    assert index["report"] == {"records_read": len(corpus_expected), "records_skipped": 0}

    written = sample_records(corpus_build)
    origins = [origin_of(sample) for sample in written]
    assert len(origins) == len(set(origins)), "a record was written twice"
    assert set(origins) == {record.origin for record in corpus_expected}
    expected_ids = Counter(r.id for r in corpus_expected)
    assert Counter(sample["id"] for sample in written) == expected_ids


def test_webdataset_iterates_the_shards_like_the_samples_table(corpus_build):
    urls = [str(path) for path in shard_paths(corpus_build)]
    samples = list(webdataset.WebDataset(urls, shardshuffle=False))
    rows = samples_table(corpus_build)

    assert [s["__key__"] for s in samples] == [row["key"] for row in rows]
    assert len({row["key"] for row in rows}) == len(rows)
    for sample, row in zip(samples, rows):
        assert "." not in sample["__key__"]
        assert sample["__url__"].endswith("/" + row["shard"])
        members = {name for name in sample if not name.startswith("__")}
        assert members == {m["name"] for m in row["members"]}
        assert json.loads(sample["json"])["key"] == sample["__key__"]


def test_samples_hold_original_media_and_normalized_messages(corpus_build, corpus_expected):
    by_origin = {record.origin: record for record in corpus_expected}
    urls = [str(path) for path in shard_paths(corpus_build)]
    checked = Counter()
    for sample in webdataset.WebDataset(urls, shardshuffle=False):
        record = json.loads(sample["json"])
        expected = by_origin[origin_of(record)]
        assert record["id"] == expected.id
        assert record["messages"] == expected.messages
        assert [m["modality"] for m in record["media"]] == marker_modalities(expected.messages)

        media_members = sorted(name for name in sample if not name.startswith("__")
                               and name != "json")
        assert len(media_members) == len(expected.images) + len(expected.audios)
        seen = Counter()
        for item in record["media"]:
            index = seen[item["modality"]]
            seen[item["modality"]] += 1
            data = sample[item["member"]]
            assert item["bytes"] == len(data)
            if item["modality"] == "image":
                assert data == expected.images[index], "image bytes were re-encoded"
                with Image.open(io.BytesIO(data)) as image:
                    extension = PIL_EXTENSION[image.format]
                width, height, mode = image_size_after_exif(data)
                assert (item["width"], item["height"], item["mode"]) == (width, height, mode)
                assert item["member"] == f"img{index}.{extension}"
            else:
                assert data == expected.audios[index], "audio bytes were re-encoded"
                info = soundfile.info(io.BytesIO(data))
                decoded, rate = soundfile.read(io.BytesIO(data))
                assert item["frames"] == info.frames == len(decoded)
                assert (item["sample_rate"], item["channels"]) == (rate, info.channels)
                assert item["duration"] == pytest.approx(info.frames / rate, abs=1e-5)
                assert item["member"] == f"aud{index}.{SOUNDFILE_EXTENSION[info.format]}"
            checked[item["modality"]] += 1
    assert checked["image"] == sum(len(r.images) for r in corpus_expected)
    assert checked["audio"] == sum(len(r.audios) for r in corpus_expected)


def test_exif_rotated_jpeg_reports_the_displayed_size(corpus, corpus_build):
    rotated = {}
    for path in sorted((corpus / "images").iterdir()):
        with Image.open(path) as image:
            if image.getexif().get(0x0112) == 6:
                rotated[path.read_bytes()] = image.size
    assert rotated, "the corpus should hold a JPEG with EXIF orientation 6"
    found = 0
    for _, _, members in all_samples(corpus_build):
        record = json.loads(members["json"])
        for item in record["media"]:
            stored = rotated.get(members[item["member"]])
            if stored is not None:
                stored_width, stored_height = stored
                assert stored_width != stored_height
                assert (item["width"], item["height"]) == (stored_height, stored_width)
                assert item["orientation"] == 6
                found += 1
    assert found, "no sample holds the EXIF-rotated JPEG"


def test_webdataset_pil_decoding_matches_the_json_metadata(corpus_build):
    urls = [str(path) for path in shard_paths(corpus_build)]
    decoded_images = 0
    for sample in webdataset.WebDataset(urls, shardshuffle=False).decode("pil"):
        record = sample["json"]                       # decoded to a dict by webdataset
        assert record["key"] == sample["__key__"]
        for item in record["media"]:
            if item["modality"] != "image":
                continue
            image = sample[item["member"]]
            assert isinstance(image, Image.Image)
            shown = ImageOps.exif_transpose(image)
            assert shown.size == (item["width"], item["height"])
            decoded_images += 1
    assert decoded_images > 0


def test_samples_table_offsets_give_random_access(corpus_build):
    members_by_key = {(shard, key): members for shard, key, members in all_samples(corpus_build)}
    rows = samples_table(corpus_build)
    assert len(rows) == len(members_by_key)
    for row in rows:
        members = members_by_key[(row["shard"], row["key"])]
        assert [m["name"] for m in row["members"]] == list(members)    # tar order
        with open(corpus_build / row["shard"], "rb") as shard:
            for member in row["members"]:
                shard.seek(member["offset"])
                assert shard.read(member["size"]) == members[member["name"]], (
                    f"{row['shard']} {row['key']}.{member['name']}")


def test_samples_table_metadata_matches_the_sample_json(corpus_build):
    records = {r["key"]: r for r in sample_records(corpus_build)}
    for row in samples_table(corpus_build):
        record = records[row["key"]]
        images = [m for m in record["media"] if m["modality"] == "image"]
        audios = [m for m in record["media"] if m["modality"] == "audio"]
        assert row["id"] == record["id"]
        assert row["num_turns"] == len(record["messages"])
        assert row["text_chars"] == sum(len(m["content"]) for m in record["messages"])
        assert row["image_width"] == [m["width"] for m in images]
        assert row["image_height"] == [m["height"] for m in images]
        assert row["audio_duration"] == [m["duration"] for m in audios]


def test_index_lists_the_shard_files(corpus_build):
    import hashlib

    index = read_json(corpus_build / "index.json")
    assert [s["name"] for s in index["shards"]] == [p.name for p in shard_paths(corpus_build)]
    for shard in index["shards"]:
        data = (corpus_build / shard["name"]).read_bytes()
        assert shard["bytes"] == len(data)
        assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        keys = {name.partition(".")[0] for name in _tar_names(corpus_build / shard["name"])}
        assert shard["samples"] == len(keys)


def _tar_names(path):
    import tarfile

    with tarfile.open(path) as tar:
        return tar.getnames()


def test_info_json_counts_match_the_inputs(capsys, corpus_build, corpus_expected):
    code, out, err = cli_main(capsys, "info", corpus_build, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["samples"] == len(corpus_expected)
    assert info["modalities"]["image"]["items"] == sum(len(r.images) for r in corpus_expected)
    assert info["modalities"]["image"]["samples"] == sum(1 for r in corpus_expected if r.images)
    assert info["modalities"]["audio"]["items"] == sum(len(r.audios) for r in corpus_expected)
    assert info["modalities"]["audio"]["samples"] == sum(1 for r in corpus_expected if r.audios)
    assert info["modalities"]["text_only"]["samples"] == sum(
        1 for r in corpus_expected if not r.images and not r.audios)
    assert info["shards"] == len(shard_paths(corpus_build))
    assert sum(info["image"]["longest_side_histogram"].values()) == sum(
        len(r.images) for r in corpus_expected)
    total_seconds = sum(soundfile.info(io.BytesIO(a)).duration
                        for r in corpus_expected for a in r.audios)
    assert info["audio"]["total_hours"] * 3600 == pytest.approx(total_seconds, abs=1e-3)


def test_info_text_names_the_counts(capsys, corpus_build, corpus_expected):
    code, out, _ = cli_main(capsys, "info", corpus_build)
    assert code == 0
    first = out.splitlines()
    # the name a build gives is its shards' prefix (--name), said so
    assert first[0] == f"name      data (--name: its shards' prefix)  ({corpus_build})"
    assert any(line.startswith("samples") and f" {len(corpus_expected)} " in f"{line} "
               for line in first)
    # its size in the units --max-shard-bytes reads (powers of 1024, named so: the corpus's
    # shards hold some MiB)
    import json
    size = json.loads((corpus_build / "index.json").read_text())["totals"]["bytes"]
    assert 2**20 <= size < 2**30
    assert any(line.startswith("samples") and line.endswith(f"shard(s), {size / 2**20:.1f} MiB")
               for line in first), first
    # summaries to two decimals (a percentile between two clips' durations had six digits)
    import re
    summaries = [line for line in first if " p90 " in line]
    assert summaries and not any(re.search(r"\d\.\d{3}", line) for line in summaries), first
    # a modality's total duration in minutes, under one minute in seconds (not "0.0 min")
    total = sum(soundfile.info(io.BytesIO(a)).duration for r in corpus_expected for a in r.audios)
    [audio] = [line for line in first if line.startswith("audio ")]
    assert audio.endswith(f", {total / 60:.1f} min" if total >= 60 else f", {total:.1f} s"), \
        (audio, total)
