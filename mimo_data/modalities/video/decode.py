"""Clips through PyAV (``av``): probing the encoded bytes at build time, and decoding the
frames the sampling picks.

PyAV's wheel bundles FFmpeg, so nothing outside the Python environment is needed; torchcodec,
transformers' default video decoder, needs a system FFmpeg. ``decode_video`` decodes only up
to the frames it samples, seeking to the keyframe before each one when that skips decoding
work.
"""

from __future__ import annotations

import bisect
import io
import re
from collections.abc import Iterator, Mapping
from typing import Any

import av
import numpy as np

from mimo_data.errors import listed
from mimo_data.modalities.base import MediaError
from mimo_data.modalities.video.config import MAX_VIDEO_SECONDS, VideoConfig
from mimo_data.modalities.video.sampling import sample_indices

# Container format -> member file extension.
VIDEO_EXTENSIONS = {"mp4": "mp4", "mov": "mov", "webm": "webm", "mkv": "mkv", "avi": "avi"}
# Codecs (FFmpeg's canonical names) kept: those the FFmpeg in PyAV's wheel decodes.
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mjpeg")


def _container_format(name: str, data: bytes) -> str:
    """Our format name for FFmpeg's demuxer ``name``: the mov/mp4 and matroska/webm demuxers
    each read two formats, told apart by the ftyp major brand and the EBML DocType."""
    if name.startswith("mov,mp4"):
        return "mov" if data[8:12] == b"qt  " else "mp4"
    if name.startswith("matroska"):
        return "webm" if b"webm" in data[:64] else "mkv"
    return name.split(",")[0]


def _rotation(frame: av.VideoFrame) -> int:
    """Counter-clockwise display rotation of a decoded frame (its display matrix), in
    {0, 90, 180, 270}; flips in the matrix are not applied."""
    return int(round(frame.rotation / 90)) * 90 % 360


def _ffmpeg_said(exc: av.FFmpegError) -> str:
    """FFmpeg's reason without its errno and the "'<none>'" name of an in-memory file."""
    return getattr(exc, "strerror", None) or str(exc)


def _too_long(duration: float, max_seconds: float) -> MediaError:
    return MediaError("video_too_long", f"clip of {duration:.1f} s is longer than "
                      f"{max_seconds:g} s: cut it into shorter clips first (ffmpeg -i IN -c "
                      "copy -f segment -segment_time 600 OUT%03d.mp4)")


def _open(data: bytes) -> av.container.InputContainer:
    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as exc:
        raise MediaError("corrupt_video", f"FFmpeg cannot open it as a video "
                         f"({_ffmpeg_said(exc)}): a file cut short (an mp4 whose index, written "
                         "last, is missing) or not a video") from None


def probe_video(data: bytes, check: str = "decode",
                max_seconds: float = MAX_VIDEO_SECONDS) -> dict:
    """Validate an encoded video; return ``{format, codec, width, height, rotation, fps,
    frames, duration}`` of its first video stream.

    ``width``/``height`` are after the display rotation (90 and 270 swap them), ``fps`` the
    average frame rate, ``duration`` in seconds. ``check="decode"`` decodes every frame and
    ``frames`` counts them; ``"header"`` decodes the first frame (its size and rotation) and
    takes the stream's frame count, or counts its packets when the container does not say.
    Raises MediaError(``corrupt_video`` | ``no_video_stream`` | ``video_too_long`` |
    ``unsupported_format`` | ``unsupported_codec``).
    """
    if not data:
        raise MediaError("corrupt_video", "empty video file (0 bytes)")
    with _open(data) as container:
        if not container.streams.video:
            raise MediaError("no_video_stream", "the file has no video stream" + (
                " (it holds audio: give it as an audio item?)" if container.streams.audio
                else ""))
        stream = container.streams.video[0]
        fmt = _container_format(container.format.name, data)
        if fmt.endswith("_pipe"):      # FFmpeg's image readers: jpeg_pipe, png_pipe, ...
            raise MediaError("unsupported_format", f"an image ({fmt.removesuffix('_pipe')}), "
                             "not a video: give it as an image item, or a folder of frames "
                             "as a video (mimo-shard build --frames-fps)")
        if stream.codec_context is None:   # a codec (fourcc) FFmpeg has no decoder for
            raise MediaError("unsupported_codec", "its video codec is one FFmpeg knows no "
                             f"decoder for; re-encode it first as one of "
                             f"{listed(VIDEO_CODECS)} (ffmpeg -i IN -c:v libx264 -pix_fmt "
                             "yuv420p OUT.mp4, with the FFmpeg that plays it)")
        codec = stream.codec_context.codec.canonical_name
        if fmt not in VIDEO_EXTENSIONS:     # its stream copied where mp4 takes the codec
            how = ("ffmpeg -i IN -c copy OUT.mp4 keeps its streams as they are"
                   if codec in VIDEO_CODECS else
                   "ffmpeg -i IN -c:v libx264 -pix_fmt yuv420p OUT.mp4")
            raise MediaError("unsupported_format", f"video container {fmt!r} is not one of "
                             f"{listed(sorted(VIDEO_EXTENSIONS))}; convert it first ({how})")
        if codec not in VIDEO_CODECS:
            raise MediaError("unsupported_codec", f"video codec {codec!r} is not one of "
                             f"{listed(VIDEO_CODECS)}; re-encode it first")
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise MediaError("corrupt_video", "the video stream has no frame rate")
        fps = float(rate)
        duration = (float(stream.duration * stream.time_base) if stream.duration
                    else container.duration / av.time_base if container.duration else None)
        if duration is not None and duration > max_seconds:
            raise _too_long(duration, max_seconds)
        declared = stream.frames
        # an mp4 whose edit list shows fewer frames than it holds (a stream-copy cut, ffmpeg
        # -ss 10 -i IN -c copy OUT) plays and decodes those it shows, as its duration says
        shown = round(float(stream.duration * stream.time_base) * fps) if stream.duration else 0
        if 0 < shown < declared:
            declared = shown
        stated = _stated_seconds(container, stream)
        start, time_base = stream.start_time or 0, stream.time_base
        try:
            frames = 0
            first = None
            last = None                 # the latest frame's (or packet's) time stamp
            if check == "decode":
                for frame in container.decode(stream):
                    if first is None:
                        first = (frame.width, frame.height, _rotation(frame))
                    elif (frame.width, frame.height) != first[:2]:
                        raise MediaError("corrupt_video", "frame size changes within the clip")
                    frames += 1
                    if frame.pts is not None:
                        last = max(last or 0, frame.pts)
            else:
                for packet in container.demux(stream):
                    if packet.size and not packet.is_discard:
                        frames += 1
                        if packet.pts is not None:
                            last = max(last or 0, packet.pts)
                with _open(data) as again:
                    head = next(again.decode(again.streams.video[0]), None)
                    if head is not None:
                        first = (head.width, head.height, _rotation(head))
                if declared and frames >= declared:
                    frames = declared
        except av.FFmpegError as exc:
            # a file cut short fails its decode where its data ends: said as cut, with the
            # frames found, as the header check says it
            cut = (f" after {frames} of the {declared} frames the header declares "
                   "(truncated or damaged)" if frames and declared and frames < declared
                   else "")
            raise MediaError("corrupt_video", f"FFmpeg cannot decode the video{cut}: "
                             f"{_ffmpeg_said(exc)}") from None
    if first is None or frames == 0:
        raise MediaError("corrupt_video", "the video stream decodes to no frames")
    if declared and frames < declared:
        raise MediaError("corrupt_video", f"{frames} of the {declared} frames the header "
                         "declares are there (truncated)")
    if not declared and last is not None and stated:
        # Matroska and WebM declare no frame count: a cut or damaged file is told by its
        # frames' times, which end before the length the file states
        covered = float((last - start) * time_base) + 1 / fps
        if covered < stated - max(2 / fps, 0.05 * stated):
            raise MediaError("corrupt_video", f"its frames cover {covered:.2f} s of the "
                             f"{stated:.2f} s the file states (truncated or damaged)")
    width, height, rotation = first
    if rotation in (90, 270):
        width, height = height, width
    if duration is None:
        duration = frames / fps
    if duration > max_seconds:
        raise _too_long(duration, max_seconds)
    return {"format": fmt, "codec": codec, "width": width, "height": height,
            "rotation": rotation, "fps": fps, "frames": frames, "duration": round(duration, 6)}



def _stated_seconds(container: av.container.InputContainer,
                    stream: av.video.stream.VideoStream) -> float | None:
    """The video stream's length as the file states it: the stream's duration, Matroska's
    per-track ``DURATION`` tag (FFmpeg's muxer writes it), or the container's where the video
    is its only stream (with an audio track, the container's may be the audio's)."""
    if stream.duration:
        return float(stream.duration * stream.time_base)
    tag = re.fullmatch(r"(\d+):(\d\d):(\d\d(?:\.\d+)?)", stream.metadata.get("DURATION", ""))
    if tag:
        hours, minutes, seconds = tag.groups()
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    if container.duration and len(container.streams) == 1:
        return container.duration / av.time_base
    return None


def _rgb(frame: av.VideoFrame, rotation: int) -> np.ndarray:
    pixels = frame.to_ndarray(format="rgb24")
    return np.ascontiguousarray(np.rot90(pixels, rotation // 90)) if rotation else pixels


def _sequential(data: bytes, indices: list[int], rotation: int) -> list[np.ndarray]:
    """Decode in order, keeping ``indices`` and stopping after the last of them."""
    wanted = set(indices)
    found: dict[int, np.ndarray] = {}
    with _open(data) as container:
        _single_threaded(container.streams.video[0])
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if index in wanted:
                found[index] = _rgb(frame, rotation)
            if index >= indices[-1]:
                break
    if len(found) < len(wanted):
        raise MediaError("corrupt_video", f"the clip decodes to fewer than {indices[-1] + 1} "
                         "frames, which its metadata promises")
    return [found[index] for index in indices]


def _single_threaded(stream: av.video.stream.VideoStream) -> None:
    """Decode on the calling thread: a data worker is the unit of parallelism, and FFmpeg's
    decoder threads in a process that later forks hang the forked workers that decode."""
    stream.codec_context.thread_count = 1


def _decoded(container: av.container.InputContainer, stream: av.video.stream.VideoStream,
             targets: set[int]) -> Iterator[av.VideoFrame]:
    """The stream's frames from the container's position on, without decoding the
    non-reference frames (FFmpeg's ``skip_frame`` NONREF: B-frames no other frame predicts
    from) other than ``targets`` (timestamps): skipping them changes no other frame."""
    context = stream.codec_context
    for packet in container.demux(stream):
        context.skip_frame = "NONREF" if packet.pts is not None and packet.pts not in targets \
            else "DEFAULT"
        yield from packet.decode()


def decode_frames(data: bytes, indices: list[int], rotation: int) -> list[np.ndarray]:
    """Frames ``indices`` (in presentation order, as a full decode numbers them) as RGB uint8
    ``[H, W, 3]``, rotated for display.

    The packets are demuxed once (no decoding) to know each frame's timestamp and the
    keyframes; then for each wanted frame the decoder seeks to the last keyframe at or before
    it when that keyframe lies past what is already decoded, and decodes forward to it,
    skipping the unwanted frames no other frame is predicted from (``_decoded``). Clips
    whose packets lack timestamps (or that hold discarded packets) are decoded in order up to
    the last wanted frame instead.
    """
    try:
        with _open(data) as container:
            stream = container.streams.video[0]
            packets: list[tuple[int, bool]] = []
            for packet in container.demux(stream):
                if not packet.size:
                    continue
                if packet.pts is None or packet.is_discard:
                    return _sequential(data, indices, rotation)
                packets.append((packet.pts, packet.is_keyframe))
            if len(packets) <= indices[-1]:
                return _sequential(data, indices, rotation)
            order = sorted(pts for pts, _ in packets)          # presentation order
            if len(set(order)) != len(order):
                return _sequential(data, indices, rotation)
            targets = {order[index] for index in indices}
            _single_threaded(stream)
            keyframes = sorted(pts for pts, key in packets if key)
            found: dict[int, np.ndarray] = {}
            position: int | None = None          # pts of the last decoded frame
            frames: Iterator[av.VideoFrame] = iter(())
            for target in sorted(targets):
                if target in found:
                    continue
                slot = bisect.bisect_right(keyframes, target) - 1
                key = keyframes[slot] if slot >= 0 else order[0]
                if position is None or key > position or target <= position:
                    container.seek(key, backward=True, any_frame=False, stream=stream)
                    frames = _decoded(container, stream, targets)
                for frame in frames:
                    pts = frame.pts
                    if pts is None:
                        return _sequential(data, indices, rotation)
                    position = pts
                    if pts in targets and pts not in found:
                        found[pts] = _rgb(frame, rotation)
                    if pts >= target:
                        break
                if target not in found:            # the seek overshot: decode in order
                    return _sequential(data, indices, rotation)
    except av.FFmpegError as exc:
        raise MediaError("corrupt_video", "FFmpeg cannot decode the video: "
                         f"{_ffmpeg_said(exc)}") from None
    return [found[order[index]] for index in indices]


def decode_video(data: bytes, item: Mapping[str, Any], cfg: VideoConfig) -> np.ndarray:
    """The sampled frames of a clip, uint8 ``[T, H, W, 3]`` after rotation."""
    if item["duration"] > cfg.max_duration:
        raise MediaError("video_too_long", f"clip of {item['duration']} s is longer than "
                         f"max_duration = {cfg.max_duration} s")
    try:
        indices = sample_indices(item["frames"], item["fps"], cfg)
    except ValueError as exc:
        raise MediaError("video_too_short", str(exc)) from None
    frames = np.stack(decode_frames(data, indices, item.get("rotation", 0)))
    if frames.shape[1:3] != (item["height"], item["width"]):
        raise ValueError(f"decodes to {frames.shape[2]}x{frames.shape[1]}, the metadata says "
                         f"{item['width']}x{item['height']}")
    return frames

