"""A clip's token grid and M-RoPE time step, from its metadata alone (frame count, average
frame rate, width and height after rotation): no decode."""

from __future__ import annotations

import functools

import numpy as np

from mimo_data.modalities.video.config import VideoConfig
from mimo_data.modalities.video.sampling import (ClipTooShort, sampled_frame_count, too_short,
                                                 video_resized_size)

_MAX_MEMO = 1 << 16


def video_grid_thw(frames: int, fps: float, width: int, height: int, cfg: VideoConfig
                   ) -> tuple[int, int, int]:
    """The processor's ``video_grid_thw`` row (temporal patches, patch rows, patch columns)."""
    sampled = sampled_frame_count(frames, fps, cfg)
    if sampled == 0:
        raise ClipTooShort(too_short(frames, fps, cfg))
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


@functools.lru_cache(maxsize=_MAX_MEMO)
def token_grid_or_error(frames: int, fps: float, width: int, height: int, config: VideoConfig
                        ) -> tuple[int, int, int] | ValueError:
    """``video_token_grid``, or the ValueError it raises, memoized on the metadata."""
    try:
        return video_token_grid(frames, fps, width, height, config)
    except ValueError as exc:
        return exc


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
