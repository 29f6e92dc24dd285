"""A video given as a folder of its frames, or as a list of its frame files, made one clip.

LLaVA-Hound's videos (ShareGPTVideo, in LLaVA-Video-178K too) and TVQA's come as folders of
JPEG frames taken at a known rate (2 and 3 a second), which LLaVA-NeXT's trainer reads in name
order. The build stores them as one Motion-JPEG clip in Matroska: each frame's JPEG bytes as
they are, one a ``1 / fps`` of a second, so the clip decodes to the same pixels and the rest
of the pipeline (probe, sampling by time, tokens) reads it as any clip. PyAV muxes the frames
as packets; nothing is encoded again. A list of frame files (qwen-vl-utils' and LLaMA-Factory's
form of a video) is stored the same way, in the list's order.
"""

from __future__ import annotations

import io
import os
import re
from fractions import Fraction

import av
from PIL import Image

from mimo_data.errors import listed
from mimo_data.modalities.base import MediaError
from mimo_data.modalities.video.config import MAX_VIDEO_SECONDS

# a folder's frames: the JPEG files in it
FRAME_EXTENSIONS = (".jpg", ".jpeg")
# the rates a clip of frames may have: its time base is 1/fps, kept to a denominator FFmpeg's
# Matroska muxer keeps (29.97 is 30000/1001)
MIN_FPS, MAX_FPS = 0.01, 1000.0
_NUMBER = re.compile(r"(\d+)")


def frame_order(name: str) -> list:
    """The sort key of a frame's file name: its numbers by value (``2.jpg`` before
    ``10.jpg``); zero-padded names (LLaVA-Hound's) sort as LLaVA-NeXT's plain sort does."""
    return [int(part) if part.isdigit() else part for part in _NUMBER.split(name)]


def frames_clip(folder: str, fps: float) -> bytes:
    """The Matroska clip of ``folder``'s JPEG frames shown ``fps`` a second, in the order of
    their names (``frame_order``); MediaError as ``frames_list_clip``'s, and for a folder of
    other files."""
    names = sorted((name for name in os.listdir(folder)
                    if os.path.isfile(os.path.join(folder, name)) and not name.startswith(".")),
                   key=frame_order)
    others = [name for name in names if not name.lower().endswith(FRAME_EXTENSIONS)]
    if others:
        raise MediaError("unsupported_format", f"the frames folder holds {others[:3]}, not "
                         "JPEG frames: give a folder of .jpg frames, or encode the clip first")
    if not names:
        raise MediaError("missing_media", "the frames folder holds no frame")
    gap = _numbering_gap(names)
    if gap:
        raise MediaError("missing_media", f"the frames folder skips a number: {gap[0]} then "
                         f"{gap[1]}, where its frames step by {gap[2]} (a frame missing: "
                         "every frame after it would be shown early); put the frame back, or, "
                         "where the frames were taken so (kept unevenly from a longer clip), "
                         "name them 1 to N in their order")
    return frames_list_clip([os.path.join(folder, name) for name in names], fps)


def _numbering_gap(names: list[str]) -> tuple[str, str, int] | None:
    """Two adjacent frames (in ``frame_order``) whose names' numbers step by a multiple of the
    folder's smallest step, with the step, where at most one step in ten does (a frame lost
    from frames taken evenly); None where there is none, where more steps do (frames kept
    unevenly from a longer clip, numbered by its frames), or where the names differ otherwise
    than in their last number (no evidence)."""
    split = [_NUMBER.split(name) for name in names]
    if len(names) < 3 or any(len(parts) < 3 for parts in split) or \
            len({(*parts[:-2], parts[-1]) for parts in split}) > 1:
        return None
    numbers = [int(parts[-2]) for parts in split]
    steps = [after - before for before, after in zip(numbers, numbers[1:])]
    least = min(steps)
    if least <= 0:
        return None
    odd = [k for k, step in enumerate(steps) if step != least]
    if not odd or len(odd) > max(1, len(steps) // 10) or \
            any(steps[k] % least for k in odd):
        return None
    return names[odd[0]], names[odd[0] + 1], least


def frames_list_clip(paths: list[str], fps: float) -> bytes:
    """The Matroska clip of the JPEG frames ``paths``, in that order, shown ``fps`` a second,
    the same bytes for the same frames (MediaError, with its report reason, for frames of
    other formats or sizes, or longer than ``MAX_VIDEO_SECONDS``)."""
    if not MIN_FPS <= fps <= MAX_FPS:
        raise ValueError(f"a frames folder's rate is {MIN_FPS} to {MAX_FPS} a second, not {fps}")
    if len(paths) / fps > MAX_VIDEO_SECONDS:
        raise MediaError("video_too_long", f"{len(paths)} frames at {fps:g} a second are "
                         f"longer than {MAX_VIDEO_SECONDS:.0f} s")
    sizes = set()
    for path in paths:                  # headers first: no frame muxed before all are read
        try:
            with Image.open(path) as image:
                if image.format != "JPEG":
                    raise MediaError("unsupported_format", f"frame {path} is "
                                     f"{image.format}, not JPEG")
                sizes.add(image.size)
        except (FileNotFoundError, IsADirectoryError):
            raise MediaError("missing_media", f"frame {path} is not a file") from None
        except (OSError, ValueError) as exc:          # PIL's UnidentifiedImageError too
            raise MediaError("corrupt_video", f"frame {path}: {exc}") from None
    if len(sizes) > 1:
        raise MediaError("corrupt_video", "the frames differ in size ("
                         f"{listed(f'{w}x{h}' for w, h in sorted(sizes)[:3])}): a "
                         "clip's frames have one")
    (width, height), = sizes
    rate = Fraction(fps).limit_denominator(1001)
    out = io.BytesIO()
    # bitexact: no random segment id nor library version in the file, so that the same frames
    # give the same clip (the build's byte-identical shards)
    with av.open(out, "w", format="matroska", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("mjpeg", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuvj420p"
        stream.time_base = 1 / rate
        for number, path in enumerate(paths):
            with open(path, "rb") as frame:
                packet = av.Packet(frame.read())
            packet.stream, packet.time_base = stream, 1 / rate
            packet.pts = packet.dts = number
            packet.duration, packet.is_keyframe = 1, True
            container.mux(packet)
    return out.getvalue()
