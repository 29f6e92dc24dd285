"""The workload of one clip for the layout advisor (``mimo-inspect plan --clip-seconds S --fps F
--model M --gpus N``, no dataset): which layouts fit a sample of one clip of S seconds whose
encoder sees F frames a second, and a short prompt.

The sample is what the preprocessor (metadata only, as the token table) makes of a record of
one user turn ``<video>`` + ``PROMPT`` and a short answer (``ANSWER``), the clip's metadata
being S x F frames of ``--clip-size`` (default 1280x720) at F fps: the chat template, the wrap
tokens, Qwen3-VL's timestamp texts, the video's placeholders. Its frames follow the
preprocessing config's ``modalities.video`` with two changes: ``fps`` is F and ``max_frames``
(and ``max_duration``) hold the whole clip, so every one of the S x F frames is sampled; the
frame size follows the config's pixel bounds (``min_pixels`` / ``max_pixels``: per frame for
Qwen2-VL's processor, over all the clip's frames for Qwen3-VL's, whose default budget of
25165824 pixels makes a long clip's frames small; raise ``max_pixels`` in the config for
more). Tokens: frames grouped by ``temporal_patch_size``, each group (h / patch / merge) x
(w / patch / merge) tokens of the resized frame. The config's ``seq_length`` is raised to the
sample's length (the workload's ``seq_length`` is the sample's: training it needs that much).
``clip`` also says what the config as written would sample (``config_frames``, under its
``max_frames``) and its ``max_duration``, past which it drops the clip.

The workload is ``workload.workload``'s form with one step of ``global_batch_size`` copies of
the sample, and ``clip``: what the clip became (frames, sizes, token grid, tokens)."""

from __future__ import annotations

from dataclasses import replace

from mimo_data.errors import ConfigError
from mimo_data.inspect.workload import reference_layout
from mimo_data.modalities.video import (sampled_frame_count, video_resized_size,
                                        video_token_grid)
from mimo_data.preprocess.config import PreprocessConfig

CLIP_SIZE = (1280, 720)               # --clip-size: width, height of the source frames
PROMPT = "Describe the video."        # the user's text after the clip
ANSWER = "A short description of the video."


def clip_config(config: PreprocessConfig, seconds: float, fps: float) -> PreprocessConfig:
    """``config`` whose video processor samples every frame of a clip of ``seconds`` at ``fps``
    (its fps, max_frames and max_duration changed), with no length limit."""
    video = config.modalities.get("video")
    if video is None:
        raise ConfigError("--clip-seconds: the preprocessing config has no modalities.video")
    frames = clip_frames(seconds, fps)
    video = replace(video, fps=fps, max_frames=max(video.max_frames, frames),
                    min_frames=min(video.min_frames, frames),
                    max_duration=max(video.max_duration, seconds))
    video.validate()
    return replace(config, modalities={**config.modalities, "video": video},
                   seq_length=2**31 - 1)


def clip_frames(seconds: float, fps: float) -> int:
    """Frames of a clip of ``seconds`` at ``fps`` (at least one temporal patch's worth is the
    processor's to check)."""
    return max(1, round(seconds * fps))


def clip_workload(config: PreprocessConfig, seconds: float, fps: float,
                  size: tuple[int, int] = CLIP_SIZE, global_batch_size: int = 1,
                  micro_batch_size: int = 1, packing: bool = False) -> dict:
    """The workload of ``global_batch_size`` samples of one clip each (the module
    docstring), packed (``data.packing``) or not."""
    from mimo_data.preprocess.preprocessor import Preprocessor, SampleDropped
    clipped = clip_config(config, seconds, fps)
    video = clipped.modalities["video"]
    frames = clip_frames(seconds, fps)
    if frames < video.temporal_patch_size:
        raise ConfigError(f"--clip-seconds {seconds:g} at --fps {fps:g} (the frames a second "
                          f"the encoder sees) is {frames} frame(s), fewer than one temporal "
                          f"patch ({video.temporal_patch_size} frames): raise --fps or "
                          "--clip-seconds")
    width, height = size
    item = {"modality": "video", "member": "vid0.mp4", "format": "mp4", "bytes": 0,
            "width": width, "height": height, "rotation": 0, "fps": fps, "frames": frames,
            "duration": frames / fps}
    record = {"key": "clip", "id": None, "source": {"file": "clip", "index": 0},
              "messages": [{"role": "user", "content": f"<video>\n{PROMPT}"},
                           {"role": "assistant", "content": ANSWER}],
              "media": [item]}
    preprocessor = Preprocessor(clipped, with_media=False)
    text = preprocessor.text_batch([record])[0]
    if isinstance(text, SampleDropped):
        raise ValueError(f"a clip of {seconds:g} s at {fps:g} fps, {width}x{height}: "
                         f"{text.reason}: {text.detail}")
    grid = list(video_token_grid(frames, fps, width, height, video))
    modalities = dict(reference_layout(config).modalities)
    tokens, counts = len(text.ids) - 1, list(text.token_counts["video"])
    sample = {"tokens": tokens, "trained": int(text.loss_mask.sum()),
              "items": {"video": counts}, "grids": {"video": [grid]}}
    resized = video_resized_size(width, height, frames, video)
    # what the config as written would do with the clip: fewer frames under its max_frames,
    # or none past its max_duration
    written = replace(config.modalities["video"], fps=fps)
    return {"global_batch_size": global_batch_size, "micro_batch_size": micro_batch_size,
            "seq_length": tokens, "packing": packing, "epochs": 1,
            "vocab_size": preprocessor.text.vocab_size, "modalities": modalities,
            "steps": [[sample] * global_batch_size],
            "clip": {"seconds": seconds, "fps": fps, "frames": frames, "size": [width, height],
                     "resized": list(resized), "grid": grid,
                     "video_tokens": counts[0], "tokens": tokens,
                     "seq_length": config.seq_length,
                     "config_frames": sampled_frame_count(frames, fps, written),
                     "sampled_frames": sampled_frame_count(frames, fps, video),
                     "config_max_frames": written.max_frames,
                     "config_max_duration": written.max_duration}}
