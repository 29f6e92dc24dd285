"""Write the corpus's short video clips, made with PyAV from real photos, and their catalog.

Each clip is a pan across, or a zoom into, a scikit-image or matplotlib photo: h264 and mpeg4
in mp4, vp9 in webm and one ffv1 in Matroska (a codec mimo refuses), at 10, 24 and 30 fps,
two sizes, at most 3 s and 160 px. One carries a 90 degree display rotation, one an AAC audio
track, one is a single frame, and one is cut short (an mp4 with its index first, its last third
removed). ``videos/catalog.json`` lists what was written: the facts the tests check mimo's
probe against, never values read back with the code under test.

    python tools/make_video_clips.py --out assets/corpus
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import av
import matplotlib.cbook
import numpy as np
import skimage.data
from PIL import Image

CATALOG = "videos/catalog.json"
AUDIO_RATE = 16000
# PyAV encoder name -> FFmpeg's canonical codec name (what a probe reports).
CODEC_NAMES = {"libx264": "h264", "mpeg4": "mpeg4", "libvpx-vp9": "vp9", "ffv1": "ffv1"}
# The same bytes on every machine and every run (the clips feed the video demo's losses), so:
# one encoder thread (FFmpeg's default is one per core, and mpeg4's slices, hence its bytes,
# follow the core count), and a constant quantizer for libx264 (its default rate control, CRF
# with macroblock-tree lookahead, gave different bytes from run to run for the zoom clips).
ENCODER_OPTIONS = {"libx264": {"qp": "23"}}
# PyAV muxer name -> file extension and our container format name.
CONTAINERS = {"mp4": ("mp4", "mp4"), "webm": ("webm", "webm"), "matroska": ("mkv", "mkv")}


@dataclass(frozen=True)
class Spec:
    """How to make one clip."""
    name: str
    photo: str          # skimage.data function name, or "grace_hopper" (matplotlib)
    motion: str         # "pan" | "zoom"
    muxer: str          # key of CONTAINERS
    encoder: str        # key of CODEC_NAMES
    fps: int
    seconds: float
    width: int          # as encoded (before the display rotation)
    height: int
    rotation: int = 0   # counter-clockwise display rotation, degrees
    audio: bool = False
    gop: int | None = None
    truncated: bool = False   # written with the index first, then its last third cut off


@dataclass(frozen=True)
class CatalogEntry:
    """One written clip, as written (``width``/``height`` as displayed, after rotation)."""
    name: str
    path: str           # relative to the corpus directory
    photo: str
    motion: str
    format: str
    codec: str
    fps: int
    frames: int         # frames encoded (before any truncation)
    width: int
    height: int
    rotation: int
    has_audio: bool
    truncated: bool
    bytes: int


SPECS = (
    Spec("pan_h264_24", "astronaut", "pan", "mp4", "libx264", 24, 2.5, 128, 96, gop=10),
    Spec("zoom_mpeg4_10", "chelsea", "zoom", "mp4", "mpeg4", 10, 3, 96, 64),
    Spec("pan_vp9_30", "coffee", "pan", "webm", "libvpx-vp9", 30, 2, 128, 96),
    Spec("rotated_h264_24", "astronaut", "pan", "mp4", "libx264", 24, 2.5, 128, 96, gop=10,
         rotation=90),
    Spec("audio_h264_30", "coffee", "zoom", "mp4", "libx264", 30, 2, 96, 64, audio=True),
    Spec("zoom_h264_10", "grace_hopper", "zoom", "mp4", "libx264", 10, 2, 160, 120),
    Spec("still_h264_10", "rocket", "pan", "mp4", "libx264", 10, 0.1, 64, 48),
    Spec("pan_ffv1_10", "camera", "pan", "matroska", "ffv1", 10, 1, 64, 48),
    Spec("truncated_h264_24", "astronaut", "pan", "mp4", "libx264", 24, 2, 128, 96,
         truncated=True),
)


def photo(name: str) -> np.ndarray:
    """An RGB uint8 photo: ``skimage.data.<name>()`` or matplotlib's ``grace_hopper.jpg``."""
    if name == "grace_hopper":
        path = matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
        with Image.open(path) as image:
            return np.asarray(image.convert("RGB"))
    return np.asarray(Image.fromarray(getattr(skimage.data, name)()).convert("RGB"))


def frames(motion: str, picture: np.ndarray, count: int, width: int, height: int
           ) -> Iterator[np.ndarray]:
    """A pan across ``picture`` or a zoom into it: ``count`` RGB frames of ``width`` x
    ``height``."""
    source = Image.fromarray(picture)
    rows, columns = picture.shape[:2]
    for i in range(count):
        if motion == "pan":
            x = int(i * (columns - width * 2) / count)
            y = max(0, min(60, rows - height * 2))
            box = (x, y, x + width * 2, y + height * 2)
        else:                                   # zoom: a shrinking centred box
            scale = 1 - 0.6 * i / count
            w, h = columns * scale, rows * scale
            box = (int((columns - w) / 2), int((rows - h) / 2), int((columns + w) / 2),
                   int((rows + h) / 2))
        yield np.asarray(source.crop(box).resize((width, height), Image.Resampling.BILINEAR))


def encode(spec: Spec, target: io.BytesIO | str) -> int:
    """Write the clip of ``spec`` to ``target`` (a file path for ``faststart``, which rewrites
    the file to put the mp4 index first); return the frame count."""
    count = max(1, round(spec.fps * spec.seconds))
    options = {"fflags": "+bitexact"} | ({"movflags": "faststart"} if spec.truncated else {})
    with av.open(target, "w", format=spec.muxer, options=options) as container:
        stream = container.add_stream(spec.encoder, rate=spec.fps,
                                      options=ENCODER_OPTIONS.get(spec.encoder, {}))
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height = spec.width, spec.height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1   # see ENCODER_OPTIONS
        if spec.gop:
            stream.codec_context.gop_size = spec.gop
        if spec.rotation:
            stream.set_display_rotation(spec.rotation)
        sound = (container.add_stream("aac", rate=AUDIO_RATE, layout="mono") if spec.audio
                 else None)
        for picture in frames(spec.motion, photo(spec.photo), count, spec.width, spec.height):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
        if sound is not None:
            tone = (np.sin(np.arange(int(AUDIO_RATE * spec.seconds)) / 10) * 0.3)
            chunk = av.AudioFrame.from_ndarray(tone.astype(np.float32)[None], format="fltp",
                                               layout="mono")
            chunk.sample_rate = AUDIO_RATE
            container.mux(sound.encode(chunk))
            container.mux(sound.encode())
    return count


def clip_bytes(spec: Spec) -> tuple[bytes, int]:
    """The file bytes of ``spec``'s clip (cut to two thirds when truncated) and its frame
    count."""
    if spec.truncated:
        with tempfile.TemporaryDirectory() as folder:
            path = f"{folder}/clip.mp4"
            count = encode(spec, path)
            data = Path(path).read_bytes()
        return data[:len(data) * 2 // 3], count
    buffer = io.BytesIO()
    count = encode(spec, buffer)
    return buffer.getvalue(), count


def write_videos(out: Path) -> list[CatalogEntry]:
    """Write every clip into ``out/videos`` and the catalog last; skip all of it when the
    catalog is already there. Return the catalog."""
    catalog = out / CATALOG
    if catalog.exists():
        return read_catalog(out)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    entries = []
    for spec in SPECS:
        data, count = clip_bytes(spec)
        extension, fmt = CONTAINERS[spec.muxer]
        path = f"videos/{spec.name}.{extension}"
        (out / path).write_bytes(data)
        shown = ((spec.height, spec.width) if spec.rotation in (90, 270)
                 else (spec.width, spec.height))
        entries.append(CatalogEntry(spec.name, path, spec.photo, spec.motion, fmt,
                                    CODEC_NAMES[spec.encoder], spec.fps, count, *shown,
                                    spec.rotation, spec.audio, spec.truncated, len(data)))
    catalog.write_text(json.dumps([asdict(e) for e in entries], indent=1) + "\n")
    return entries


def read_catalog(out: Path) -> list[CatalogEntry]:
    """The catalog ``write_videos`` wrote under ``out``."""
    return [CatalogEntry(**entry) for entry in json.loads((out / CATALOG).read_text())]


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/corpus"), help="corpus directory")
    out = parser.parse_args(argv).out
    print(f"videos: {len(write_videos(out))} clips -> {out / 'videos'}")


if __name__ == "__main__":
    main()
