"""The video modality against the corpus clips (made with PyAV from real photos by
``tools/make_video_clips.py``), and against transformers' ``Qwen2VLVideoProcessor`` (frame
sampling, grid, pixels).

The clips are pans and zooms over scikit-image and matplotlib photos (h264, mpeg4 and vp9;
10, 24 and 30 fps; several sizes; one with a display rotation, one with an audio track, one cut
short, one in a codec mimo refuses, one single frame); the probe is checked against the catalog
of what was written. The processor needs torchvision (its only
backend): the tests that call it are skipped where torchvision is not installed.
"""

from __future__ import annotations

import dataclasses
import io
import re

import av
import numpy as np
import pytest
import torch

from mimo_data.modalities import MODALITIES, MediaError
from mimo_data.modalities.video import decode as video_decode
from mimo_data.modalities.video import (
    VIDEO, VideoConfig, decode_frames, normalize_video_pixels, probe_video, sample_indices,
    sampled_frame_count)
from conftest import VideoClip
from support.vlm_runs import video_processor


# The clips (the corpus's, ``tools/make_video_clips.py``) that decode.
CLIP_NAMES = ["pan_h264_24", "zoom_mpeg4_10", "pan_vp9_30", "rotated_h264_24", "audio_h264_30",
              "zoom_h264_10"]


@pytest.fixture(scope="module")
def clips(corpus_videos) -> dict[str, VideoClip]:
    return corpus_videos


def _full_decode(clip: VideoClip) -> np.ndarray:
    """Every frame in order, plain PyAV, rotated as the display matrix says."""
    with av.open(io.BytesIO(clip.data)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    return np.rot90(frames, clip.rotation // 90, axes=(1, 2)) if clip.rotation else frames


def _item(clip: VideoClip, check: str = "decode") -> dict:
    return {"modality": "video", "member": "vid0.mp4", "bytes": len(clip.data),
            **probe_video(clip.data, check)}


def test_registered():
    assert MODALITIES["video"] is VIDEO and VIDEO.marker == "<video>"


# ------------------------------------------------------------------------------------ probe

@pytest.mark.parametrize("name", CLIP_NAMES)
@pytest.mark.parametrize("check", ["header", "decode"])
def test_probe_reports_what_was_written(clips, name, check):
    clip = clips[name]
    meta = probe_video(clip.data, check)
    assert {k: meta[k] for k in ("format", "codec", "width", "height", "rotation", "frames")} == {
        "format": clip.format, "codec": clip.codec, "width": clip.width,
        "height": clip.height, "rotation": clip.rotation, "frames": clip.frames}
    assert meta["fps"] == clip.fps
    assert meta["duration"] == pytest.approx(clip.frames / clip.fps, abs=1.5 / clip.fps)
    assert VIDEO.decoded_metadata(clip.data) == probe_video(clip.data, "decode")


def test_bad_clips_raise_their_reasons(clips, corpus):
    cut = clips["truncated_h264_24"]                   # index first, its last third cut off
    assert cut.truncated
    for check in ("header", "decode"):
        with pytest.raises(MediaError) as caught:
            probe_video(cut.data, check)
        assert caught.value.reason == "corrupt_video"
        # either way said as cut, against the frames its header declares
        assert re.search(r"\b\d+ of the \d+ frames the header declares .*truncated",
                         caught.value.detail), caught.value.detail
    # WebM (Matroska) declares no frame count: a cut one is told by its frames' times
    webm = clips["pan_vp9_30"].data
    for check in ("header", "decode"):
        with pytest.raises(MediaError, match=r"frames cover .* of the 2\.00 s") as caught:
            probe_video(webm[:len(webm) * 2 // 3], check)
        assert caught.value.reason == "corrupt_video"
    tail_index = clips["pan_h264_24"].data                        # index (moov) last
    with pytest.raises(MediaError) as caught:
        probe_video(tail_index[:len(tail_index) // 2], "header")
    assert caught.value.reason == "corrupt_video"
    assert caught.value.detail.startswith("FFmpeg cannot open it as a video (Invalid data found "
                                          "when processing input): a file cut short (an mp4 "
                                          "whose index"), caught.value.detail
    for junk in (b"", b"\x00" * 1000):
        with pytest.raises(MediaError) as caught:
            probe_video(junk)
        assert caught.value.reason == "corrupt_video"

    with pytest.raises(MediaError) as caught:
        probe_video((corpus / "audio" / "cards-001.wav").read_bytes())
    assert caught.value.reason == "no_video_stream"
    assert caught.value.detail.endswith("(it holds audio: give it as an audio item?)")
    photo = next((corpus / "images").glob("*.jpg")).read_bytes()     # a photo as a video
    with pytest.raises(MediaError, match=r"^an image \(jpeg\), not a video: give it as an "
                       "image item, or a folder of frames"):
        probe_video(photo)
    # an animated GIF (TGIF's clips): a container mp4 cannot copy its codec into
    import io

    from PIL import Image
    gif = io.BytesIO()
    frames = [Image.new("RGB", (32, 32), (i * 80, 0, 0)) for i in range(3)]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    with pytest.raises(MediaError, match=r"container 'gif' is not one of .*; convert it first "
                       r"\(ffmpeg -i IN -c:v libx264 -pix_fmt yuv420p OUT\.mp4\)"):
        probe_video(gif.getvalue())

    ffv1 = clips["pan_ffv1_10"]
    assert ffv1.codec == "ffv1"
    with pytest.raises(MediaError) as caught:
        probe_video(ffv1.data)
    assert caught.value.reason == "unsupported_codec"

    # a codec FFmpeg does not know (a proprietary fourcc in the sample entry): PyAV gives the
    # stream no codec context; an unsupported codec, not an AttributeError that stops a build
    unknown = clips["pan_h264_24"].data.replace(b"avc1", b"zzzz")
    for check in ("header", "decode"):
        with pytest.raises(MediaError) as caught:
            probe_video(unknown, check)
        assert caught.value.reason == "unsupported_codec", caught.value
        assert "knows no decoder" in caught.value.detail, caught.value.detail

    with pytest.raises(MediaError) as caught:
        probe_video(clips["pan_h264_24"].data, max_seconds=1.0)
    assert caught.value.reason == "video_too_long" and "cut it into shorter clips first " \
        "(ffmpeg -i IN -c copy -f segment" in caught.value.detail
    item = _item(clips["pan_h264_24"])
    with pytest.raises(MediaError) as caught:
        VIDEO.item_tokens(item, VideoConfig(max_duration=1.0))
    assert caught.value.reason == "video_too_long"
    # named by its source file as well as its member (vid0.mp4 in every sample)
    with pytest.raises(MediaError, match=r"^vid0\.mp4 \(videos/pan\.mp4\) lasts "):
        VIDEO.item_tokens({**item, "member": "vid0.mp4", "path": "videos/pan.mp4"},
                          VideoConfig(max_duration=1.0))


def test_a_cut_whose_edit_list_hides_frames_is_the_frames_it_shows(clips):
    """A stream-copy cut (``ffmpeg -ss 10 -i IN -c copy OUT``) keeps the packets from the
    keyframe before the cut and an edit list that hides them: its header declares every frame
    it holds, players and decoders show the rest. Those it shows are the clip, never refused
    as truncated, and decoding a sample of them gives those frames."""
    source = clips["pan_h264_24"]
    cut = io.BytesIO()
    with av.open(io.BytesIO(source.data)) as container, av.open(cut, "w", format="mp4") as out:
        stream = container.streams.video[0]
        copied = out.add_stream_from_template(stream)
        hidden = 10 * int(1 / (stream.average_rate * stream.time_base))
        for packet in container.demux(stream):
            if packet.dts is None:
                continue
            packet.pts, packet.dts, packet.stream = packet.pts - hidden, packet.dts - hidden, copied
            out.mux(packet)
    data = cut.getvalue()
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].frames == source.frames          # all it holds
    shown = _full_decode(dataclasses.replace(source, data=data))
    assert np.array_equal(shown, _full_decode(source)[10:])
    for check in ("header", "decode"):
        meta = probe_video(data, check)
        assert meta["frames"] == source.frames - 10, (check, meta)
        assert meta["duration"] == pytest.approx((source.frames - 10) / source.fps)
    indices = [0, 7, 25, source.frames - 11]
    assert all(np.array_equal(frame, shown[i])
               for frame, i in zip(decode_frames(data, indices, 0), indices))
    # an NTSC rate's clip (30000/1001: its duration times its rate is 29.999... in floats)
    # shows every frame it holds, none lost to the rounding
    from fractions import Fraction
    ntsc = io.BytesIO()
    with av.open(ntsc, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=Fraction(30000, 1001))
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for number in range(30):
            frame = av.VideoFrame.from_ndarray(np.full((24, 32, 3), number * 8, np.uint8),
                                               format="rgb24")
            frame.pts, frame.time_base = number, Fraction(1001, 30000)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    for check in ("header", "decode"):
        assert probe_video(ntsc.getvalue(), check)["frames"] == 30, check


# --------------------------------------------------------------------------------- sampling

def documented_indices(total: int, video_fps: float, cfg: VideoConfig) -> list[int]:
    """Qwen2VLVideoProcessor.sample_frames, from its description: fps * duration frames,
    clamped to [min_frames, max_frames rounded down to temporal patches (and to the clip)],
    rounded down to temporal patches, spread as ``i * total / n`` rounded down. (The processor
    computes these with a float32 ``arange``, which for clips of more than 2^13 frames can
    come out one off: ``LONG_CLIPS``.)"""
    tps = cfg.temporal_patch_size
    cap = min(cfg.max_frames, total) // tps * tps
    n = min(max(total / video_fps * cfg.fps, cfg.min_frames), cap, total)
    n = int(n // tps) * tps
    return [i * total // n for i in range(n)]


SAMPLING_GRID = [(total, video_fps) for video_fps in (10, 23.976, 24, 25, 30, 60)
                 for total in (1, 2, 3, 5, 17, 30, 49, 75, 506, 1213, 2000, 8000)]
LONG_CLIPS = [(total, video_fps) for video_fps in (10, 30) for total in (17887, 30000, 99991)]


@pytest.mark.parametrize("cfg", [VideoConfig(), VideoConfig(fps=1.0, min_frames=2),
                                 VideoConfig(fps=8.0, max_frames=64, temporal_patch_size=1)])
def test_sampling_follows_the_documented_rules(cfg):
    for total, video_fps in SAMPLING_GRID:
        expected = documented_indices(total, video_fps, cfg)
        assert sampled_frame_count(total, video_fps, cfg) == len(expected), (total, video_fps)
        if expected:
            assert sample_indices(total, video_fps, cfg) == expected, (total, video_fps)
        else:
            with pytest.raises(ValueError):
                sample_indices(total, video_fps, cfg)
    for total, video_fps in LONG_CLIPS:                 # float32 arange: one off at most
        expected = documented_indices(total, video_fps, cfg)
        got = sample_indices(total, video_fps, cfg)
        assert len(got) == len(expected)
        assert all(abs(e - g) <= 1 for e, g in zip(expected, got)), (total, video_fps)
    # arange's double-precision length is n + 1 here, the last index the clip's length
    assert len(torch.arange(0, 506, 506 / 100)) == 101
    assert sample_indices(506, 10, VideoConfig())[-1] == 500


def test_a_clip_that_samples_no_patch_names_the_clip_or_the_settings():
    """Too few frames in the clip: the clip is named; frames enough, but the sampling settings
    keep fewer than a temporal patch of them: the settings are named, with the fix."""
    with pytest.raises(ValueError, match="^a clip of 1 frame is shorter than "
                       "temporal_patch_size = 2 frames$"):
        sample_indices(1, 24, VideoConfig())
    with pytest.raises(ValueError, match=r"^a clip of 60 frames \(2.50 s\) sampled at "
                       r"modalities.video.fps = 0.5 with min_frames = 1 gives fewer than "
                       r"temporal_patch_size = 2 frames: raise fps, or min_frames to 2 or more$"):
        sample_indices(60, 24, VideoConfig(fps=0.5, min_frames=1))
    # settings that no clip could sample a patch under: the config's error, with its values
    from mimo_data.errors import ConfigError
    with pytest.raises(ConfigError, match=r"^modalities.video.max_frames is 1, below "
                       r"temporal_patch_size \(2\): no clip could give one temporal patch of "
                       r"frames; give max_frames >= 2$"):
        VideoConfig(min_frames=1, max_frames=1).validate()
    with pytest.raises(ConfigError, match=r"^modalities.video.min_frames \(10\) is above "
                       r"max_frames \(4\): give min_frames <= max_frames$"):
        VideoConfig(min_frames=10, max_frames=4).validate()


def test_sampling_equals_the_processors():
    from transformers.video_utils import VideoMetadata
    for cfg in (VideoConfig(), VideoConfig(fps=1.0, min_frames=2)):
        processor = video_processor(cfg)
        for total, video_fps in SAMPLING_GRID + LONG_CLIPS:
            if not documented_indices(total, video_fps, cfg):
                continue
            theirs = processor.sample_frames(VideoMetadata(total_num_frames=total,
                                                           fps=video_fps)).tolist()
            if theirs[-1] == total:     # the processor's extra index, past the clip (dropped)
                theirs = theirs[:-1]
            assert sample_indices(total, video_fps, cfg) == theirs, (total, video_fps)
    # such an index makes the processor itself fail: 17 frames at 17/7 fps ask for 14 frames
    processor = video_processor(VideoConfig())
    with pytest.raises(IndexError):
        processor(videos=[np.zeros((17, 56, 56, 3), np.uint8)],
                  video_metadata=[{"total_num_frames": 17, "fps": 17 / 7}], return_tensors="pt")


def test_a_new_sampling_rule_is_one_entry_of_the_table(monkeypatch):
    """A family whose processor keeps every frame (rounded down to temporal patches) at 56x56:
    the config accepts its name, and frame counts, indices, grids and token counts follow it."""
    from mimo_data.modalities.video import SAMPLINGS, FrameSampling, video_grid_thw
    every_frame = FrameSampling(
        "EveryFrameVideoProcessor",
        frame_count=lambda frames, fps, cfg: frames // cfg.temporal_patch_size
        * cfg.temporal_patch_size,
        frame_indices=lambda frames, count: list(range(count)),
        resized_size=lambda width, height, sampled, cfg: (56, 56))
    monkeypatch.setitem(SAMPLINGS, "every_frame", every_frame)
    cfg = VideoConfig(sampling="every_frame")
    cfg.validate()
    assert sampled_frame_count(11, 24.0, cfg) == 10
    assert sample_indices(11, 24.0, cfg) == list(range(10))
    assert video_grid_thw(11, 24.0, 320, 240, cfg) == (5, 4, 4)      # 56 / 14 patches a side
    item = {"member": "vid0.mp4", "frames": 11, "fps": 24.0, "width": 320, "height": 240,
            "duration": 11 / 24}
    assert VIDEO.item_tokens(item, cfg) == 5 * 2 * 2                 # merged 2 x 2


# ------------------------------------------------------------------ decode and encoder inputs

CONFIGS = {
    "default": VideoConfig(),                                   # frames upscaled
    "small": VideoConfig(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 8, fps=4.0),  # downscaled
    "capped": VideoConfig(cap_pixels_per_frame=True, max_video_tokens=300),  # budget binds
}


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_decode_gives_the_sampled_frames(clips, name):
    clip = clips[name]
    item = _item(clip, "header")
    for cfg in CONFIGS.values():
        full = _full_decode(clip)
        indices = documented_indices(len(full), clip.fps, cfg)
        decoded = VIDEO.decode(clip.data, item, cfg)
        assert decoded.dtype == np.uint8 and decoded.shape == (len(indices), clip.height,
                                                               clip.width, 3)
        np.testing.assert_array_equal(decoded, full[indices])


def test_a_clip_whose_frames_disagree_with_its_metadata_is_refused(clips):
    """A sample whose metadata states another frame size than the clip decodes to (upright,
    as its rotation turns it): decoding raises, naming both sizes."""
    clip = clips["rotated_h264_24"]
    item = _item(clip, "header")
    assert VIDEO.decode(clip.data, item, VideoConfig()).shape[1:3] == (clip.height, clip.width)
    for stated in ((clip.width + 1, clip.height), (clip.height, clip.width)):
        with pytest.raises(ValueError) as caught:
            VIDEO.decode(clip.data, {**item, "width": stated[0], "height": stated[1]},
                         VideoConfig())
        assert str(caught.value) == (f"decodes to {clip.width}x{clip.height}, the metadata "
                                     f"says {stated[0]}x{stated[1]}")


def test_rotation_turns_the_pixels(clips):
    plain, turned = clips["pan_h264_24"], clips["rotated_h264_24"]   # the same frames
    indices = list(range(0, plain.frames, 7))
    upright = decode_frames(plain.data, indices, 0)
    shown = decode_frames(turned.data, indices, 90)
    for a, b in zip(upright, shown):
        np.testing.assert_array_equal(b, np.rot90(a, 1))        # 90 degrees counter-clockwise


def test_decode_stops_short_of_the_whole_clip(clips, monkeypatch):
    """The sparse frames of a clip with keyframes every 10 frames are reached by seeking."""
    decoded = [0]
    real_open = video_decode._open

    class Counting:
        def __init__(self, container):
            self.container = container

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.container.close()

        def __getattr__(self, name):
            return getattr(self.container, name)

        def decode(self, *args, **kwargs):
            for frame in self.container.decode(*args, **kwargs):
                decoded[0] += 1
                yield frame

    monkeypatch.setattr(video_decode, "_open", lambda data: Counting(real_open(data)))
    clip = clips["pan_h264_24"]
    frames = VIDEO.decode(clip.data, _item(clip, "header"), VideoConfig())
    assert len(frames) == 4
    assert decoded[0] <= clip.frames // 2 + 1   # header probe decodes 1 frame


@pytest.mark.parametrize("name", CLIP_NAMES)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_encoder_inputs_equal_the_processors(clips, name, config):
    cfg, clip = CONFIGS[config], clips[name]
    processor = video_processor(cfg)
    item = _item(clip)
    full = _full_decode(clip)
    reference = processor(videos=[full], video_metadata=[{"total_num_frames": len(full),
                                                          "fps": clip.fps}],
                          return_tensors="pt", return_metadata=True)
    indices = reference["video_metadata"][0].frames_indices
    assert list(indices) == documented_indices(len(full), clip.fps, cfg)

    inputs = VIDEO.encoder_inputs([VIDEO.decode(clip.data, item, cfg)], cfg)
    assert inputs["pixel_values_videos"].dtype == torch.uint8
    assert torch.equal(inputs["video_grid_thw"], reference["video_grid_thw"])
    grid = reference["video_grid_thw"]
    tokens = int(grid.prod()) // cfg.merge_size ** 2
    assert VIDEO.tokens(item, cfg) == VIDEO.item_tokens(item, cfg) == tokens  # type: ignore
    assert VIDEO.rows_to_tokens(inputs, cfg) == [tokens]
    t, h, w = grid[0].tolist()
    assert VIDEO.token_grid(item, cfg) == (t, h // cfg.merge_size, w // cfg.merge_size)
    pixels = normalize_video_pixels(inputs["pixel_values_videos"], cfg)
    assert torch.equal(pixels, reference["pixel_values_videos"])


def test_several_clips_in_one_batch(clips):
    cfg = CONFIGS["small"]
    chosen = [clips["pan_h264_24"], clips["zoom_mpeg4_10"]]
    decoded = [VIDEO.decode(c.data, _item(c), cfg) for c in chosen]   # type: ignore[arg-type]
    inputs = VIDEO.encoder_inputs(decoded, cfg)
    single = [VIDEO.encoder_inputs([d], cfg) for d in decoded]
    assert torch.equal(inputs["pixel_values_videos"],
                       torch.cat([s["pixel_values_videos"] for s in single]))
    assert VIDEO.rows_to_tokens(inputs, cfg) == [VIDEO.tokens(_item(c), cfg) for c in chosen]


def test_too_short_and_views(clips):
    still = clips["still_h264_10"]
    item = {"member": "vid0.mp4", **probe_video(still.data)}
    assert item["frames"] == still.frames == 1
    with pytest.raises(MediaError) as caught:
        VIDEO.item_tokens(item, VideoConfig())                  # type: ignore[arg-type]
    assert caught.value.reason == "video_too_short"
    # frames enough, but sampled too sparsely (fps 0.5, min_frames 1): too short as well
    sparse = {"member": "vid0.mp4", **probe_video(clips["pan_h264_24"].data)}
    with pytest.raises(MediaError) as caught:
        VIDEO.item_tokens(sparse, VideoConfig(fps=0.5, min_frames=1))  # type: ignore[arg-type]
    assert caught.value.reason == "video_too_short" and "gives fewer than " \
        "temporal_patch_size = 2 frames: raise fps, or min_frames to 2" in str(caught.value)
    clip = clips["rotated_h264_24"]
    item = _item(clip)
    assert VIDEO.describe(item) == f"96x128 h264 24 fps 2.50 s, rotated {item['rotation']}°"
    assert item["rotation"] in (90, 270)
    png, problem = VIDEO.preview_png(clip.data, item, VideoConfig())
    assert png.startswith(b"\x89PNG") and problem == ""
