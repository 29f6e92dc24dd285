"""``modalities.video``: the video section of the preprocessing config."""

from __future__ import annotations

from dataclasses import dataclass

from mimo_data.errors import ConfigError
from mimo_data.modalities.base import require_positive
from mimo_data.modalities.image import CLIP_MEAN, CLIP_STD
from mimo_data.modalities.video.sampling import SAMPLINGS

# The build refuses longer clips (``video_too_long``).
MAX_VIDEO_SECONDS = 3600.0


@dataclass(frozen=True)
class VideoConfig:
    """Frame sampling and the encoder's input layout, as the checkpoint's video processor's.

    ``sampling`` names the processor whose rules pick the frames and size them (the table
    ``sampling.SAMPLINGS``): about ``fps`` frames a second, between ``min_frames`` and
    ``max_frames`` (and at most the clip's), each frame resized so both sides are multiples of
    ``patch_size * merge_size`` within the pixel budget [min_pixels, max_pixels] (with
    ``cap_pixels_per_frame`` also held to a share of ``max_video_tokens`` tokens' pixels);
    ``(t / temporal_patch_size) * (h / patch) * (w / patch) / merge²`` tokens.

    ``timestamps`` (Qwen3-VL): each temporal patch's tokens sit between their own wrap tokens
    after the text ``<{t:.1f} seconds>`` (the mean time of its frames), the whole between the
    wrap tokens again, and each temporal patch is positioned (M-RoPE) as an image of its own.
    """
    token: str = "<|video_pad|>"
    wrap: tuple = ()                  # [start, end]: tokens around each clip's placeholders
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28   # per frame: the processor's size["shortest_edge"]
    max_pixels: int = 768 * 28 * 28   # per frame: its size["longest_edge"]
    cap_pixels_per_frame: bool = False
    # cap_pixels_per_frame's token budget; 0: the sampling's processor's default
    # (``FrameSampling.max_video_tokens``: Qwen2-VL's 128000 a clip, Qwen3-VL's 768 a frame)
    max_video_tokens: int = 0
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD
    max_duration: float = MAX_VIDEO_SECONDS   # longer clips are dropped (video_too_long)
    # Qwen2.5-VL: M-RoPE time positions per second of video (its vision config's
    # tokens_per_second); None: one time position per temporal patch (Qwen2-VL)
    tokens_per_second: float | None = None
    sampling: str = "qwen2_vl"        # frame sampling and resize: a key of SAMPLINGS
    timestamps: bool = False          # Qwen3-VL: a timestamp text and a wrap per temporal patch

    def __post_init__(self) -> None:
        if not self.max_video_tokens and self.sampling in SAMPLINGS:
            object.__setattr__(self, "max_video_tokens",
                               SAMPLINGS[self.sampling].max_video_tokens)

    def validate(self) -> None:
        if self.sampling not in SAMPLINGS:
            raise ConfigError(f"modalities.video.sampling is {self.sampling!r}: use "
                              f"{' or '.join(SAMPLINGS)} (the checkpoint's video processor)")
        if self.timestamps and not self.wrap:
            raise ConfigError("modalities.video.timestamps puts each temporal patch between the "
                              "wrap tokens: give wrap too (e.g. [<|vision_start|>, "
                              "<|vision_end|>])")
        if self.timestamps and self.tokens_per_second is not None:
            raise ConfigError("modalities.video.timestamps and tokens_per_second: with "
                              "timestamps the time is in the text and each temporal patch is "
                              "positioned on its own (Qwen3-VL); drop tokens_per_second")
        if self.fps <= 0:
            raise ConfigError(f"modalities.video.fps is {self.fps}: it must be positive")
        require_positive("video", self, "patch_size", "merge_size", "max_pixels",
                         "max_duration")
        if self.min_pixels > self.max_pixels:
            raise ConfigError("modalities.video.min_pixels is above max_pixels")
        if self.temporal_patch_size < 1:
            raise ConfigError(f"modalities.video.temporal_patch_size is "
                              f"{self.temporal_patch_size}: it must be at least 1")
        if self.min_frames > self.max_frames:
            raise ConfigError(f"modalities.video.min_frames ({self.min_frames}) is above "
                              f"max_frames ({self.max_frames}): give min_frames <= max_frames")
        if self.max_frames < self.temporal_patch_size:
            raise ConfigError(f"modalities.video.max_frames is {self.max_frames}, below "
                              f"temporal_patch_size ({self.temporal_patch_size}): no clip could "
                              "give one temporal patch of frames; give max_frames >= "
                              f"{self.temporal_patch_size}")
