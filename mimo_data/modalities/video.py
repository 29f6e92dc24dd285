"""The video modality: probing at build time, frame sampling, token counts, decoding, inputs.

Decoding is PyAV's (``av``): its wheel bundles FFmpeg, so nothing outside the Python
environment is needed; torchcodec, transformers' default video decoder, needs a system FFmpeg.

The encoder inputs follow transformers' ``Qwen2VLVideoProcessor`` with its own frame sampling
(``do_sample_frames=True`` and ``fps``), or with ``sampling: qwen3_vl`` its
``Qwen3VLVideoProcessor``: ``sample_indices`` picks the frames by its rules,
``video_resized_size`` is its ``smart_resize`` of each frame (optionally capped by its total
pixel budget, ``cap_pixels_per_frame``), the resize is the call torchvision makes for it
(``torch.nn.functional.interpolate``, bicubic, antialiased, native uint8 on the CPU) and the
patch layout is its ``patchify``. As for images, the patches leave the data workers as uint8
and ``normalize_video_pixels`` does the float step on the encoder's device, with the
processor's fused arithmetic (``(x - 255 * mean) / (255 * std)`` in float32): the tests check
the result equals the processor's ``pixel_values_videos`` exactly.

Token counts are pure functions of the probed metadata (frame count, average frame rate, width
and height after rotation) and the config: no decode. ``decode`` decodes only up to the frames
it samples, seeking to the keyframe before each one when that skips decoding work.
"""

from __future__ import annotations

import bisect
import functools
import io
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
    smart_resize as smart_resize_clip)

from mimo_data.errors import ConfigError
from mimo_data.modalities.base import MediaError, MediaItem, Modality
from mimo_data.modalities.image import CLIP_MEAN, CLIP_STD, MAX_ASPECT_RATIO


# Container format -> member file extension.
VIDEO_EXTENSIONS = {"mp4": "mp4", "mov": "mov", "webm": "webm", "mkv": "mkv", "avi": "avi"}
# Codecs (FFmpeg's canonical names) kept: those the FFmpeg in PyAV's wheel decodes.
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg2video", "mjpeg")
# The build refuses longer clips (``video_too_long``).
MAX_VIDEO_SECONDS = 3600.0
THUMBNAIL = (160, 160)
PREVIEW_FRAMES = 4
_MAX_MEMO = 1 << 16
SAMPLINGS = ("qwen2_vl", "qwen3_vl")


@dataclass(frozen=True)
class VideoConfig:
    """Frame sampling and the encoder's input layout, as ``Qwen2VLVideoProcessor``'s.

    ``fps`` frames a second are sampled, between ``min_frames`` and ``max_frames`` (and at most
    the clip's), a multiple of ``temporal_patch_size``; each frame is resized so both sides are
    multiples of ``patch_size * merge_size`` within [min_pixels, max_pixels] (with
    ``cap_pixels_per_frame``, max_pixels is also held to an even share of
    ``max_video_tokens * 0.9`` tokens' pixels over the sampled frames, floored at
    ``1.05 * min_pixels``); ``(t / temporal_patch_size) * (h / patch) * (w / patch) / merge²``
    tokens.

    ``sampling: qwen3_vl`` follows ``Qwen3VLVideoProcessor`` instead: ``int(duration * fps)``
    frames within [min_frames, max_frames] and the clip's, spread evenly from the first frame
    to the last (any count: the last frame is repeated up to a multiple of
    temporal_patch_size); [min_pixels, max_pixels] bound the pixels of the whole sampled clip
    (its ``size``), and with ``cap_pixels_per_frame`` each frame's are held to
    ``max_video_tokens`` tokens' and an even share of max_pixels, floored at
    ``1.05 * min_pixels``. ``timestamps`` (Qwen3-VL): each temporal patch's tokens sit between
    their own wrap tokens after the text ``<{t:.1f} seconds>`` (the mean time of its frames),
    the whole between the wrap tokens again, and each temporal patch is positioned (M-RoPE) as
    an image of its own.
    """
    token: str = "<|video_pad|>"
    wrap: tuple = ()                  # [start, end]: tokens around each clip's placeholders
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28   # per frame: the processor's size["shortest_edge"]
    max_pixels: int = 768 * 28 * 28   # per frame: its size["longest_edge"]
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD
    max_duration: float = MAX_VIDEO_SECONDS   # longer clips are dropped (video_too_long)
    # Qwen2.5-VL: M-RoPE time positions per second of video (its vision config's
    # tokens_per_second); None: one time position per temporal patch (Qwen2-VL)
    tokens_per_second: float | None = None
    sampling: str = "qwen2_vl"        # frame sampling and resize: qwen2_vl | qwen3_vl
    timestamps: bool = False          # Qwen3-VL: a timestamp text and a wrap per temporal patch

    def validate(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise ConfigError(f"modalities.video.sampling is {self.sampling!r}: use "
                              f"{' or '.join(SAMPLINGS)} (the checkpoint's video processor)")
        if self.timestamps and not self.wrap:
            raise ConfigError("modalities.video.timestamps puts each temporal patch between the "
                              "wrap tokens: give wrap too (e.g. [<|vision_start|>, "
                              "<|vision_end|>])")
        if self.timestamps and self.tokens_per_second is not None:
            raise ConfigError("modalities.video.timestamps and tokens_per_second: with "
                              "timestamps the time is in the text and each temporal patch is "
                              "positioned on its own (Qwen3-VL); drop tokens_per_second")
        if self.fps <= 0:
            raise ConfigError(f"modalities.video.fps is {self.fps}: it must be positive")
        if self.min_pixels > self.max_pixels:
            raise ConfigError("modalities.video.min_pixels is above max_pixels")
        if self.temporal_patch_size < 1 or self.min_frames > self.max_frames:
            raise ConfigError("modalities.video: temporal_patch_size must be at least 1 and "
                              "min_frames at most max_frames")


# --- probing -----------------------------------------------------------------------------

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


def _open(data: bytes) -> av.container.InputContainer:
    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError as exc:
        raise MediaError("corrupt_video", f"FFmpeg cannot open the video: {exc}") from None


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
            raise MediaError("no_video_stream", "the file has no video stream")
        stream = container.streams.video[0]
        fmt = _container_format(container.format.name, data)
        if fmt not in VIDEO_EXTENSIONS:
            raise MediaError("unsupported_format", f"video container {fmt!r} is not one of "
                             f"{sorted(VIDEO_EXTENSIONS)}; convert it first")
        codec = stream.codec_context.codec.canonical_name
        if codec not in VIDEO_CODECS:
            raise MediaError("unsupported_codec", f"video codec {codec!r} is not one of "
                             f"{list(VIDEO_CODECS)}; re-encode it first")
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise MediaError("corrupt_video", "the video stream has no frame rate")
        fps = float(rate)
        duration = (float(stream.duration * stream.time_base) if stream.duration
                    else container.duration / av.time_base if container.duration else None)
        if duration is not None and duration > max_seconds:
            raise MediaError("video_too_long", f"clip of {duration:.1f} s is longer than "
                             f"{max_seconds:g} s")
        declared = stream.frames
        try:
            frames = 0
            first = None
            if check == "decode":
                for frame in container.decode(stream):
                    if first is None:
                        first = (frame.width, frame.height, _rotation(frame))
                    elif (frame.width, frame.height) != first[:2]:
                        raise MediaError("corrupt_video", "frame size changes within the clip")
                    frames += 1
            else:
                for packet in container.demux(stream):
                    if packet.size and not packet.is_discard:
                        frames += 1
                with _open(data) as again:
                    head = next(again.decode(again.streams.video[0]), None)
                    if head is not None:
                        first = (head.width, head.height, _rotation(head))
                if declared and frames >= declared:
                    frames = declared
        except av.FFmpegError as exc:
            raise MediaError("corrupt_video", f"FFmpeg cannot decode the video: {exc}") from None
    if first is None or frames == 0:
        raise MediaError("corrupt_video", "the video stream decodes to no frames")
    if declared and frames < declared:
        raise MediaError("corrupt_video", f"{frames} of the {declared} frames the header "
                         "declares are there (truncated)")
    width, height, rotation = first
    if rotation in (90, 270):
        width, height = height, width
    if duration is None:
        duration = frames / fps
    if duration > max_seconds:
        raise MediaError("video_too_long", f"clip of {duration:.1f} s is longer than "
                         f"{max_seconds:g} s")
    return {"format": fmt, "codec": codec, "width": width, "height": height,
            "rotation": rotation, "fps": fps, "frames": frames, "duration": round(duration, 6)}


# --- sampling and token counts -----------------------------------------------------------

def sampled_frame_count(frames: int, fps: float, cfg: VideoConfig) -> int:
    """How many frames the video processor's ``sample_frames`` picks (0: too short).

    ``Qwen2VLVideoProcessor``'s rule: ``n = frames / fps * cfg.fps`` clamped to
    [min_frames, max_frames] and to the clip's frames (max_frames first rounded down to a
    multiple of temporal_patch_size, with the clip's frames), then rounded down to a multiple
    of temporal_patch_size. ``Qwen3VLVideoProcessor``'s (``sampling: qwen3_vl``):
    ``int(frames / fps * cfg.fps)`` clamped the same way, not rounded (0 below
    temporal_patch_size, which its resize refuses).
    """
    tps = cfg.temporal_patch_size
    if cfg.sampling == "qwen3_vl":
        count = min(max(int(frames / fps * cfg.fps), cfg.min_frames), cfg.max_frames, frames)
        return count if count >= tps else 0
    max_frames = math.floor(min(cfg.max_frames, frames) / tps) * tps
    wanted = min(max(frames / fps * cfg.fps, cfg.min_frames), max_frames, frames)
    return math.floor(wanted / tps) * tps


def sample_indices(frames: int, fps: float, cfg: VideoConfig) -> list[int]:
    """Indices of the ``sampled_frame_count`` frames the video processor samples from a clip
    of ``frames`` frames at ``fps`` (ValueError if too short).

    ``Qwen2VLVideoProcessor`` takes ``torch.arange(0, frames, frames / n).int()``; so does
    this, for the same values: torch computes them in float32, which for clips of more than
    2^13 frames can give one frame off the exact ``i * frames // n``. Its length, computed in
    double precision as ``ceil(frames / (frames / n))``, is ``n + 1`` for some pairs (e.g. 17
    frames, n = 14; 506 frames at 10 fps): the extra index is then ``frames`` itself, past the
    clip, and the processor fails indexing the clip with it. It is dropped here: always n
    frames. ``Qwen3VLVideoProcessor`` takes ``np.linspace(0, frames - 1, n).round()``.
    """
    count = sampled_frame_count(frames, fps, cfg)
    if count == 0:
        raise ValueError(f"a clip of {frames} frames is shorter than temporal_patch_size = "
                         f"{cfg.temporal_patch_size} frames")
    if cfg.sampling == "qwen3_vl":
        return np.linspace(0, frames - 1, count).round().astype(int).tolist()
    return torch.arange(0, frames, frames / count).int().tolist()[:count]


def patch_timestamps(frames: int, fps: float, cfg: VideoConfig) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last sampled frame's time
    (the last frame repeated up to a multiple of temporal_patch_size), as
    ``Qwen3VLProcessor._calculate_timestamps``."""
    indices = sample_indices(frames, fps, cfg)
    tps = cfg.temporal_patch_size
    indices += indices[-1:] * (-len(indices) % tps)
    times = [index / fps for index in indices]
    return [(times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps)]


@functools.lru_cache(maxsize=1024)     # entries of up to max_frames / 2 strings each
def timestamp_texts(frames: int, fps: float, config: VideoConfig) -> tuple[str, ...]:
    """``<{t:.1f} seconds>`` per temporal patch (``patch_timestamps``), as Qwen3VLProcessor
    writes them before each patch's tokens; () without ``timestamps``."""
    if not config.timestamps:
        return ()
    return tuple(f"<{t:.1f} seconds>" for t in patch_timestamps(frames, fps, config))


def video_resized_size(width: int, height: int, sampled: int, cfg: VideoConfig
                       ) -> tuple[int, int]:
    """``(width, height)`` each of ``sampled`` frames of a ``width`` x ``height`` clip (after
    rotation) is resized to, as the processor's ``resize``."""
    factor = cfg.patch_size * cfg.merge_size
    if min(width, height) <= 0:
        raise ValueError(f"video of {width}x{height} pixels has no area")
    if cfg.sampling == "qwen3_vl":         # its smart_resize bounds the whole clip's pixels
        max_pixels = cfg.max_pixels
        if cfg.cap_pixels_per_frame:
            per_frame = max(min(cfg.max_video_tokens * factor * factor,
                                cfg.max_pixels // sampled), int(cfg.min_pixels * 1.05))
            max_pixels = per_frame * sampled
        height, width = smart_resize_clip(sampled, height, width,
                                          temporal_factor=cfg.temporal_patch_size,
                                          factor=factor, min_pixels=cfg.min_pixels,
                                          max_pixels=max_pixels)
        return width, height
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ValueError(f"video of {width}x{height} pixels has an aspect ratio above "
                         f"{MAX_ASPECT_RATIO}:1, which the dynamic resize (smart_resize) refuses")
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        total_pixels = int(cfg.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * cfg.temporal_patch_size // sampled),
                         int(cfg.min_pixels * 1.05))
    height, width = smart_resize(height, width, factor=factor, min_pixels=cfg.min_pixels,
                                 max_pixels=max_pixels)
    return width, height


def video_grid_thw(frames: int, fps: float, width: int, height: int, cfg: VideoConfig
                   ) -> tuple[int, int, int]:
    """The processor's ``video_grid_thw`` row (temporal patches, patch rows, patch columns)."""
    sampled = sampled_frame_count(frames, fps, cfg)
    if sampled == 0:
        raise ValueError(f"a clip of {frames} frames is shorter than temporal_patch_size = "
                         f"{cfg.temporal_patch_size} frames")
    resized_width, resized_height = video_resized_size(width, height, sampled, cfg)
    return (-(-sampled // cfg.temporal_patch_size), resized_height // cfg.patch_size,
            resized_width // cfg.patch_size)


def video_token_grid(frames: int, fps: float, width: int, height: int, cfg: VideoConfig
                     ) -> tuple[int, int, int]:
    """``(t, rows, columns)`` of the tokens the encoder emits (after the spatial merge)."""
    t, h, w = video_grid_thw(frames, fps, width, height, cfg)
    return t, h // cfg.merge_size, w // cfg.merge_size


def video_tokens(frames: int, fps: float, width: int, height: int, cfg: VideoConfig) -> int:
    t, rows, columns = video_token_grid(frames, fps, width, height, cfg)
    return t * rows * columns


def video_time_interval(frames: int, fps: float, cfg: VideoConfig) -> float:
    """The M-RoPE time step between temporal patches: 1, or with ``tokens_per_second``
    (Qwen2.5-VL) that many per second of the seconds a temporal patch spans at the sampled
    frame rate (the processor's ``second_per_grid_ts``: ``temporal_patch_size`` over
    ``sampled / frames * fps``), in float32 as transformers multiplies them."""
    if cfg.tokens_per_second is None:
        return 1.0
    second_per_grid = np.float32(seconds_per_grid(frames, fps, cfg))
    return float(np.float32(cfg.tokens_per_second) * second_per_grid)


def seconds_per_grid(frames: int, fps: float, cfg: VideoConfig) -> float:
    """Seconds of the clip one temporal patch spans at the sampled frame rate (Qwen2.5-VL's
    ``second_per_grid_ts``)."""
    return cfg.temporal_patch_size / (sampled_frame_count(frames, fps, cfg) / frames * fps)


@functools.lru_cache(maxsize=_MAX_MEMO)
def _grid_or_error(frames: int, fps: float, width: int, height: int, config: VideoConfig
                   ) -> tuple[int, int, int] | ValueError:
    try:
        return video_token_grid(frames, fps, width, height, config)
    except ValueError as exc:
        return exc


# --- decoding ----------------------------------------------------------------------------

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
        raise MediaError("corrupt_video", f"FFmpeg cannot decode the video: {exc}") from None
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


# --- encoder inputs ----------------------------------------------------------------------

def resize_frames(frames: np.ndarray, width: int, height: int) -> torch.Tensor:
    """uint8 ``[T, H, W, 3]`` → uint8 ``[T, 3, height, width]``: what torchvision's
    ``resize`` does for the processor (bicubic, antialias, ``align_corners=False``, uint8
    natively on the CPU), a no-op at the same size."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    if video.shape[-2:] == (height, width):
        return video
    return torch.nn.functional.interpolate(video, size=[height, width], mode="bicubic",
                                           align_corners=False, antialias=True)


def patchify_video(video: torch.Tensor, cfg: VideoConfig) -> torch.Tensor:
    """uint8 ``[T, C, H, W]`` → ``[t * h * w, C * tps * P * P]``: the processor's ``patchify``
    (the last frame repeated up to a multiple of temporal_patch_size), on uint8."""
    frames, channels, height, width = video.shape
    tps, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -frames % tps:
        video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
        frames += pad
    t, h, w = frames // tps, height // p, width // p
    patches = video.reshape(t, tps, channels, h // m, m, p, w // m, m, p)
    return patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, channels * tps * p * p)


def video_encoder_inputs(videos: list[np.ndarray], cfg: VideoConfig) -> dict[str, torch.Tensor]:
    """``{"pixel_values_videos": uint8 [Σ patches, C*T*P*P], "video_grid_thw": int64 [n, 3]}``
    for decoded clips (``decode_video``'s sampled frames), clip by clip."""
    rows, grids = [], []
    for frames in videos:
        sampled, height, width = frames.shape[:3]
        resized_width, resized_height = video_resized_size(width, height, sampled, cfg)
        patches = patchify_video(resize_frames(frames, resized_width, resized_height), cfg)
        rows.append(patches)
        grids.append((-(-sampled // cfg.temporal_patch_size), resized_height // cfg.patch_size,
                      resized_width // cfg.patch_size))
    columns = 3 * cfg.temporal_patch_size * cfg.patch_size ** 2
    pixels = (rows[0] if len(rows) == 1 else torch.cat(rows) if rows
              else torch.empty(0, columns, dtype=torch.uint8))
    return {"pixel_values_videos": pixels,
            "video_grid_thw": torch.from_numpy(np.array(grids, np.int64).reshape(-1, 3))}


def video_rows_to_tokens(inputs: dict[str, torch.Tensor], cfg: VideoConfig) -> list[int]:
    return [int(t * h * w) // cfg.merge_size ** 2 for t, h, w in inputs["video_grid_thw"].tolist()]


def normalize_video_pixels(pixel_values: torch.Tensor, cfg: VideoConfig) -> torch.Tensor:
    """uint8 ``[rows, C*T*P*P]`` → float32, on their device: exactly the processor's
    ``pixel_values_videos``, whose torchvision backend fuses rescale and normalize as
    ``(x - mean / (1/255)) / (std / (1/255))`` in float32."""
    channels = len(cfg.mean)
    rescale = 1 / 255
    mean = torch.tensor(cfg.mean, device=pixel_values.device) * (1.0 / rescale)
    std = torch.tensor(cfg.std, device=pixel_values.device) * (1.0 / rescale)
    rows = len(pixel_values)
    values = pixel_values.reshape(rows, channels, -1).to(torch.float32)   # a new tensor:
    values.sub_(mean.view(1, channels, 1)).div_(std.view(1, channels, 1))  # in place on it
    return values.reshape(rows, -1)


# --- the modality ------------------------------------------------------------------------

class VideoModality(Modality):
    name = "video"
    marker = "<video>"
    member_prefix = "vid"
    extensions = VIDEO_EXTENSIONS
    config_class = VideoConfig
    item_fields = ("member", "width", "height", "rotation", "fps", "frames", "duration")
    verified_fields = ("format", "codec", "width", "height", "rotation", "fps", "frames")
    summary_fields = {"width": "int32", "height": "int32", "duration": "float64"}
    ansi_color = "\033[1;33m"
    html_color = "#bf8700"

    def probe(self, data: bytes, check: str, max_image_pixels: int) -> dict[str, Any]:
        return probe_video(data, check)

    def decoded_metadata(self, data: bytes) -> dict[str, Any]:
        return probe_video(data, "decode", max_seconds=math.inf)

    def tokens(self, item: Mapping[str, Any], config: VideoConfig) -> int:
        return video_tokens(item["frames"], item["fps"], item["width"], item["height"], config)

    def item_tokens(self, item: MediaItem, config: VideoConfig) -> int:
        if item["duration"] > config.max_duration:
            raise MediaError("video_too_long", f"{item['member']} lasts {item['duration']} s, "
                             f"above max_duration {config.max_duration} s")
        grid = _grid_or_error(item["frames"], item["fps"], item["width"], item["height"],
                              config)
        if isinstance(grid, ValueError):
            reason = "video_too_short" if "shorter" in str(grid) else "bad_video_shape"
            raise MediaError(reason, f"{item['member']}: {grid}")
        return grid[0] * grid[1] * grid[2]

    def token_grid(self, item: Mapping[str, Any], config: VideoConfig) -> tuple[int, int, int]:
        grid = _grid_or_error(item["frames"], item["fps"], item["width"], item["height"],
                              config)
        if isinstance(grid, ValueError):
            raise grid
        return grid

    def time_interval(self, item: Mapping[str, Any], config: VideoConfig) -> float:
        return video_time_interval(item["frames"], item["fps"], config)

    def variable_tokens(self, config: VideoConfig) -> bool:
        return True

    def frame_times(self, item: Mapping[str, Any], config: VideoConfig) -> list[float]:
        """``sample_indices`` over the average frame rate: frame i is shown at i / fps."""
        return [index / item["fps"] for index in
                sample_indices(item["frames"], item["fps"], config)]

    def placeholder_texts(self, item: Mapping[str, Any], config: VideoConfig
                          ) -> tuple[str, ...]:
        return timestamp_texts(item["frames"], item["fps"], config)

    def decode(self, data: bytes, item: MediaItem, config: VideoConfig) -> np.ndarray:
        return decode_video(data, item, config)

    def encoder_inputs(self, decoded: list, config: VideoConfig) -> dict[str, torch.Tensor]:
        return video_encoder_inputs(decoded, config)

    def rows_to_tokens(self, inputs: dict[str, torch.Tensor], config: VideoConfig) -> list[int]:
        return video_rows_to_tokens(inputs, config)

    def describe(self, item: Mapping[str, Any]) -> str:
        return (f"{item.get('width')}x{item.get('height')} {item.get('codec', '')} "
                f"{item.get('fps', 0):.3g} fps {item.get('duration', 0):.2f} s").replace("  ", " ")

    def preview_png(self, data: bytes, item: Mapping[str, Any], config: VideoConfig
                    ) -> tuple[bytes, str]:
        frames = item["frames"]
        indices = sorted({round(i * (frames - 1) / max(1, PREVIEW_FRAMES - 1))
                          for i in range(min(PREVIEW_FRAMES, frames))})
        pictures = [Image.fromarray(frame) for frame in
                    decode_frames(data, indices, item.get("rotation", 0))]
        problem = ""
        size = (pictures[0].width, pictures[0].height)
        if size != (item.get("width"), item.get("height")):
            problem = (f"decodes to {size[0]}x{size[1]}, the metadata says "
                       f"{item.get('width')}x{item.get('height')}")
        for picture in pictures:
            picture.thumbnail(THUMBNAIL)
        strip = Image.new("RGB", (sum(p.width for p in pictures) + 4 * (len(pictures) - 1),
                                  max(p.height for p in pictures)), (255, 255, 255))
        left = 0
        for picture in pictures:
            strip.paste(picture, (left, 0))
            left += picture.width + 4
        buffer = io.BytesIO()
        strip.save(buffer, format="PNG")
        return buffer.getvalue(), problem


VIDEO = VideoModality()
