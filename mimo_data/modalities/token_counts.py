"""Encoder token counts as pure functions of media metadata and the preprocessing config.

Language ranks call these for every sample to expand ``<image>``/``<audio>`` markers without
decoding media (DESIGN.md, "Sample and batch contract"), so they must agree exactly with what
``image_inputs`` / ``audio_inputs`` feed the encoders; the tests check both against transformers.
"""

from __future__ import annotations

import math

import numpy as np
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from mimo_data.preprocess.config import AudioConfig, ImageConfig

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
    height, width = smart_resize(height, width, factor=cfg.patch_size * cfg.merge_size,
                                 min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    return width, height


def image_tokens(width: int, height: int, cfg: ImageConfig) -> int:
    """Tokens the vision encoder emits for a ``width`` x ``height`` image."""
    if cfg.policy == "fixed":
        return (cfg.image_size // cfg.patch_size) ** 2
    resized_width, resized_height = image_resized_size(width, height, cfg)
    unit = cfg.patch_size * cfg.merge_size
    return (resized_height // unit) * (resized_width // unit)


def resampled_length(frames: int, sample_rate: int, target_rate: int) -> int:
    """Samples ``torchaudio.functional.resample`` returns for ``frames`` samples.

    torchaudio computes ``ceil(new * frames / orig)`` (rates divided by their gcd) on a float32
    tensor, so for long clips the result can be one below the exact ceiling (e.g. 99830 frames
    at 22050 Hz give 72439 samples at 16 kHz, not 72440); we repeat its float32 arithmetic.
    """
    if sample_rate == target_rate:
        return frames
    gcd = math.gcd(sample_rate, target_rate)
    orig, new = sample_rate // gcd, target_rate // gcd
    return int(np.ceil(np.float32(new * frames / orig)))


def max_audio_samples(cfg: AudioConfig) -> int:
    """Longest clip kept, in samples at ``cfg.sample_rate``."""
    return round(cfg.max_duration * cfg.sample_rate)


def audio_too_long(frames: int, sample_rate: int, cfg: AudioConfig) -> bool:
    """Whether a clip (source frames and rate) makes its sample be dropped.

    True when it resamples to more than ``max_duration`` and ``long_audio`` is ``drop``; with
    ``truncate`` the clip is cut instead (``audio_tokens`` counts the cut clip).
    """
    return (cfg.long_audio == "drop" and
            resampled_length(frames, sample_rate, cfg.sample_rate) > max_audio_samples(cfg))


def audio_frames(num_samples: int, cfg: AudioConfig) -> int:
    """Log-mel frames for ``num_samples`` samples at ``cfg.sample_rate``.

    WhisperFeatureExtractor's centered STFT gives ``num_samples // hop + 1`` frames and drops
    the last one.
    """
    return num_samples // cfg.hop_length


def audio_tokens_from_frames(frames: int, cfg: AudioConfig) -> int:
    """Tokens the audio encoder emits for ``frames`` feature frames (ceil by each reduction)."""
    for reduction in cfg.reductions:
        frames = -(-frames // reduction)
    return frames


def audio_tokens(frames: int, sample_rate: int, cfg: AudioConfig) -> int:
    """Tokens for a clip of ``frames`` source frames at ``sample_rate`` (shard metadata)."""
    samples = resampled_length(frames, sample_rate, cfg.sample_rate)
    if cfg.long_audio == "truncate":
        samples = min(samples, max_audio_samples(cfg))
    return audio_tokens_from_frames(audio_frames(samples, cfg), cfg)
