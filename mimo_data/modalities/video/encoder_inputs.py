"""Decoded clips → the encoder's inputs, as transformers' video processors make them.

The resize is the call torchvision makes for the processor (``torch.nn.functional.interpolate``,
bicubic, antialiased, native uint8 on the CPU) to the sampling rule's size, and the patch layout
is its ``patchify``. As for images, the patches leave the data workers as uint8 and
``normalize_video_pixels`` does the float step on the encoder's device, with the processor's
fused arithmetic (``(x - 255 * mean) / (255 * std)`` in float32): the tests check the result
equals the processor's ``pixel_values_videos`` exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mimo_data.modalities.base import to_device
from mimo_data.modalities.video.config import VideoConfig
from mimo_data.modalities.video.sampling import video_resized_size

if TYPE_CHECKING:     # torch is imported where used: metadata commands start without it
    import torch


def resize_frames(frames: np.ndarray, width: int, height: int) -> torch.Tensor:
    """uint8 ``[T, H, W, 3]`` → uint8 ``[T, 3, height, width]``: what torchvision's
    ``resize`` does for the processor (bicubic, antialias, ``align_corners=False``, uint8
    natively on the CPU), a no-op at the same size."""
    import torch
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    if video.shape[-2:] == (height, width):
        return video
    return torch.nn.functional.interpolate(video, size=[height, width], mode="bicubic",
                                           align_corners=False, antialias=True)


def patchify_video(video: torch.Tensor, cfg: VideoConfig) -> torch.Tensor:
    """uint8 ``[T, C, H, W]`` → ``[t * h * w, C * tps * P * P]``: the processor's ``patchify``
    (the last frame repeated up to a multiple of temporal_patch_size), on uint8."""
    import torch
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
    import torch
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
    import torch
    channels = len(cfg.mean)
    rescale = 1 / 255
    mean = to_device(torch.tensor(cfg.mean) * (1.0 / rescale), pixel_values.device)
    std = to_device(torch.tensor(cfg.std) * (1.0 / rescale), pixel_values.device)
    rows = len(pixel_values)
    values = pixel_values.reshape(rows, channels, -1).to(torch.float32)   # a new tensor:
    values.sub_(mean.view(1, channels, 1)).div_(std.view(1, channels, 1))  # in place on it
    return values.reshape(rows, -1)

