"""Videos through `mimo-shard build`, `verify` and `info`, and `mimo-inspect sample` and `report`.

The inputs are the corpus's ``video.jsonl`` (clip paths, two clips in a record, clips beside a
photo, and clips the build must refuse) and Parquet tables written here: ``{bytes, path}``
structs in a ``videos`` column, and path strings in a ``video`` column (or one named with
``--video-column``).
Every expectation comes from the inputs and ``videos/catalog.json`` (what the clip tool
wrote), read with json / pyarrow / tarfile: the stored bytes against the source files, the
item metadata against the catalog, the skips per reason against the clips known to be bad.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import (VideoClip, all_samples, cli_main, flip_byte, preprocess_config_file,
                      read_json, rewrite_samples_parquet, run_cli, samples_table,
                      scratch, write_jsonl)

MEDIA = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
# The video item fields the probe must report as the catalog has them.
CATALOG_FIELDS = ("format", "codec", "fps", "frames", "width", "height", "rotation")
VIDEO_CONFIG = {"token": "<|video_pad|>", "fps": 2.0, "min_frames": 4, "max_frames": 768,
                "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 50176}


def _turns(user: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def _struct(clip: VideoClip) -> dict:
    return {"bytes": clip.data, "path": Path(clip.path).name}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, corpus, corpus_videos) -> dict:
    """The input files and, per input record, its id and video paths (or bytes)."""
    with scratch(tmp_path_factory, "video-inputs") as folder:
        clips = corpus_videos
        embedded = [  # (id, clips, user turn)
            ("pq-rotated", [clips["rotated_h264_24"]], "<video>\nWho is in this clip?"),
            ("pq-two", [clips["pan_vp9_30"], clips["zoom_h264_10"]],
             "<video>\n<video>\nWhat do these clips show?"),
            ("pq-truncated", [clips["truncated_h264_24"]], "<video>\nDescribe it."),
            ("pq-one-for-two", [clips["zoom_mpeg4_10"]], "<video> and <video>: compare them."),
        ]
        structs = folder / "embedded.parquet"
        pq.write_table(pa.table({
            "id": [rid for rid, _, _ in embedded],
            "videos": pa.array([[_struct(c) for c in chosen] for _, chosen, _ in embedded],
                               pa.list_(MEDIA)),
            "messages": [json.dumps(_turns(user, "A short clip.")) for _, _, user in embedded],
        }), structs)
        named = [("pq-path-audio", clips["audio_h264_30"]),
                 ("pq-path-mpeg4", clips["zoom_mpeg4_10"])]
        paths = folder / "paths.parquet"
        pq.write_table(pa.table({
            "id": [rid for rid, _ in named],
            "video": [str(corpus / clip.path) for _, clip in named],
            "messages": [json.dumps(_turns("<video>\nWhat is shown?", "A clip."))
                         for _ in named],
        }), paths)
        jsonl = corpus / "video.jsonl"
        records = {}
        for line in jsonl.read_text().splitlines():
            record = json.loads(line)
            listed = record.get("videos", [record["video"]] if "video" in record else [])
            records[record["id"]] = [corpus / p for p in listed]
        records.update({rid: [c.data for c in chosen] for rid, chosen, _ in embedded})
        records.update({rid: [corpus / clip.path] for rid, clip in named})
        # LLaVA-Video-178K's shape: a "video" path, its marker LLaVA-NeXT's <image>
        llava_video = folder / "llava_video.jsonl"
        marked = [("llava-video", "<image>\nDescribe what happens in this video."),
                  ("llava-video-two-markers", "<image>\nCompare it with <image>.")]
        llava_video.write_text("".join(json.dumps({
            "id": rid, "data_source": "0_30_s_academic_v0_1",
            "video": str(corpus / clips["pan_h264_24"].path),
            "conversations": [{"from": "human", "value": user},
                              {"from": "gpt", "value": "A slow pan."}]}) + "\n"
            for rid, user in marked))
        records.update({rid: [corpus / clips["pan_h264_24"].path] for rid, _ in marked})
        yield {"files": [jsonl, structs, paths, llava_video], "records": records,
               "markers": {"pq-one-for-two": 2, "llava-video-two-markers": 2},
               "marked_with_image": {"llava-video"}}


@pytest.fixture(scope="module")
def built(tmp_path_factory, inputs) -> Path:
    """The three inputs built once, by the CLI."""
    out = tmp_path_factory.mktemp("video-build") / "dataset"
    run_cli("build", *inputs["files"], "--output", out, "--no-progress", check_rc=0)
    return out


def _catalog_by_path(corpus: Path, clips: dict[str, VideoClip]) -> dict:
    return {corpus / clip.path: clip for clip in clips.values()}


def _expected_reason(refs: list, markers: int | None, by_path: dict, by_bytes: dict
                     ) -> str | None:
    """Why the build must skip a record, from the catalog (None: kept). A path the catalog
    does not list is the corpus's WAV file, given as a video."""
    if markers is not None and markers != len(refs):
        return "marker_mismatch"
    for ref in refs:
        clip = by_bytes.get(ref) if isinstance(ref, bytes) else by_path.get(ref)
        if clip is None:
            return "no_video_stream"
        if clip.truncated:
            return "corrupt_video"
        if clip.codec == "ffv1":
            return "unsupported_codec"
    return None


@pytest.fixture(scope="module")
def expected(inputs, corpus, corpus_videos) -> dict:
    by_path = _catalog_by_path(corpus, corpus_videos)
    by_bytes = {clip.data: clip for clip in corpus_videos.values()}
    reasons = {rid: _expected_reason(refs, inputs["markers"].get(rid), by_path, by_bytes)
               for rid, refs in inputs["records"].items()}
    return {"reasons": reasons, "by_path": by_path, "by_bytes": by_bytes}


def test_bad_videos_are_counted_by_reason(built, inputs, expected):
    report = read_json(built / "report.json")
    wanted = Counter(r for r in expected["reasons"].values() if r)
    assert {reason: entry["count"] for reason, entry in report["skipped_by_reason"].items()} \
        == dict(wanted)
    assert wanted["corrupt_video"] == 2 and wanted["no_video_stream"] == 1 \
        and wanted["unsupported_codec"] == 1 and wanted["marker_mismatch"] == 2
    assert report["records_read"] == len(expected["reasons"])
    assert report["samples_written"] == sum(r is None for r in expected["reasons"].values())
    # the videos read under LLaVA-NeXT's <image> marker are counted, so a user sees it; so
    # are the kept clips with rotation metadata (the catalog's), which transformers' own
    # PyAV loading would not turn upright
    clips = [expected["by_bytes"][r] if isinstance(r, bytes) else expected["by_path"][r]
             for rid, reason in expected["reasons"].items() if reason is None
             for r in inputs["records"][rid]]
    rotated = sum(1 for clip in clips if clip.rotation)
    assert rotated and report["counts"] == {"videos_marked_with_image": 1,
                                            "videos_rotated": rotated}


def test_videos_are_stored_as_read_with_the_catalogs_metadata(built, inputs, expected, corpus):
    kept = {rid for rid, reason in expected["reasons"].items() if reason is None}
    seen = set()
    for _, _, members in all_samples(built):
        record = json.loads(members["json"])
        seen.add(record["id"])
        refs = inputs["records"][record["id"]]
        videos = [item for item in record["media"] if item["modality"] == "video"]
        assert len(videos) == len(refs)
        for number, (item, ref) in enumerate(zip(videos, refs)):
            source = ref if isinstance(ref, bytes) else ref.read_bytes()
            clip = (expected["by_bytes"][ref] if isinstance(ref, bytes)
                    else expected["by_path"][ref])
            extension = Path(clip.path).suffix
            assert item["member"] == f"vid{number}{extension}"
            assert members[item["member"]] == source          # the original bytes
            assert item["bytes"] == len(source)
            assert {f: item[f] for f in CATALOG_FIELDS} == {f: getattr(clip, f)
                                                            for f in CATALOG_FIELDS}
            assert item["duration"] == pytest.approx(clip.frames / clip.fps, abs=1.5 / clip.fps)
        text = "".join(message["content"] for message in record["messages"])
        assert text.count("<video>") == len(videos), record["id"]   # LLaVA-NeXT's <image> too
        if record["id"] in inputs["marked_with_image"]:
            assert "<image>" not in text
        others = {name for name in members if name != "json"} - {v["member"] for v in videos}
        assert others == {item["member"] for item in record["media"]
                          if item["modality"] != "video"}
    assert seen == kept


def test_samples_table_and_info_count_the_videos(capsys, built, inputs, expected):
    kept = [rid for rid, reason in expected["reasons"].items() if reason is None]
    clips = [expected["by_bytes"][r] if isinstance(r, bytes) else expected["by_path"][r]
             for rid in kept for r in inputs["records"][rid]]
    rows = samples_table(built)
    assert sorted(w for row in rows for w in row["video_width"]) == sorted(c.width for c in clips)
    assert sorted(h for row in rows for h in row["video_height"]) == \
        sorted(c.height for c in clips)
    code, out, err = cli_main(capsys, "info", built, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["modalities"]["video"] == {"items": len(clips),
                                           "samples": sum(1 for rid in kept
                                                          if inputs["records"][rid])}
    assert info["video"]["total_hours"] * 3600 == pytest.approx(
        sum(c.frames / c.fps for c in clips), abs=0.1)
    assert sum(info["video"]["longest_side_histogram"].values()) == len(clips)
    code, out, _ = cli_main(capsys, "info", built)
    assert f"video     {len(clips)} items" in out
    # a modality the dataset holds none of gets no empty section
    held = {name for name, counts in info["modalities"].items() if counts["samples"]}
    shown = {line.split()[0].replace("text-only", "text_only") for line in out.splitlines()
             if line.split() and line.split()[0].replace("-", "_") in info["modalities"]}
    assert shown == held and held != set(info["modalities"]), (held, out)


def test_verify_passes_and_names_a_damaged_video_member(capsys, tmp_path, built):
    code, out, err = cli_main(capsys, "verify", built, "--no-progress")
    assert code == 0 and "OK" in out, err
    damaged = shutil.copytree(built, tmp_path / "damaged")
    row = next(r for r in samples_table(damaged) if r["video_width"])
    member = next(m for m in row["members"] if m["name"].startswith("vid0."))
    flip_byte(damaged / row["shard"], member["offset"] + member["size"] // 2)
    code, _, err = cli_main(capsys, "verify", damaged, "--no-progress")
    assert code == 1
    assert f"{row['key']}.{member['name']}" in err and "FAILED" in err


def test_video_column_option_names_the_column(capsys, tmp_path, corpus, corpus_videos):
    clip = corpus_videos["zoom_h264_10"]
    table = tmp_path / "clips.parquet"
    pq.write_table(pa.table({"clip": [str(corpus / clip.path)],
                             "messages": [json.dumps(_turns("<video>\nWho?", "Grace Hopper."))]}),
                   table)
    code, _, err = cli_main(capsys, "build", table, "--output", tmp_path / "out",
                            "--video-column", "clip", "--no-progress")
    assert code == 0, err
    (_, _, members), = all_samples(tmp_path / "out")
    assert members["vid0.mp4"] == clip.data


def documented_times(frames: int, fps: int, cfg: dict) -> list[str]:
    """Seconds of the frames Qwen2VLVideoProcessor samples (its documented rule): fps * duration
    frames, clamped to [min_frames, max_frames rounded down to temporal patches (and to the
    clip)], rounded down to temporal patches, frame ``i * frames // n`` shown at index / fps."""
    tps = cfg["temporal_patch_size"]
    cap = min(cfg["max_frames"], frames) // tps * tps
    n = int(min(max(frames / fps * cfg["fps"], cfg["min_frames"]), cap, frames) // tps) * tps
    return [f"{i * frames // n / fps:.2f}" for i in range(n)]


def test_inspect_sample_shows_the_sampled_timestamps(capsys, tmp_path, built, corpus,
                                                     corpus_videos):
    from mimo_data.inspect.cli import main as inspect_main

    config = preprocess_config_file(tmp_path / "video.yaml", video=VIDEO_CONFIG,
                                    image={"policy": "dynamic", "min_pixels": 3136,
                                           "max_pixels": 200704})
    records = {row["id"]: row["key"] for row in samples_table(built)}
    record = next(json.loads(line) for line in (corpus / "video.jsonl").read_text().splitlines()
                  if json.loads(line)["id"] == "video-photo-and-clips")
    clips = [next(c for c in corpus_videos.values() if c.path == p) for p in record["videos"]]
    capsys.readouterr()
    code = inspect_main(["sample", str(built), "--config", str(config), "--cache-dir",
                         str(tmp_path / "cache"), "--key", records["video-photo-and-clips"],
                         "--color", "never"])
    out = capsys.readouterr().out
    assert code == 0, out
    shown = [line.split("frames at ")[1] for line in out.splitlines() if "frames at " in line]
    assert shown == [f"{' '.join(times)} s ({len(times)} sampled)" for times in
                     (documented_times(c.frames, c.fps, VIDEO_CONFIG) for c in clips)]


def documented_tokens(clip: VideoClip, cfg: dict) -> int:
    """Qwen2-VL's video tokens: sampled frames / temporal patch × the frame's 14 px patches
    after transformers' ``smart_resize`` (sides multiples of 28) / merge² (4)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    height, width = smart_resize(clip.height, clip.width, factor=28,
                                 min_pixels=cfg["min_pixels"], max_pixels=cfg["max_pixels"])
    frames = len(documented_times(clip.frames, clip.fps, cfg))
    return frames // cfg["temporal_patch_size"] * (height // 14) * (width // 14) // 4


def test_inspect_report_counts_video_tokens_drops_and_shows_frame_strips(
        tmp_path, built, inputs, expected):
    import base64
    import io
    import re

    from PIL import Image

    from mimo_data.inspect.cli import main as inspect_main

    config = preprocess_config_file(tmp_path / "video.yaml", video=VIDEO_CONFIG,
                                    image={"policy": "dynamic", "min_pixels": 3136,
                                           "max_pixels": 200704})
    inspect_main(["report", str(built), "--config", str(config), "--cache-dir",
                  str(tmp_path / "cache"), "--json", str(tmp_path / "report.json"),
                  "--html", str(tmp_path / "report.html"), "--no-progress"])
    report = read_json(tmp_path / "report.json")
    kept = [rid for rid, reason in expected["reasons"].items() if reason is None]
    clips = {rid: [expected["by_bytes"][r] if isinstance(r, bytes) else expected["by_path"][r]
                   for r in inputs["records"][rid]] for rid in kept}
    short = {rid for rid, chosen in clips.items()
             if any(c.frames < VIDEO_CONFIG["temporal_patch_size"] for c in chosen)}
    assert {r: d["count"] for r, d in report["drop_reasons"].items()} == {
        "video_too_short": len(short)}
    trained = [c for rid, chosen in clips.items() if rid not in short for c in chosen]
    video = report["modalities"]["video"]
    assert video["items"] == len(trained)
    assert video["tokens"] == sum(documented_tokens(c, VIDEO_CONFIG) for c in trained)

    page = (tmp_path / "report.html").read_text()
    strips = {alt: Image.open(io.BytesIO(base64.b64decode(data))).size for data, alt in
              re.findall(r'<img src="data:image/png;base64,([^"]+)" alt="(vid\d\.\w+: [^"]*)"',
                         page)}
    assert strips, "no video preview in the HTML report"
    for alt, (width, height) in strips.items():
        shown = tuple(map(int, re.search(r": (\d+)x(\d+) ", alt).groups()))
        frames = (width + 4) / (shown[0] + 4)             # frames side by side, 4 px apart
        assert height == shown[1] and frames == int(frames) and frames >= 1, alt
    assert any((w + 4) // (int(re.search(r": (\d+)x", a).group(1)) + 4) > 1
               for a, (w, _) in strips.items()), "no strip of several frames"


def test_inspect_index_check_compares_the_video_columns(tmp_path, built):
    from mimo_data.inspect.stats import IndexTable

    records = [json.loads(members["json"]) for _, _, members in all_samples(built)]
    index = IndexTable(str(built))
    assert [index.problems(p, r) for p, r in enumerate(records)] == [[]] * len(records)
    patched = shutil.copytree(built, tmp_path / "patched")
    table = pq.read_table(patched / "samples.parquet")
    rows = table.to_pylist()
    position = next(p for p, row in enumerate(rows) if row["video_width"])
    rows[position]["video_width"][0] += 2
    rewrite_samples_parquet(patched, pa.Table.from_pylist(rows, schema=table.schema))
    problems = [IndexTable(str(patched)).problems(p, r) for p, r in enumerate(records)]
    assert [p for p, found in enumerate(problems) if found] == [position]
    assert problems[position][0].startswith("video width/height/duration")


def test_the_cli_has_a_column_option_per_registered_modality():
    from mimo_data.modalities import MODALITIES
    from mimo_data.shards.cli import MEDIA_COLUMNS

    assert sorted(MEDIA_COLUMNS) == sorted(MODALITIES)


MARKED = "videos_marked_with_image"      # the reports' count of them


@pytest.mark.parametrize("texts, counts, expected", [
    # LLaVA-NeXT's video data: each video marked <image>, no image in the record
    (["<image>\nWhat happens?", "A pan."], {"video": 1}, (["video"], {MARKED: 1})),
    (["<image>\n<image>\nCompare.", "Same."], {"video": 2}, (["video", "video"], {MARKED: 2})),
    # <image> can be a video's only where nothing else could be meant
    (["<image>\nAnd this?", "A pan."], {"video": 1, "image": 1}, "0 <video> marker"),
    (["<image>\n<video>\nBoth?", "Yes."], {"video": 2}, "1 <image> marker"),
    (["<image> and <image>?", "One."], {"video": 1}, "2 <image> marker"),
    (["<video>\nWhat happens?", "A pan."], {"video": 1}, (["video"], {})),
])
def test_llava_next_marks_a_video_with_image(texts, counts, expected):
    from mimo_data.shards.records import RecordError, media_markers

    messages = [{"role": role, "content": text} for role, text in zip(("user", "assistant"),
                                                                       texts)]
    if isinstance(expected, str):
        with pytest.raises(RecordError, match=expected) as caught:
            media_markers(messages, counts)
        assert caught.value.reason == "marker_mismatch"
        assert [m["content"] for m in messages] == texts     # left as given
        return
    assert media_markers(messages, counts) == expected
    assert messages[0]["content"] == texts[0].replace("<image>", "<video>")


@pytest.fixture(scope="module")
def frames_folder(tmp_path_factory, corpus, corpus_videos) -> tuple[Path, list[bytes]]:
    """A corpus clip's frames as LLaVA-Hound gives a video: a folder of numbered JPEGs."""
    import io

    import av

    folder = tmp_path_factory.mktemp("frames") / "v_zoom"
    folder.mkdir()
    frames = []
    with av.open(str(corpus / corpus_videos["zoom_h264_10"].path)) as clip:
        for number, frame in enumerate(clip.decode(video=0)):
            jpeg = io.BytesIO()
            frame.to_image().save(jpeg, format="JPEG", quality=90)
            frames.append(jpeg.getvalue())
            (folder / f"{number + 1:05d}.jpg").write_bytes(jpeg.getvalue())
    return folder, frames


def test_a_folder_of_frames_is_one_clip_of_its_jpegs(capsys, tmp_path, frames_folder):
    """``--frames-fps 2`` (LLaVA-Hound's rate): a video given as its frames folder is stored as
    one clip holding each frame's JPEG bytes as they are, in name order, one every half
    second, counted; ``mimo-inspect sample`` shows the times Qwen2-VL's processor samples from
    a clip of that rate and length. A folder given as ``{path}`` (a table's video column) is
    one too; the same frames make the same bytes. Without the flag the folder is
    missing_media naming it; a rate out of range is refused."""
    import io

    import av

    from mimo_data.inspect.cli import main as inspect_main

    folder, frames = frames_folder
    from mimo_data.modalities.video.frames import frames_clip

    turns = [{"from": "human", "value": "<video>\nWhat happens?"},
             {"from": "gpt", "value": "A zoom."}]
    files = sorted(str(frame) for frame in folder.iterdir())
    path = write_jsonl(tmp_path / "hound.jsonl", [
        {"id": "hound", "video": str(folder), "conversations": turns},
        {"id": "struct", "video": {"bytes": None, "path": str(folder)},
         "conversations": turns},
        # the list of its frame files (LLaMA-Factory's videos, qwen-vl-utils' video part)
        {"id": "list", "videos": [files], "conversations": turns},
        {"id": "part", "messages": [
            {"role": "user", "content": [{"type": "video", "video": [
                f"file://{frame}" for frame in files]}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A zoom."}]}])
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "plain", "--no-progress")
    assert code == 1 and "--frames-fps" in read_json(tmp_path / "plain" / "report.json")[
        "skipped_by_reason"]["missing_media"]["first"][0]["detail"], err
    for rate in ("0.001", "inf", "nan"):
        code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "rate", "--no-progress",
                                "--frames-fps", rate)
        assert code == 2 and "frames are taken" in err, err
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress",
                            "--frames-fps", "2")
    assert code == 0, err
    assert read_json(tmp_path / "out" / "report.json")["counts"] == {
        "videos_from_frame_folders": 4}
    (_, _, members), *others = all_samples(tmp_path / "out")
    assert all(other["vid0.mkv"] == members["vid0.mkv"] for _, _, other in others)
    assert members["vid0.mkv"] == frames_clip(str(folder), 2.0)
    # each names the frames' folder: a list of its files (as given or file:// URLs) too
    for _, _, each in all_samples(tmp_path / "out"):
        [item] = json.loads(each["json"])["media"]
        assert {k: item[k] for k in ("member", "codec", "frames", "fps", "duration", "path")} \
            == {"member": "vid0.mkv", "codec": "mjpeg", "frames": len(frames), "fps": 2.0,
                "duration": len(frames) / 2, "path": str(folder)}
    with av.open(io.BytesIO(members["vid0.mkv"])) as clip:
        stream = clip.streams.video[0]
        packets = [(bytes(p), float(p.pts * p.time_base)) for p in clip.demux(stream) if p.size]
    assert packets == [(jpeg, n / 2) for n, jpeg in enumerate(frames)]   # the bytes, in time
    config = preprocess_config_file(tmp_path / "video.yaml", video=VIDEO_CONFIG)
    capsys.readouterr()
    key = samples_table(tmp_path / "out")[0]["key"]
    code = inspect_main(["sample", str(tmp_path / "out"), "--config", str(config),
                         "--cache-dir", str(tmp_path / "cache"), "--key", key,
                         "--color", "never"])
    out = capsys.readouterr().out
    assert code == 0, out
    times = documented_times(len(frames), 2, VIDEO_CONFIG)
    assert [line.split("frames at ")[1] for line in out.splitlines() if "frames at " in line] \
        == [f"{' '.join(times)} s ({len(times)} sampled)"]


@pytest.mark.parametrize("make, reason", [
    (lambda folder, jpeg, png: None, "missing_media"),                     # no frame
    (lambda folder, jpeg, png: (folder / "1.png").write_bytes(png), "unsupported_format"),
    (lambda folder, jpeg, png: [(folder / "1.jpg").write_bytes(jpeg[0]),
                                (folder / "2.jpg").write_bytes(jpeg[1])], "corrupt_video"),
])
def test_a_frames_folder_mimo_cannot_make_a_clip_of_is_refused(tmp_path, make, reason):
    """No frame, frames that are not JPEG, frames of two sizes: counted by reason."""
    import io

    from PIL import Image

    from mimo_data.modalities.base import MediaError
    from mimo_data.modalities.video.frames import frames_clip

    def encoded(size, fmt):
        out = io.BytesIO()
        Image.new("RGB", size, (200, 30, 30)).save(out, format=fmt)
        return out.getvalue()
    make(tmp_path, [encoded((32, 24), "JPEG"), encoded((24, 32), "JPEG")],
         encoded((32, 24), "PNG"))
    with pytest.raises(MediaError) as caught:
        frames_clip(str(tmp_path), 2.0)
    assert caught.value.reason == reason


def test_a_frames_clip_gives_qwen2_vl_what_its_processor_makes_of_the_frames(frames_folder):
    """The clip made of a frames folder at 2 fps, against transformers' Qwen2VLVideoProcessor
    given the folder's frames as a user would (the JPEGs decoded, the fps as metadata): the
    same sampled frames, grid and token count, exactly; the pixels within the two JPEG
    decoders' difference (FFmpeg's, which reads every clip, and Pillow's)."""
    import io

    import numpy as np
    import torch
    from PIL import Image

    from mimo_data.modalities.video import VIDEO, VideoConfig, normalize_video_pixels
    from mimo_data.modalities.video.frames import frames_clip
    from support.vlm_runs import video_processor

    folder, frames = frames_folder
    cfg = VideoConfig(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 16)
    clip = frames_clip(str(folder), 2.0)
    item = {"modality": "video", "member": "vid0.mkv", "bytes": len(clip),
            **VIDEO.probe(clip, "decode", 10 ** 9)}
    decoded = [np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")) for jpeg in frames]
    reference = video_processor(cfg)(
        videos=[np.stack(decoded)], video_metadata=[{"total_num_frames": len(frames),
                                                     "fps": 2.0}],
        return_tensors="pt", return_metadata=True)
    inputs = VIDEO.encoder_inputs([VIDEO.decode(clip, item, cfg)], cfg)
    assert torch.equal(inputs["video_grid_thw"], reference["video_grid_thw"])
    tokens = int(reference["video_grid_thw"].prod()) // cfg.merge_size ** 2
    assert VIDEO.item_tokens(item, cfg) == tokens
    pixels = normalize_video_pixels(inputs["pixel_values_videos"], cfg)
    gap = (pixels - reference["pixel_values_videos"]).abs()
    # normalized (a 0-255 step is ~0.015): 0.014 on average, 0.43 at most here (chroma edges)
    assert gap.mean() < 0.03 and gap.max() < 0.6, (gap.mean(), gap.max())


def test_frames_are_in_the_order_of_their_numbers(tmp_path):
    """``1.jpg`` ... ``12.jpg`` (names not zero-padded): the clip's frames in the order of
    their numbers, not of their names as strings (1, 10, 11, 12, 2, ...)."""
    import io

    import av
    from PIL import Image

    from mimo_data.modalities.video.frames import frames_clip

    frames = {}
    for number in range(1, 13):
        jpeg = io.BytesIO()
        Image.new("RGB", (32, 24), (number * 20, 0, 0)).save(jpeg, format="JPEG")
        frames[number] = jpeg.getvalue()
        (tmp_path / f"{number}.jpg").write_bytes(frames[number])
    with av.open(io.BytesIO(frames_clip(str(tmp_path), 3.0))) as clip:
        stored = [bytes(p) for p in clip.demux(clip.streams.video[0]) if p.size]
    assert stored == [frames[number] for number in range(1, 13)]
    # a frame missing from the numbering: refused, never the later frames shown early
    from mimo_data.modalities.base import MediaError

    (tmp_path / "5.jpg").unlink()
    with pytest.raises(MediaError, match=r"skips a number: 4\.jpg then 6\.jpg, where its "
                       r"frames step by 1 \(a frame missing") as caught:
        frames_clip(str(tmp_path), 3.0)
    assert caught.value.reason == "missing_media"
    # frames kept every other number (taken so) are no gap
    (tmp_path / "5.jpg").write_bytes(frames[5])
    for number in (2, 4, 6, 8, 10, 12):
        (tmp_path / f"{number}.jpg").unlink(missing_ok=True)
    with av.open(io.BytesIO(frames_clip(str(tmp_path), 3.0))) as clip:
        stored = [bytes(p) for p in clip.demux(clip.streams.video[0]) if p.size]
    assert stored == [frames[number] for number in (1, 3, 5, 7, 9, 11)]
    # no evidence of a gap: frames named by their times in milliseconds (steps 33 and 34,
    # neither a multiple of the other), names differing otherwise than in their last number,
    # a number given twice (1.jpg, 01.jpg), a folder of one frame or two
    from mimo_data.modalities.video.frames import _numbering_gap
    for names in (["0.jpg", "33.jpg", "67.jpg", "100.jpg", "133.jpg"],
                  ["s1_1.jpg", "s1_2.jpg", "s2_4.jpg"], ["1.jpg", "01.jpg", "2.jpg"],
                  ["7.jpg"], ["1.jpg", "3.jpg"]):
        assert _numbering_gap(names) is None, names
    assert _numbering_gap(["f0010.jpg", "f0020.jpg", "f0040.jpg"]) == ("f0020.jpg", "f0040.jpg",
                                                                        10)
    # frames kept unevenly from a longer clip, numbered by its frames (16 of 20, linspace's
    # picks: steps of 1 and 2 mixed): taken so, no gap; one frame lost of 40 taken evenly is
    import numpy as np
    assert _numbering_gap([f"frame_{i:04d}.jpg" for i in np.linspace(0, 19, 16).astype(int)]) \
        is None
    assert _numbering_gap([f"{i:05d}.jpg" for i in range(1, 41) if i != 17]) == (
        "00016.jpg", "00018.jpg", 1)
    (tmp_path / "1.jpg").rename(tmp_path / "only.jpg")
    for each in tmp_path.glob("[0-9]*.jpg"):
        each.unlink()
    with av.open(io.BytesIO(frames_clip(str(tmp_path), 3.0))) as clip:      # one frame
        assert [bytes(p) for p in clip.demux(clip.streams.video[0]) if p.size] == [frames[1]]
