"""The video modality, one module per job:

- ``config``: ``VideoConfig``, the ``modalities.video`` section;
- ``decode``: PyAV (its wheel bundles FFmpeg): probing at build time, decoding sampled frames;
- ``frames``: a video given as a folder of JPEG frames, made one clip of them at build time;
- ``sampling``: the table of the video processors' rules by family (``SAMPLINGS``, keyed by
  ``modalities.video.sampling``): how many frames, which ones, at which size; the timestamps;
- ``geometry``: the token grid and the M-RoPE time step of a clip from its metadata alone;
- ``encoder_inputs``: decoded frames → the processor's patches (uint8) and their float step;
- ``modality``: ``VideoModality`` (``VIDEO``), the ``Modality`` interface over them.

The encoder inputs follow transformers' ``Qwen2VLVideoProcessor`` with its own frame sampling
(``do_sample_frames=True`` and ``fps``), or with ``sampling: qwen3_vl`` its
``Qwen3VLVideoProcessor``; the tests check them against the processors.
"""

from mimo_data.modalities.video.config import MAX_VIDEO_SECONDS, VideoConfig
from mimo_data.modalities.video.decode import (VIDEO_CODECS, VIDEO_EXTENSIONS, decode_frames,
                                               decode_video, probe_video)
from mimo_data.modalities.video.encoder_inputs import (normalize_video_pixels, patchify_video,
                                                       resize_frames, video_encoder_inputs,
                                                       video_rows_to_tokens)
from mimo_data.modalities.video.geometry import (seconds_per_grid, video_grid_thw,
                                                 video_time_interval, video_token_grid,
                                                 video_tokens)
from mimo_data.modalities.video.modality import VIDEO, VideoModality
from mimo_data.modalities.video.sampling import (SAMPLINGS, FrameSampling, patch_timestamps,
                                                 sample_indices, sampled_frame_count,
                                                 timestamp_texts, video_resized_size)

__all__ = ["MAX_VIDEO_SECONDS", "SAMPLINGS", "VIDEO", "VIDEO_CODECS", "VIDEO_EXTENSIONS",
           "FrameSampling", "VideoConfig", "VideoModality", "decode_frames", "decode_video",
           "normalize_video_pixels", "patch_timestamps", "patchify_video", "probe_video",
           "resize_frames", "sample_indices", "sampled_frame_count", "seconds_per_grid",
           "timestamp_texts", "video_encoder_inputs", "video_grid_thw", "video_resized_size",
           "video_rows_to_tokens", "video_time_interval", "video_token_grid", "video_tokens"]
