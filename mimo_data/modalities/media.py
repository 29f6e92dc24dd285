"""Probe and validate encoded media bytes: the metadata the shard JSON records for each item.

Images are opened with Pillow and audio with soundfile; nothing is re-encoded. By default
validation walks the whole payload (truncated or corrupt files are caught at build time, not at
training step 50k) as cheaply as each format allows: PNG chunk CRCs via ``Image.verify``, JPEG
entropy data via a reduced-scale ``draft`` decode, a full decode for other formats, a block-wise
read for audio.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import soundfile
from PIL import Image

from mimo_data.tally import CountedError
from mimo_data.shards.format import AUDIO_EXTENSIONS, IMAGE_EXTENSIONS

# EXIF orientations 5-8 rotate by 90 degrees: the decoded image has width and height swapped.
_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}

DEFAULT_MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


@contextlib.contextmanager
def pixel_limit(max_pixels: int | None):
    """Pillow's decompression-bomb limit set to ``max_pixels`` (None: off) for the block.

    Pillow reads a process-wide global: left at its default it warns above 89 Mpx and refuses
    twice that, whatever limit the caller allows. Callers check ``max_pixels`` themselves (with
    a message that says what to raise), so Pillow's warning is silenced; above twice the limit
    Pillow still refuses to decode. The global is restored afterwards.
    """
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


class MediaError(CountedError):
    """A media item that cannot go into a shard; ``reason`` is the report category."""


def image_orientation(image: Image.Image) -> int:
    """EXIF orientation (1-8) from the header Pillow read at ``open``; 1 when absent.

    For PNG, ``getexif()`` would decode the whole image to find an eXIf chunk placed after the
    pixel data; we read only what precedes it. The shard JSON stores this value and the
    preprocessor transposes by it, so metadata and decoded pixels agree by construction.
    """
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    return int(image.getexif().get(_EXIF_ORIENTATION, 1))


@contextlib.contextmanager
def pillow_decoding(max_pixels: int | None):
    """``pixel_limit(max_pixels)``, with what Pillow raises inside as MediaError: a
    decompression bomb is ``image_too_large``, anything else ``corrupt_image``."""
    try:
        with pixel_limit(max_pixels):
            yield
    except MediaError:
        raise
    except Image.DecompressionBombError as exc:
        raise MediaError("image_too_large", str(exc)) from None
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError...)
        raise MediaError("corrupt_image", f"cannot decode image: {exc}") from None


def probe_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                check: str = "decode") -> dict:
    """Validate an encoded image; return ``{format, width, height, mode, orientation}``.

    Width/height are after EXIF orientation is applied, ``mode`` is Pillow's decoded mode.
    ``check="decode"`` walks all image data; ``"header"`` only parses headers and checks that
    the stream is complete (JPEG end marker; PNG chunk CRCs).
    Raises MediaError(``corrupt_image`` | ``image_too_large`` | ``unsupported_format``).
    """
    if not data:
        raise MediaError("corrupt_image", "empty image file (0 bytes)")
    with pillow_decoding(max_pixels):
        image = Image.open(io.BytesIO(data))
        fmt = (image.format or "").lower()
        width, height = image.size
        if width * height > max_pixels:
            raise MediaError("image_too_large", f"{width}x{height} = {width * height} pixels "
                             f"is above the limit of {max_pixels} (raise "
                             "--max-image-pixels to keep it)")
        if fmt not in IMAGE_EXTENSIONS:
            raise MediaError("unsupported_format", f"image format {fmt or 'unknown'!r} is "
                             f"not one of {sorted(IMAGE_EXTENSIONS)}; convert it first")
        mode = image.mode
        orientation = image_orientation(image)
        if orientation in _TRANSPOSING_ORIENTATIONS:
            width, height = height, width
        if fmt == "png":            # every chunk's CRC without inflating pixels; verify()
            Image.open(io.BytesIO(data)).verify()   # must come right after open()
        elif fmt == "jpeg" and check == "header":
            if data.rstrip(b"\0")[-2:] != b"\xff\xd9":
                raise MediaError("corrupt_image",
                                 "JPEG has no end-of-image marker (truncated)")
        elif fmt == "jpeg":         # entropy-decode everything, at 1/8 scale
            image.draft(image.mode, (max(1, width // 8), max(1, height // 8)))
            image.load()
        elif check == "decode":
            image.load()
    return {"format": fmt, "width": width, "height": height, "mode": mode,
            "orientation": orientation}


def probe_audio(data: bytes, check: str = "decode") -> dict:
    """Validate encoded audio; return ``{format, sample_rate, channels, frames, duration}``.

    With ``check="decode"`` ``frames`` counts what actually decodes (a truncated file reports
    fewer frames than its header); ``"header"`` takes the header's count.
    Raises MediaError(``corrupt_audio`` | ``empty_audio`` | ``unsupported_format``).
    """
    if not data:
        raise MediaError("empty_audio", "empty audio file (0 bytes)")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            fmt = sound.format.lower()
            sample_rate, channels = sound.samplerate, sound.channels
            frames = (sound.frames if check == "header" else
                      sum(len(block) for block in sound.blocks(blocksize=1 << 16)))
    except Exception as exc:  # libsndfile errors come as soundfile.LibsndfileError / RuntimeError
        raise MediaError("corrupt_audio", f"soundfile cannot decode the audio: {exc}") from None
    if fmt not in AUDIO_EXTENSIONS:
        raise MediaError("unsupported_format", f"audio format {fmt!r} is not one of "
                         f"{sorted(AUDIO_EXTENSIONS)}; convert it first")
    if frames == 0:
        raise MediaError("empty_audio", "audio decodes to 0 frames")
    return {"format": fmt, "sample_rate": sample_rate, "channels": channels, "frames": frames,
            "duration": round(frames / sample_rate, 6)}
