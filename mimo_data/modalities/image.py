"""The image modality: probing at build time, token counts, decoding, encoder inputs, views.

Probing (``probe_image``) records what the decoder will produce (size after EXIF orientation,
mode). Token counts are pure functions of that metadata and the config, so language ranks expand
``<image>`` markers without decoding. The encoder inputs follow transformers'
``Qwen2VLImageProcessorPil`` (dynamic policy) and ``SiglipImageProcessorPil`` (fixed policy):
both resize a uint8 image with Pillow, then rescale, normalize and patchify in float32 on the
CPU, which is most of their time. Here the same Pillow resize is followed by a copy-only
patchify of the uint8 pixels, and ``normalize_pixels`` does the float step on the encoder's
device (a quarter of the bytes to move). A still image's patches are stored once,
``[Σ patches, C·P·P]``: the reference repeats the frame ``temporal_patch_size`` times in its
``C·T·P·P`` columns, and ``normalize_pixels`` does that repeat on the device (half the bytes
again). The tests check ``normalize_pixels(image_encoder_inputs(...))`` against the reference
processors' output.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING

import numpy as np
import pyarrow
from PIL import Image

from mimo_data.errors import ConfigError, listed
from mimo_data.modalities.base import (MediaError, MediaItem, Modality, item_name,
                                       require_positive, take_grid_rows, to_device)

if TYPE_CHECKING:     # torch is imported where used: metadata commands start without it
    import torch


# Extension used for the tar member of each container format we keep byte-for-byte.
IMAGE_EXTENSIONS = {"jpeg": "jpg", "png": "png", "webp": "webp", "gif": "gif", "bmp": "bmp",
                    "tiff": "tiff"}
THUMBNAIL = (192, 192)
_MAX_MEMO = 1 << 16  # image sizes whose token counts are remembered


# OpenAI CLIP normalization, the default of Qwen2-VL and CLIP image processors.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageConfig:
    """Image decoding and the encoder's input layout.

    ``dynamic`` (Qwen2-VL): resize so both sides are multiples of ``patch_size * merge_size``
    within [min_pixels, max_pixels]; ``(h/(patch*merge)) * (w/(patch*merge))`` tokens.
    ``fixed`` (CLIP/SigLIP): resize to ``image_size`` square (squashed as SigLIP's processor
    does, or with ``crop`` the short side to ``image_size`` then the centre square, as CLIP's;
    with ``pad``, padded to a square of the ``mean`` colour first, as LLaVA's ``pad``);
    ``(image_size // patch)^2`` tokens.
    """
    token: str = "<|image_pad|>"
    wrap: tuple = ()                  # [start, end]: tokens around each image's placeholders
    policy: str = "dynamic"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 256 * 28 * 28
    image_size: int = 224
    crop: bool = False                # fixed: short side to image_size, then the centre square
    pad: bool = False                 # fixed: first padded to a square of the mean colour
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD
    max_image_pixels: int = 89_478_485   # decode refuses larger images (decompression bombs)

    def validate(self) -> None:
        if self.policy not in ("dynamic", "fixed"):
            raise ConfigError(f"modalities.image.policy is {self.policy!r}: use dynamic or fixed")
        require_positive("image", self, "patch_size", "merge_size", "temporal_patch_size",
                         "max_pixels", "image_size", "max_image_pixels")
        # (image_size // patch_size)^2 tokens: the tower's stride-patch convolution drops the
        # remainder, as SigLIP's 384 px images in 14 px patches give 27 x 27
        if self.policy == "fixed" and self.image_size < self.patch_size:
            raise ConfigError(f"modalities.image.image_size {self.image_size} is smaller than "
                              f"patch_size {self.patch_size}")
        for key in ("crop", "pad"):
            if getattr(self, key) and self.policy != "fixed":
                raise ConfigError(f"modalities.image.{key} applies to the fixed policy only: "
                                  "drop it or set policy: fixed")
        if self.policy == "dynamic" and self.min_pixels > self.max_pixels:
            raise ConfigError(f"modalities.image.min_pixels ({self.min_pixels}) is above "
                              f"max_pixels ({self.max_pixels}): give min_pixels <= max_pixels")


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
def pillow_decoding(max_pixels: int | None, data: bytes):
    """``pixel_limit(max_pixels)`` around Pillow reading ``data``, with what Pillow raises
    inside as MediaError: a decompression bomb is ``image_too_large``, bytes of no format
    Pillow reads ``unsupported_format`` when they are a format it does not read (HEIC, SVG),
    else ``corrupt_image`` (like anything else raised)."""
    try:
        with pixel_limit(max_pixels):
            yield
    except MediaError:
        raise
    except Image.DecompressionBombError as exc:
        raise MediaError("image_too_large", str(exc)) from None
    except Image.UnidentifiedImageError:    # its text names a BytesIO's memory address
        if kind := _foreign_image(data):
            raise MediaError("unsupported_format", f"{kind}, which Pillow does not read: "
                             "convert it first (e.g. to JPEG or PNG)") from None
        if kind := video_or_audio(data):
            raise MediaError("unsupported_format", f"{kind}, not an image: give it as a "
                             "video or audio (the record's video or audio field, or its own "
                             "option), not as an image") from None
        raise MediaError("corrupt_image", "cannot decode image: not a readable image (no "
                         "image format Pillow reads recognizes its bytes)") from None
    except Exception as exc:  # Pillow raises many types (OSError, SyntaxError, ValueError...)
        raise MediaError("corrupt_image", f"cannot decode image: {exc}") from None


# Pillow's modes of one channel wider than 8 bits (16-bit PNG and TIFF, 32-bit integers, floats)
_WIDE_MODES = {"I;16", "I;16L", "I;16B", "I;16N", "I", "F"}


def _clipped(image: Image.Image) -> str | None:
    """How converting a one-channel image wider than 8 bits to RGB would change its values
    (values past 255 or below 0; a float image's fractions, as one scaled to 0-1), else None.
    Decodes the image."""
    low, high = image.getextrema()
    if high > 255 or low < 0:
        return f"with values from {low} to {high}"
    if image.mode == "F" and not np.array_equal(values := np.asarray(image), np.round(values)):
        return f"of fractional values from {low} to {high}"
    return None


# ISO base media brands of HEIC/HEIF still images (an iPhone camera's), which Pillow does not read
_HEIF_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1"}


def _foreign_image(data: bytes) -> str | None:
    """What image a file Pillow recognizes nothing in is, where users meet it: a HEIC/HEIF
    photo or an SVG drawing (gzipped too: ``.svgz``); None for other bytes."""
    if data[4:8] == b"ftyp" and data[8:12] in _HEIF_BRANDS:
        return "a HEIC/HEIF image (an iPhone camera's format)"
    if data[:2] == b"\x1f\x8b":                       # gzip: the head of what it holds
        try:
            data = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS).decompress(data, 1024)
        except zlib.error:
            return None
    head = data[:1024].removeprefix(b"\xef\xbb\xbf").lstrip().lower()
    if head.startswith(b"<") and b"<svg" in head:
        return "an SVG drawing (vector graphics)"
    return None


# ISO base media major brands of video and audio files (MP4, QuickTime, M4V/M4A, 3GPP,
# DASH, Flash, Sony XAVC): other brands are still images (HEIF, AVIF, a camera's raw CR3)
_MEDIA_BRANDS = {b"isom", b"iso2", b"iso4", b"iso5", b"iso6", b"mp41", b"mp42", b"avc1",
                 b"qt  ", b"M4V ", b"M4VH", b"M4VP", b"M4A ", b"M4B ", b"3gp4", b"3gp5",
                 b"3gp6", b"3g2a", b"dash", b"mmp4", b"f4v ", b"MSNV", b"XAVC"}


def video_or_audio(data: bytes) -> str | None:
    """What a video or audio file given as an image is (by its container's signature), so
    that the build and ``mimo-generate --image`` name the mix-up, not corrupt bytes; None for
    other bytes."""
    if data[4:8] == b"ftyp" and data[8:12] in _MEDIA_BRANDS:
        return "an MP4/MOV video (or M4A audio)"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "a WebM/Matroska video"
    if data[:4] == b"RIFF" and data[8:12] in (b"AVI ", b"WAVE"):
        return "an AVI video" if data[8:12] == b"AVI " else "a WAV audio file"
    if data[:4] in (b"fLaC", b"OggS"):
        return "a FLAC audio file" if data[:4] == b"fLaC" else "an Ogg audio or video file"
    if data[:3] == b"ID3" or data[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):
        return "an MP3 audio file"
    return None


def still_image(data: bytes) -> str | None:
    """What an image given as a clip or as audio is (by its format's signature), so that
    ``mimo-generate --video/--audio`` names the mix-up; None for other bytes (a GIF may be
    a clip)."""
    if data[:3] == b"\xff\xd8\xff":
        return "a JPEG image"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "a PNG image"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "a WebP image"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "a TIFF image"
    return None


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
    with pillow_decoding(max_pixels, data):
        image = Image.open(io.BytesIO(data))
        fmt = (image.format or "").lower()
        width, height = image.size
        if width * height > max_pixels:
            raise MediaError("image_too_large", f"{width}x{height} = {width * height} pixels "
                             f"is above the limit of {max_pixels}")
        if fmt not in IMAGE_EXTENSIONS:
            raise MediaError("unsupported_format", f"image format {fmt or 'unknown'!r} is "
                             f"not one of {listed(sorted(IMAGE_EXTENSIONS))}; convert it first")
        mode = image.mode
        if mode in _WIDE_MODES and (why := _clipped(image)):
            raise MediaError("unsupported_format", f"a {mode} image (one channel of more "
                             f"than 8 bits) {why}: converted to RGB, as transformers' "
                             "processors convert it, it is clipped to 0-255; scale it to "
                             "8 bits first (e.g. 16-bit values divided by 257)")
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


# smart_resize refuses images whose long side is more than this many times the short side.
MAX_ASPECT_RATIO = 200


def image_resized_size(width: int, height: int, cfg: ImageConfig) -> tuple[int, int]:
    """``(width, height)`` the encoder input is resized to (size after EXIF orientation in)."""
    if cfg.policy == "fixed":
        return cfg.image_size, cfg.image_size
    if min(width, height) <= 0 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of {width}x{height} pixels has an aspect ratio above "
                         f"{MAX_ASPECT_RATIO}:1, which the dynamic resize (smart_resize) refuses; "
                         "drop or crop the image")
    # where used (``ImageModality.libraries``): not in every ``mimo-shard`` command
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    height, width = smart_resize(height, width, factor=cfg.patch_size * cfg.merge_size,
                                 min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    return width, height


def image_token_grid(width: int, height: int, cfg: ImageConfig) -> tuple[int, int, int]:
    """``(1, rows, columns)`` of the tokens the vision encoder emits for a ``width`` x
    ``height`` image, in their order (row by row)."""
    if cfg.policy == "fixed":
        side = cfg.image_size // cfg.patch_size
        return 1, side, side
    resized_width, resized_height = image_resized_size(width, height, cfg)
    unit = cfg.patch_size * cfg.merge_size
    return 1, resized_height // unit, resized_width // unit


def image_tokens(width: int, height: int, cfg: ImageConfig) -> int:
    """Tokens the vision encoder emits for a ``width`` x ``height`` image."""
    _, rows, columns = image_token_grid(width, height, cfg)
    return rows * columns


# What ImageOps.exif_transpose does for each EXIF orientation; we apply the orientation stored
# in the shard metadata, so pixels and metadata width/height agree by construction.
_ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def decode_image(data: bytes, orientation: int, cfg: ImageConfig) -> Image.Image:
    """Decode encoded image bytes into an RGB image, transposed by EXIF ``orientation`` (1-8).

    Transparency is composited onto white, as transformers' ``convert_to_rgb`` does.
    Raises MediaError(``image_too_large`` | ``corrupt_image``).
    """
    with pillow_decoding(cfg.max_image_pixels, data):
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > cfg.max_image_pixels:
            raise MediaError("image_too_large", f"{width}x{height} = {width * height} pixels "
                             f"is above max_image_pixels = {cfg.max_image_pixels}; raise "
                             "modalities.image.max_image_pixels to keep such images")
        image.load()
    if orientation in _ORIENTATION_TRANSPOSE:
        image = image.transpose(_ORIENTATION_TRANSPOSE[orientation])
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _rgbx_pixels(image: Image.Image) -> np.ndarray:
    """``[H, W, 4]`` uint8 pixels of an RGB image (the 4th byte is padding), without a copy when
    Pillow can lend them.

    ``np.asarray(image)`` repacks Pillow's 4-bytes-per-pixel storage through ``tobytes``, a
    tenth of the whole image path; Pillow's Arrow export hands out that storage itself (its
    child array read directly: ``flatten()`` costs a compute-function call). It refuses images
    spread over several memory blocks (above 16 MB): those are copied.
    """
    try:
        storage = pyarrow.array(image).values.to_numpy()
    except ValueError:
        return np.asarray(image.convert("RGBA"))
    return storage.reshape(image.height, image.width, 4)


def _patchify_into(pixels: np.ndarray, out: np.ndarray, cfg: ImageConfig) -> None:
    """Write ``[H, W, 4]`` uint8 RGBX pixels into ``out`` = ``[grid_h * grid_w, C * P * P]``.

    The row/column layout of ``Qwen2VLImageProcessorPil.patchify`` for one frame: rows in
    merge-block order (block row, block column, row in block, column in block), columns
    (channel, patch row, patch column); the reference's repeat of that frame over
    ``temporal_patch_size`` is left to ``normalize_pixels``.

    No library call does this reshuffle. One strided uint8 copy of the transposed view moves
    ``P`` bytes per numpy inner loop (~0.33 ms for 448x448 pixels); two passes with longer
    loops take under half that: patch rows of RGBX pixels (``4 * P`` bytes, one opaque numpy
    item) into patch order, then one narrowing cast of the 32-bit little-endian words that
    start at each channel's byte (their low byte), whole patches at a time (unaligned reads,
    still faster than shifting aligned words through a buffered cast).
    """
    height, width, _ = pixels.shape
    p, m = cfg.patch_size, cfg.merge_size
    patch_row = np.dtype(f"V{4 * p}")
    rows = pixels.reshape(height, width * 4).view(patch_row).reshape(
        height // (p * m), m, p, width // (p * m), m)
    rgbx = np.empty(len(out) * p * p + 1, np.uint32)    # + 1: the last G, B words run past
    rgbx[:-1].view(patch_row).reshape(height // (p * m), width // (p * m), m, m, p)[...] = (
        rows.transpose(0, 3, 1, 4, 2))                  # (gh/m, gw/m, mh, mw, ph)
    # [patch, channel, pixel]: the word at byte 4 * pixel + channel of the patch's RGBX.
    words = np.ndarray((len(out), 3, p * p), np.dtype("<u4"), rgbx, 0, (4 * p * p, 1, 4))
    np.copyto(out.reshape(words.shape), words, casting="unsafe")


def image_encoder_inputs(images: list[Image.Image], cfg: ImageConfig) -> dict[str, torch.Tensor]:
    """Encoder kwargs for RGB images, image by image, pixels as uint8.

    dynamic: ``{"pixel_values": [Σ patches, C*P*P], "image_grid_thw": int64 [n, 3]}``, one
    frame per patch (``normalize_pixels`` repeats it into the encoder's ``C*T*P*P`` columns);
    fixed: ``{"pixel_values": [n, 3, S, S]}`` (squash resize as SigLIP, or crop as CLIP).
    Resizing is Pillow's BICUBIC, the same call the reference processors make.
    """
    import torch
    if cfg.policy == "fixed":
        side = cfg.image_size
        pixels = np.empty((len(images), 3, side, side), np.uint8)
        for out, image in zip(pixels, images):
            if cfg.pad:
                image = _padded_square(image, cfg.mean)
            if cfg.crop:
                resized = _center_square(image.resize(_short_side_size(image, side),
                                                      Image.Resampling.BICUBIC), side)
            else:
                resized = image.resize((side, side), Image.Resampling.BICUBIC)
            out[...] = _rgbx_pixels(resized)[..., :3].transpose(2, 0, 1)
        return {"pixel_values": torch.from_numpy(pixels)}
    sizes = [image_resized_size(image.width, image.height, cfg) for image in images]
    # numpy, not torch.tensor: a torch call costs several times more amid the image work.
    grids = np.array([(1, height // cfg.patch_size, width // cfg.patch_size)
                      for width, height in sizes], np.int64).reshape(-1, 3)
    rows = (grids[:, 1] * grids[:, 2]).tolist()
    pixels = np.empty((sum(rows), 3 * cfg.patch_size ** 2), np.uint8)
    start = 0
    for image, size, count in zip(images, sizes, rows):
        resized = image if image.size == size else image.resize(size, Image.Resampling.BICUBIC)
        _patchify_into(_rgbx_pixels(resized), pixels[start:start + count], cfg)
        start += count
    return {"pixel_values": torch.from_numpy(pixels), "image_grid_thw": torch.from_numpy(grids)}


def _short_side_size(image: Image.Image, side: int) -> tuple[int, int]:
    """``(width, height)`` with the short side ``side``, CLIP's processor's rounding (the
    function transformers' processors call, on a shape-only array)."""
    from transformers.image_transforms import get_resize_output_image_size   # (libraries)
    shape = np.broadcast_to(np.uint8(0), (3, image.height, image.width))
    height, width = get_resize_output_image_size(shape, side, default_to_square=False,
                                                 input_data_format="channels_first")
    return width, height


def _padded_square(image: Image.Image, mean: tuple) -> Image.Image:
    """``image`` centred on a square of its long side, filled with the colour ``mean`` (0..1
    per channel, truncated to bytes): LLaVA's ``image_aspect_ratio: pad``, as transformers'
    ``LlavaImageProcessor`` pads (``do_pad``), offsets rounded down."""
    side = max(image.size)
    if image.width == image.height:
        return image
    square = Image.new("RGB", (side, side), tuple(int(x * 255) for x in mean))
    square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return square


def _center_square(image: Image.Image, side: int) -> Image.Image:
    """The centre ``side`` x ``side`` square, offsets rounded down as transformers'
    ``center_crop``."""
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return image.crop((left, top, left + side, top + side))


def image_rows_to_tokens(inputs: dict[str, torch.Tensor], cfg: ImageConfig) -> list[int]:
    """Per-image token counts the encoder emits for ``image_encoder_inputs`` output."""
    if cfg.policy == "fixed":
        return [(cfg.image_size // cfg.patch_size) ** 2] * len(inputs["pixel_values"])
    return [int(t * h * w) // cfg.merge_size ** 2 for t, h, w in inputs["image_grid_thw"].tolist()]


def normalize_pixels(pixel_values: torch.Tensor, cfg: ImageConfig) -> torch.Tensor:
    """uint8 pixels → float32 ``(x / 255 - mean[c]) / std[c]``, on their device: exactly the
    reference processors' ``pixel_values``.

    fixed: ``[n, C, S, S]`` → the same shape. dynamic: ``[rows, C*P*P]`` → ``[rows, C*T*P*P]``,
    each patch's single frame repeated ``temporal_patch_size`` times after normalizing, as
    ``Qwen2VLImageProcessorPil`` does for a still image. Same operations in the same order as
    the reference processors (rescale, then subtract the mean and divide by the std in float32).
    """
    import torch
    mean = to_device(torch.tensor(cfg.mean, dtype=torch.float32), pixel_values.device)
    std = to_device(torch.tensor(cfg.std, dtype=torch.float32), pixel_values.device)
    channels = len(cfg.mean)
    if cfg.policy == "fixed":      # [n, C, S, S]
        shape = (1, channels, 1, 1)
        return (pixel_values.to(torch.float32) / 255 - mean.view(shape)) / std.view(shape)
    columns = channels * cfg.patch_size ** 2
    if pixel_values.dim() != 2 or pixel_values.shape[1] != columns:
        raise ValueError(f"image pixel_values of shape {tuple(pixel_values.shape)}: the dynamic "
                         f"policy expects [patches, {columns}] (C={channels} x patch_size="
                         f"{cfg.patch_size} squared), as image_encoder_inputs writes them")
    rows = len(pixel_values)
    values = pixel_values.reshape(rows, channels, 1, cfg.patch_size ** 2).to(torch.float32)
    values = (values / 255 - mean.view(1, channels, 1, 1)) / std.view(1, channels, 1, 1)
    return values.expand(rows, channels, cfg.temporal_patch_size, cfg.patch_size ** 2).reshape(
        rows, channels * cfg.temporal_patch_size * cfg.patch_size ** 2)


@functools.lru_cache(maxsize=_MAX_MEMO)
def _grid_or_error(width: int, height: int, config: ImageConfig
                   ) -> tuple[int, int, int] | ValueError:
    """``image_token_grid``, remembered: a dataset has few distinct image sizes."""
    try:
        return image_token_grid(width, height, config)
    except ValueError as exc:   # an aspect ratio the resize rule cannot handle
        return exc


class ImageModality(Modality):
    name = "image"
    marker = "<image>"
    member_prefix = "img"
    extensions = IMAGE_EXTENSIONS
    config_class = ImageConfig
    libraries = ("transformers.image_transforms",
                 "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    item_fields = ("member", "width", "height", "orientation")
    verified_fields = ("format", "width", "height", "mode", "orientation")
    summary_fields = {"width": "int32", "height": "int32"}
    ansi_color = "\033[1;35m"
    html_color = "#8250df"
    takes_parts = True

    def probe(self, data: bytes, check: str, max_image_pixels: int) -> dict[str, Any]:
        return probe_image(data, max_image_pixels, check)

    def decoded_metadata(self, data: bytes) -> dict[str, Any]:
        found = probe_image(data, max_pixels=1 << 62, check="header")
        with pixel_limit(None):                          # its size passed the build
            Image.open(io.BytesIO(data)).load()          # full decode
        return found

    def tokens(self, item: Mapping[str, Any], config: ImageConfig) -> int:
        return image_tokens(item["width"], item["height"], config)

    def item_tokens(self, item: MediaItem, config: ImageConfig) -> int:
        grid = _grid_or_error(item["width"], item["height"], config)
        if isinstance(grid, ValueError):
            raise MediaError("bad_image_shape", f"{item_name(item)}: {grid}")
        return grid[1] * grid[2]

    def token_grid(self, item: Mapping[str, Any], config: ImageConfig) -> tuple[int, int, int]:
        grid = _grid_or_error(item["width"], item["height"], config)
        if isinstance(grid, ValueError):
            raise grid
        return grid

    def variable_tokens(self, config: ImageConfig) -> bool:
        return config.policy == "dynamic"

    def decode(self, data: bytes, item: MediaItem, config: ImageConfig) -> Image.Image:
        image = decode_image(data, item["orientation"], config)
        if image.size != (item["width"], item["height"]):
            raise ValueError(f"decodes to {image.size[0]}x{image.size[1]}, the metadata says "
                             f"{item['width']}x{item['height']}")
        return image

    def encoder_inputs(self, decoded: list, config: ImageConfig) -> dict[str, torch.Tensor]:
        return image_encoder_inputs(decoded, config)

    def rows_to_tokens(self, inputs: dict[str, torch.Tensor], config: ImageConfig) -> list[int]:
        return image_rows_to_tokens(inputs, config)

    def take(self, inputs: dict[str, torch.Tensor], config: ImageConfig,
             pieces: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Whole images only (one unit each)."""
        if config.policy == "fixed":
            return {"pixel_values": inputs["pixel_values"][[item for item, _, _ in pieces]]}
        pixels, grids = take_grid_rows(inputs["pixel_values"], inputs["image_grid_thw"], pieces)
        return {"pixel_values": pixels, "image_grid_thw": grids}

    def describe(self, item: Mapping[str, Any]) -> str:
        return f"{item.get('width')}x{item.get('height')} {item.get('mode', '')}".strip()

    def preview_png(self, data: bytes, item: Mapping[str, Any], config: ImageConfig
                    ) -> tuple[bytes, str]:
        image = decode_image(data, item.get("orientation", 1), config)
        problem = ""
        if image.size != (item.get("width"), item.get("height")):
            problem = (f"decodes to {image.width}x{image.height}, the metadata says "
                       f"{item.get('width')}x{item.get('height')}")
        image.thumbnail(THUMBNAIL)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue(), problem


IMAGE = ImageModality()
