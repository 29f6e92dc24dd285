"""A video given as a folder of its frames, made one clip.

LLaVA-Hound's videos (ShareGPTVideo, in LLaVA-Video-178K too) and TVQA's come as folders of
JPEG frames taken at a known rate (2 and 3 a second), which LLaVA-NeXT's trainer reads by
name order. The build stores them as one Motion-JPEG clip in Matroska: each frame's JPEG
bytes as they are, one a ``1 / fps`` of a second, so the clip decodes to the same pixels and
the rest of the pipeline (probe, sampling by time, tokens) reads it as any clip. PyAV muxes
the frames as packets; nothing is encoded again.
"""

from __future__ import annotations

import io
import os
from fractions import Fraction

import av
from PIL import Image

from mimo_data.modalities.base import MediaError

# a folder's frames: the JPEG files in it, by name (as LLaVA-NeXT sorts them)
FRAME_EXTENSIONS = (".jpg", ".jpeg")


def frames_clip(folder: str, fps: float) -> bytes:
    """The Matroska clip of ``folder``'s JPEG frames shown ``fps`` a second (MediaError,
    with its report reason, for a folder without frames, frames of other formats or sizes)."""
    names = sorted(name for name in os.listdir(folder)
                   if os.path.isfile(os.path.join(folder, name)) and not name.startswith("."))
    others = [name for name in names if not name.lower().endswith(FRAME_EXTENSIONS)]
    if others:
        raise MediaError("unsupported_format", f"the frames folder holds {others[:3]}, not "
                         "JPEG frames: give a folder of .jpg frames, or encode the clip first")
    if not names:
        raise MediaError("missing_media", "the frames folder holds no frame")
    frames = []
    for name in names:
        with open(os.path.join(folder, name), "rb") as frame:
            frames.append(frame.read())
    sizes = set()
    for name, data in zip(names, frames):
        try:
            with Image.open(io.BytesIO(data)) as image:
                if image.format != "JPEG":
                    raise MediaError("unsupported_format", f"frame {name} is "
                                     f"{image.format}, not JPEG")
                sizes.add(image.size)
        except (OSError, ValueError) as exc:          # PIL's UnidentifiedImageError too
            raise MediaError("corrupt_video", f"frame {name}: {exc}") from None
    if len(sizes) > 1:
        raise MediaError("corrupt_video", f"the frames differ in size {sorted(sizes)[:3]}: a "
                         "clip's frames have one")
    (width, height), = sizes
    rate = Fraction(fps).limit_denominator(1001)
    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as container:
        stream = container.add_stream("mjpeg", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuvj420p"
        stream.time_base = 1 / rate
        for number, data in enumerate(frames):
            packet = av.Packet(data)
            packet.stream, packet.time_base = stream, 1 / rate
            packet.pts = packet.dts = number
            packet.duration, packet.is_keyframe = 1, True
            container.mux(packet)
    return out.getvalue()
