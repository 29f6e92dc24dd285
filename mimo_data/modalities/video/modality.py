"""The video modality: ``Modality``'s interface over the decode, sampling, geometry and
encoder-input modules of this package."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any, TYPE_CHECKING

import numpy as np
from PIL import Image

from mimo_data.modalities.base import (MediaError, MediaItem, Modality, item_name,
                                       take_grid_rows)
from mimo_data.modalities.video.config import VideoConfig
from mimo_data.modalities.video.decode import (VIDEO_EXTENSIONS, decode_frames, decode_video,
                                               probe_video)
from mimo_data.modalities.video.encoder_inputs import video_encoder_inputs, video_rows_to_tokens
from mimo_data.modalities.video.geometry import (token_grid_or_error, video_time_interval,
                                                 video_tokens)
from mimo_data.modalities.video.sampling import ClipTooShort, sample_indices, timestamp_texts

if TYPE_CHECKING:     # torch is imported where used: metadata commands start without it
    import torch

THUMBNAIL = (160, 160)
PREVIEW_FRAMES = 4


class VideoModality(Modality):
    name = "video"
    marker = "<video>"
    member_prefix = "vid"
    extensions = VIDEO_EXTENSIONS
    config_class = VideoConfig
    libraries = ("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
                 "transformers.models.qwen3_vl.video_processing_qwen3_vl")
    item_fields = ("member", "width", "height", "rotation", "fps", "frames", "duration")
    verified_fields = ("format", "codec", "width", "height", "rotation", "fps", "frames")
    summary_fields = {"width": "int32", "height": "int32", "duration": "float64"}
    ansi_color = "\033[1;33m"
    html_color = "#bf8700"
    takes_parts = True

    def probe(self, data: bytes, check: str, max_image_pixels: int) -> dict[str, Any]:
        """``probe_video``, a frame above ``max_image_pixels`` refused as an image is: each
        sampled frame is decoded whole before it is resized (GBs a clip, on the tower's rank)."""
        found = probe_video(data, check)
        if found["width"] * found["height"] > max_image_pixels:
            raise MediaError("video_too_large", f"{found['width']}x{found['height']} = "
                             f"{found['width'] * found['height']} pixels a frame is above the "
                             f"limit of {max_image_pixels}")
        return found

    def decoded_metadata(self, data: bytes) -> dict[str, Any]:
        return probe_video(data, "decode", max_seconds=math.inf)

    def tokens(self, item: Mapping[str, Any], config: VideoConfig) -> int:
        return video_tokens(item["frames"], item["fps"], item["width"], item["height"], config)

    def item_tokens(self, item: MediaItem, config: VideoConfig) -> int:
        if item["duration"] > config.max_duration:
            raise MediaError("video_too_long", f"{item_name(item)} lasts {item['duration']} s, "
                             f"above max_duration {config.max_duration} s")
        grid = token_grid_or_error(item["frames"], item["fps"], item["width"], item["height"],
                                   config)
        if isinstance(grid, ValueError):
            reason = "video_too_short" if isinstance(grid, ClipTooShort) else "bad_video_shape"
            raise MediaError(reason, f"{item_name(item)}: {grid}")
        return grid[0] * grid[1] * grid[2]

    def token_grid(self, item: Mapping[str, Any], config: VideoConfig) -> tuple[int, int, int]:
        grid = token_grid_or_error(item["frames"], item["fps"], item["width"], item["height"],
                                   config)
        if isinstance(grid, ValueError):
            raise grid
        return grid

    def time_interval(self, item: Mapping[str, Any], config: VideoConfig) -> float:
        return video_time_interval(item["frames"], item["fps"], config)

    def variable_tokens(self, config: VideoConfig) -> bool:
        return True

    def frame_times(self, item: Mapping[str, Any], config: VideoConfig) -> list[float]:
        """``sample_indices`` over the average frame rate: frame i is shown at i / fps."""
        return [index / item["fps"] for index in
                sample_indices(item["frames"], item["fps"], config)]

    def placeholder_texts(self, item: Mapping[str, Any], config: VideoConfig
                          ) -> tuple[str, ...]:
        return timestamp_texts(item["frames"], item["fps"], config)

    def decode(self, data: bytes, item: MediaItem, config: VideoConfig) -> np.ndarray:
        return decode_video(data, item, config)

    def encoder_inputs(self, decoded: list, config: VideoConfig) -> dict[str, torch.Tensor]:
        return video_encoder_inputs(decoded, config)

    def rows_to_tokens(self, inputs: dict[str, torch.Tensor], config: VideoConfig) -> list[int]:
        return video_rows_to_tokens(inputs, config)

    def cut_units(self, item: Mapping[str, Any], config: VideoConfig) -> int:
        """Its temporal patches: ``pixel_values_videos`` rows are t-major."""
        return self.token_grid(item, config)[0]

    def take(self, inputs: dict[str, torch.Tensor], config: VideoConfig,
             pieces: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        pixels, grids = take_grid_rows(inputs["pixel_values_videos"], inputs["video_grid_thw"],
                                       pieces)
        return {"pixel_values_videos": pixels, "video_grid_thw": grids}

    def describe(self, item: Mapping[str, Any]) -> str:
        # a rotated clip's size is as displayed, its rotation said (transformers' readers
        # take the stored frames: the transposed grid, docs/vlms-and-video.md)
        rotated = f", rotated {item['rotation']}°" if item.get("rotation") else ""
        return (f"{item.get('width')}x{item.get('height')} {item.get('codec', '')} "
                f"{item.get('fps', 0):.3g} fps {item.get('duration', 0):.2f} s"
                f"{rotated}").replace("  ", " ")

    def preview_png(self, data: bytes, item: Mapping[str, Any], config: VideoConfig
                    ) -> tuple[bytes, str]:
        frames = item["frames"]
        indices = sorted({round(i * (frames - 1) / max(1, PREVIEW_FRAMES - 1))
                          for i in range(min(PREVIEW_FRAMES, frames))})
        pictures = [Image.fromarray(frame) for frame in
                    decode_frames(data, indices, item.get("rotation", 0))]
        problem = ""
        size = (pictures[0].width, pictures[0].height)
        if size != (item.get("width"), item.get("height")):
            problem = (f"decodes to {size[0]}x{size[1]}, the metadata says "
                       f"{item.get('width')}x{item.get('height')}")
        for picture in pictures:
            picture.thumbnail(THUMBNAIL)
        strip = Image.new("RGB", (sum(p.width for p in pictures) + 4 * (len(pictures) - 1),
                                  max(p.height for p in pictures)), (255, 255, 255))
        left = 0
        for picture in pictures:
            strip.paste(picture, (left, 0))
            left += picture.width + 4
        buffer = io.BytesIO()
        strip.save(buffer, format="PNG")
        return buffer.getvalue(), problem


VIDEO = VideoModality()
