"""Decode images and build the vision encoder's inputs as uint8 tensors.

The reference is transformers' ``Qwen2VLImageProcessorPil`` (dynamic policy) and
``SiglipImageProcessorPil`` (fixed policy). Both resize a uint8 image with Pillow, then
rescale, normalize and patchify in float32 on the CPU; that float work is most of the
preprocessing time (DESIGN.md, "Where the time goes"). Here the same Pillow resize is followed
by a copy-only patchify of the uint8 pixels, and ``normalize_pixels`` does the float step on
the encoder's device (a quarter of the bytes to move). A still image's patches are stored once,
``[Σ patches, C·P·P]``: the reference repeats the frame ``temporal_patch_size`` times in its
``C·T·P·P`` columns, and ``normalize_pixels`` does that repeat on the device (half the bytes
again). The tests check that ``normalize_pixels(image_encoder_inputs(...))`` equals the
reference processors' output.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow
import torch
from PIL import Image

from mimo_data.modalities.media import MediaError, pillow_decoding
from mimo_data.preprocess.config import ImageConfig
from mimo_data.modalities.token_counts import image_resized_size

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
    with pillow_decoding(cfg.max_image_pixels):
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
    fixed: ``{"pixel_values": [n, 3, S, S]}`` (squash resize, as SigLIP).
    Resizing is Pillow's BICUBIC, the same call the reference processors make.
    """
    if cfg.policy == "fixed":
        size = (cfg.image_size, cfg.image_size)
        pixels = np.empty((len(images), 3, *size), np.uint8)
        for out, image in zip(pixels, images):
            resized = image.resize(size, Image.Resampling.BICUBIC)
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
    mean = torch.tensor(cfg.mean, dtype=torch.float32, device=pixel_values.device)
    std = torch.tensor(cfg.std, dtype=torch.float32, device=pixel_values.device)
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
