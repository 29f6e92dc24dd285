"""Which frames of a clip the encoder gets, and at which size: one table of the video
processors' rules, keyed by ``modalities.video.sampling``.

Each entry (``FrameSampling``) is one transformers video processor's rules, written from its
source: how many frames it samples from a clip (``frame_count``), which ones
(``frame_indices``) and the size it resizes them to (``resized_size``). A new family's rule is
one entry of ``SAMPLINGS``; nothing else branches on the name. Everything here is a pure
function of a clip's metadata (frame count, average frame rate, size) and the config.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mimo_data.modalities.image import MAX_ASPECT_RATIO


class FrameSettings(Protocol):
    """What the rules read of a ``VideoConfig`` (config.py, which validates ``sampling``
    against this table)."""
    @property
    def fps(self) -> float: ...
    @property
    def min_frames(self) -> int: ...
    @property
    def max_frames(self) -> int: ...
    @property
    def temporal_patch_size(self) -> int: ...
    @property
    def patch_size(self) -> int: ...
    @property
    def merge_size(self) -> int: ...
    @property
    def min_pixels(self) -> int: ...
    @property
    def max_pixels(self) -> int: ...
    @property
    def cap_pixels_per_frame(self) -> bool: ...
    @property
    def max_video_tokens(self) -> int: ...
    @property
    def sampling(self) -> str: ...
    @property
    def timestamps(self) -> bool: ...


@dataclass(frozen=True)
class FrameSampling:
    """One video processor's rules."""
    processor: str                    # the transformers class whose rules these are
    # (clip frames, clip fps, settings) -> frames sampled (0: the clip is too short)
    frame_count: Callable[[int, float, FrameSettings], int]
    # (clip frames, frames sampled) -> the sampled frames' indices, in order
    frame_indices: Callable[[int, int], list[int]]
    # (width, height, frames sampled, settings) -> (width, height) each frame is resized to
    resized_size: Callable[[int, int, int, FrameSettings], tuple[int, int]]
    # the processor's default max_video_tokens (cap_pixels_per_frame's budget)
    max_video_tokens: int = 128000


def _qwen2_vl_count(frames: int, fps: float, cfg: FrameSettings) -> int:
    """``frames / fps * cfg.fps`` clamped to [min_frames, max_frames] and to the clip's frames
    (max_frames first rounded down to a multiple of temporal_patch_size, with the clip's
    frames), then rounded down to a multiple of temporal_patch_size."""
    tps = cfg.temporal_patch_size
    max_frames = math.floor(min(cfg.max_frames, frames) / tps) * tps
    wanted = min(max(frames / fps * cfg.fps, cfg.min_frames), max_frames, frames)
    return math.floor(wanted / tps) * tps


def _qwen2_vl_indices(frames: int, count: int) -> list[int]:
    """``torch.arange(0, frames, frames / n).int()``, as the processor, for the same values:
    torch computes them in float32, which for clips of more than 2^13 frames can give one frame
    off the exact ``i * frames // n``. Its length, computed in double precision as
    ``ceil(frames / (frames / n))``, is ``n + 1`` for some pairs (e.g. 17 frames, n = 14; 506
    frames at 10 fps): the extra index is then ``frames`` itself, past the clip, and the
    processor fails indexing the clip with it. It is dropped here: always n frames."""
    import torch
    return torch.arange(0, frames, frames / count).int().tolist()[:count]


def _qwen2_vl_size(width: int, height: int, sampled: int, cfg: FrameSettings
                   ) -> tuple[int, int]:
    """``smart_resize`` of each frame within [min_pixels, max_pixels]; with
    ``cap_pixels_per_frame`` max_pixels is also held to an even share of
    ``max_video_tokens * 0.9`` tokens' pixels over the sampled frames, floored at
    ``1.05 * min_pixels``."""
    factor = cfg.patch_size * cfg.merge_size
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ValueError(f"video of {width}x{height} pixels has an aspect ratio above "
                         f"{MAX_ASPECT_RATIO}:1, which the dynamic resize (smart_resize) refuses")
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        total_pixels = int(cfg.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * cfg.temporal_patch_size // sampled),
                         int(cfg.min_pixels * 1.05))
    # where used (``VideoModality.libraries``): not in every ``mimo-shard`` command
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    height, width = smart_resize(height, width, factor=factor, min_pixels=cfg.min_pixels,
                                 max_pixels=max_pixels)
    return width, height


def _qwen3_vl_count(frames: int, fps: float, cfg: FrameSettings) -> int:
    """``int(frames / fps * cfg.fps)`` clamped to [min_frames, max_frames] and to the clip's
    frames, not rounded (the last frame is repeated up to a multiple of temporal_patch_size);
    0 below temporal_patch_size, which its resize refuses."""
    count = min(max(int(frames / fps * cfg.fps), cfg.min_frames), cfg.max_frames, frames)
    return count if count >= cfg.temporal_patch_size else 0


def _linspace_indices(frames: int, count: int) -> list[int]:
    """``np.linspace(0, frames - 1, n).round()``: spread evenly from the first frame to the
    last."""
    return np.linspace(0, frames - 1, count).round().astype(int).tolist()


def _qwen3_vl_size(width: int, height: int, sampled: int, cfg: FrameSettings
                   ) -> tuple[int, int]:
    """Its ``smart_resize`` of the whole clip: [min_pixels, max_pixels] bound the pixels of
    all sampled frames (its ``size``); with ``cap_pixels_per_frame`` each frame's are held to
    ``max_video_tokens`` tokens' and an even share of max_pixels, floored at
    ``1.05 * min_pixels``."""
    factor = cfg.patch_size * cfg.merge_size
    max_pixels = cfg.max_pixels
    if cfg.cap_pixels_per_frame:
        per_frame = max(min(cfg.max_video_tokens * factor * factor, cfg.max_pixels // sampled),
                        int(cfg.min_pixels * 1.05))
        max_pixels = per_frame * sampled
    # where used (``VideoModality.libraries``): not in every ``mimo-shard`` command
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_size
    height, width = clip_size(sampled, height, width, temporal_factor=cfg.temporal_patch_size,
                              factor=factor, min_pixels=cfg.min_pixels, max_pixels=max_pixels)
    return width, height


# modalities.video.sampling -> its processor's rules
SAMPLINGS: dict[str, FrameSampling] = {
    "qwen2_vl": FrameSampling("Qwen2VLVideoProcessor", _qwen2_vl_count, _qwen2_vl_indices,
                              _qwen2_vl_size),
    "qwen3_vl": FrameSampling("Qwen3VLVideoProcessor", _qwen3_vl_count, _linspace_indices,
                              _qwen3_vl_size, max_video_tokens=768),
}


def sampled_frame_count(frames: int, fps: float, cfg: FrameSettings) -> int:
    """How many frames the video processor's ``sample_frames`` picks from a clip of
    ``frames`` frames at ``fps`` (0: too short)."""
    return SAMPLINGS[cfg.sampling].frame_count(frames, fps, cfg)


class ClipTooShort(ValueError):
    """A clip that samples no temporal patch (``too_short`` says why): ``video_too_short``."""


def too_short(frames: int, fps: float, cfg: FrameSettings) -> str:
    """Why a clip of ``frames`` frames at ``fps`` samples no temporal patch: the clip, or the
    sampling settings where the clip has the frames."""
    patch = cfg.temporal_patch_size
    if frames < patch:
        return (f"a clip of {frames} frame{'s' if frames != 1 else ''} is shorter than "
                f"temporal_patch_size = {patch} frames")
    return (f"a clip of {frames} frames ({frames / fps:.2f} s) sampled at "
            f"modalities.video.fps = {cfg.fps:g} with min_frames = {cfg.min_frames} gives "
            f"fewer than temporal_patch_size = {patch} frames: raise fps, or min_frames to "
            f"{patch} or more")


def sample_indices(frames: int, fps: float, cfg: FrameSettings) -> list[int]:
    """Indices of the ``sampled_frame_count`` frames the video processor samples from a clip
    of ``frames`` frames at ``fps`` (ValueError if too short)."""
    count = sampled_frame_count(frames, fps, cfg)
    if count == 0:
        raise ClipTooShort(too_short(frames, fps, cfg))
    return SAMPLINGS[cfg.sampling].frame_indices(frames, count)


def video_resized_size(width: int, height: int, sampled: int, cfg: FrameSettings
                       ) -> tuple[int, int]:
    """``(width, height)`` each of ``sampled`` frames of a ``width`` x ``height`` clip (after
    rotation) is resized to, as the processor's ``resize`` (ValueError for a size it
    refuses)."""
    if min(width, height) <= 0:
        raise ValueError(f"video of {width}x{height} pixels has no area")
    return SAMPLINGS[cfg.sampling].resized_size(width, height, sampled, cfg)


def patch_timestamps(frames: int, fps: float, cfg: FrameSettings) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last sampled frame's time
    (the last frame repeated up to a multiple of temporal_patch_size), as
    ``Qwen3VLProcessor._calculate_timestamps``."""
    indices = sample_indices(frames, fps, cfg)
    tps = cfg.temporal_patch_size
    indices += indices[-1:] * (-len(indices) % tps)
    times = [index / fps for index in indices]
    return [(times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps)]


@functools.lru_cache(maxsize=1024)     # entries of up to max_frames / 2 strings each
def timestamp_texts(frames: int, fps: float, config: FrameSettings) -> tuple[str, ...]:
    """``<{t:.1f} seconds>`` per temporal patch (``patch_timestamps``), as Qwen3VLProcessor
    writes them before each patch's tokens; () without ``timestamps``."""
    if not config.timestamps:
        return ()
    return tuple(f"<{t:.1f} seconds>" for t in patch_timestamps(frames, fps, config))
