"""Qwen3-VL's data rules (``configs/preprocess_qwen3_vl.yaml``) against transformers' own
``Qwen3VLProcessor`` (the published replica's, ``AutoProcessor``) and ``Qwen3VLModel``'s
``get_rope_index``:

- the frame sampling (``sampling: qwen3_vl``: ``np.linspace`` over the clip) and the resize
  of the whole sampled clip equal its video processor's, from the metadata alone;
- each video as its processor writes it (``timestamps``): the clip between the wrap tokens,
  inside it per temporal patch ``<t seconds>`` and that patch's tokens between wrap tokens;
  input ids, trained tokens and token counts equal the processor's through the chat template
  for an image, a video, both, two images, several turns and text only;
- the decoded pixels (uint8, normalized on the encoder's side) and grids equal the processor's;
- M-RoPE positions equal ``get_rope_index`` (each temporal patch an image of its own), padded
  and packed; a metadata-only preprocessor (language ranks) gives the same ids and positions.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from mimo_data.errors import ConfigError
from mimo_data.inspect.sample import _frame_times_line
from mimo_data.modalities.image import normalize_pixels
from mimo_data.modalities.video import (
    VIDEO, VideoConfig, normalize_video_pixels, patch_timestamps, sample_indices,
    video_grid_thw)
from mimo_data.preprocess.chat_tokens import ItemTokens
from mimo_data.preprocess.collate import Collator
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor

from conftest import REPO
from support.qwen_media import (PHOTOS, TOOL_USE, Conversations, media_bytes, tool_use_messages,
                                turns)
from support.qwen_media import processor as processor_of
from support.qwen_media import records as records_of
from support.qwen_media import reference as reference_of

REPLICA = REPO / "assets" / "models" / "published" / "Qwen--Qwen3-VL-2B-Instruct"
CONFIG = REPO / "configs" / "preprocess_qwen3_vl.yaml"

# key -> turns (markers lead each content) and the media, in marker order
CONVERSATIONS: Conversations = {
    "image": (turns("<image>\nWhat animal is this?", "A cat."), ["chelsea.jpg"]),
    "video": (turns("<video>\nWhat moves?", "The camera pans across a person."),
              ["pan_h264_24"]),
    "mixed": (turns("<image><video>\nSame scene?", "No: a cat, then a camera zooming."),
              ["chelsea.jpg", "zoom_mpeg4_10"]),
    "two-images": (turns("<image><image>\nCompare them.", "A cat and a camera."),
                   ["chelsea.jpg", "camera.png"]),
    "multi-turn": (turns("<video>\nWhat is shown?", "A turned clip.",
                         "<image>\nAnd here?", "A camera."), ["rotated_h264_24", "camera.png"]),
    "text": (turns("What is a tar file?", "An archive."), []),
    # a system turn before a clip; two clips in one turn between two images
    "system-video": ([{"role": "system", "content": "You describe clips briefly."},
                      *turns("<video>\nWhat moves?", "A cat, closer.")], ["zoom_mpeg4_10"]),
    "two-videos": (turns("<image><video><video><image>\nWhich differ?", "The clips."),
                   ["chelsea.jpg", "pan_h264_24", "zoom_mpeg4_10", "camera.png"]),
}


@pytest.fixture(scope="module")
def config() -> PreprocessConfig:
    return PreprocessConfig.from_yaml(str(CONFIG))


@pytest.fixture(scope="module")
def processor():
    return processor_of(REPLICA)


@pytest.fixture(scope="module")
def media(corpus, corpus_videos) -> dict[str, bytes]:
    return media_bytes(corpus, corpus_videos)


@pytest.fixture(scope="module")
def records(media) -> dict[str, tuple[dict, dict]]:
    """key -> (record, member bytes)."""
    return records_of(CONVERSATIONS, media)


@pytest.fixture(scope="module")
def preprocessor(config) -> Preprocessor:
    return Preprocessor(config)


@pytest.fixture(scope="module")
def samples(preprocessor, records) -> dict:
    return {key: preprocessor(record, data) for key, (record, data) in records.items()}




@pytest.fixture(scope="module")
def reference(processor, records, media) -> dict:
    """key -> the processor's output for the conversation through its chat template (media
    first in each content, as the template takes typed parts), with the video metadata."""
    return {key: reference_of(processor, CONVERSATIONS[key][1], record, media)
            for key, (record, _) in records.items()}


def test_input_ids_masks_and_counts_equal_the_processors(preprocessor, records, samples,
                                                         reference, processor):
    tokenizer = processor.tokenizer
    for key, (record, _) in records.items():
        text = preprocessor.text_batch([record])[0]
        expected = reference[key]["input_ids"][0]
        assert text.ids.tolist() == expected.tolist(), key
        # trained: each answer and the <|im_end|> after it, nothing else (no placeholder,
        # wrap or timestamp)
        trained = text.loss_mask
        runs = np.split(np.arange(len(trained)), np.flatnonzero(np.diff(trained.astype(int))) + 1)
        answers = [tokenizer.decode(text.ids[1:][run]) for run in runs if trained[run[0]]]
        assert answers == [m["content"] + "<|im_end|>" for m in record["messages"]
                           if m["role"] == "assistant"], key
        for modality, grids in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
            counts = (reference[key][grids].prod(-1) // 4).tolist() if grids in reference[key] \
                else []
            assert samples[key].token_counts[modality] == counts, key
            token = preprocessor.text.modality_token_ids[modality]
            assert int((expected == token).sum()) == sum(counts), key


def test_tool_use_trains_each_answer_with_its_calls(preprocessor, processor):
    """Qwen3-VL's published template (no generation blocks: each answer's span is what it
    adds to the generation prompt) writes a function-calling conversation as transformers'
    processor does with the tools (input ids equal); trained: each answer with its calls and
    <|im_end|>, the text the published template adds after its generation prompt; the tools'
    turns and the tools nowhere. (Without the reasoning, which this template does not read
    from ``reasoning_content``.)"""
    from mimo_data.inspect.stats import SampleInspector
    from mimo_data.shards.records import normalize_messages, tool_lists

    def unreasoned(turns):
        return [{k: v for k, v in turn.items() if k != "reasoning_content"} for turn in turns]
    messages = normalize_messages(unreasoned(TOOL_USE["messages"]), tool_lists(TOOL_USE))
    theirs, tools = unreasoned(tool_use_messages()), TOOL_USE["tools"]
    tokenizer = processor.tokenizer
    text = processor.apply_chat_template(theirs, tools=tools, tokenize=False)
    sample = preprocessor.text_batch([{"key": "tools", "media": [], "messages": messages}])[0]
    assert sample.ids.tolist() == tokenizer(text)["input_ids"]
    expected = []
    for i, message in enumerate(theirs):
        if message["role"] == "assistant":
            prompt = processor.apply_chat_template(theirs[:i], tools=tools, tokenize=False,
                                                   add_generation_prompt=True)
            written = processor.apply_chat_template(theirs[:i + 1], tools=tools,
                                                    tokenize=False)[len(prompt):]
            expected.append(written[:written.index("<|im_end|>") + len("<|im_end|>")])
    assert sum("<tool_call>" in answer for answer in expected) == 2, expected
    trained = sample.loss_mask
    runs = np.split(np.arange(len(trained)), np.flatnonzero(np.diff(trained.astype(int))) + 1)
    assert [tokenizer.decode(sample.ids[1:][run]) for run in runs if trained[run[0]]] == \
        expected
    # the inspector finds the calls trained, in JSON (a key and a value JSON escapes aside)
    stats, _ = SampleInspector(preprocessor.config)(
        0, {"key": "tools", "media": [], "messages": messages})
    assert stats.dropped is None and stats.coverage_problems == [], stats.coverage_problems


def test_videos_carry_the_processors_timestamps(records, reference, processor, config,
                                                preprocessor):
    video = config.modalities["video"]
    record = records["video"][0]
    item = record["media"][0]
    indices = sample_indices(item["frames"], item["fps"], video)
    theirs = processor._calculate_timestamps(indices, item["fps"], video.temporal_patch_size)
    assert patch_timestamps(item["frames"], item["fps"], video) == theirs
    texts = VIDEO.placeholder_texts(item, video)   # type: ignore[arg-type]
    assert texts == tuple(f"<{t:.1f} seconds>" for t in theirs)
    assert len(texts) == int(reference["video"]["video_grid_thw"][0, 0]) > 1
    decoded = processor.tokenizer.decode(reference["video"]["input_ids"][0])
    assert decoded.count("<|vision_start|>") == len(texts) + 1
    assert all(text + "<|vision_start|>" in decoded for text in texts)
    # the clip's span (a too_long drop's share of its videos): the processor's, first wrap to
    # last, timestamps included
    ids = reference["video"]["input_ids"][0].tolist()
    start, end = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    span = len(ids) - ids[::-1].index(end) - ids.index(start)
    tokens = int(reference["video"]["video_grid_thw"].prod()) // 4
    assert preprocessor.text.span(ItemTokens("video", tokens, texts)) == span > tokens + 2
    # an image's span: its placeholders and the two wraps around them, as the processor's
    pictured = reference["image"]["input_ids"][0].tolist()
    image_span = len(pictured) - pictured[::-1].index(end) - pictured.index(start)
    image_tokens = int(reference["image"]["image_grid_thw"].prod()) // 4
    assert preprocessor.text.span(ItemTokens("image", image_tokens)) == image_span
    # which a sample too long, most of it that span, is told to shorten (its placeholders
    # alone, fewer than half its tokens, would not say so)
    from mimo_data.preprocess.preprocessor import SampleDropped
    short = dataclasses.replace(config, seq_length=len(ids) - 2)
    assert 2 * tokens < short.seq_length < 2 * span
    with pytest.raises(SampleDropped, match="of them its videos': lower modalities.video fps"):
        Preprocessor(short, with_media=False)(record)
    # mimo-inspect's line shows the sampled frames and these timestamps
    assert _frame_times_line(item, config).endswith("timestamps " + " ".join(texts))
    # a ten-minute clip's hundreds of frames and timestamps are abridged: its first and last
    long = {**item, "frames": 3000, "fps": 5.0}
    times, texts = VIDEO.frame_times(long, video), VIDEO.placeholder_texts(long, video)
    assert len(times) == 2 * len(texts) > 100
    assert _frame_times_line(long, config) == (
        f"frames at {' '.join(f'{t:.2f}' for t in times[:16])} ... "
        f"{' '.join(f'{t:.2f}' for t in times[-4:])} s ({len(times)} sampled), timestamps "
        f"{' '.join(texts[:16])} ... {' '.join(texts[-4:])}")
    plain = dataclasses.replace(video, timestamps=False)
    assert VIDEO.placeholder_texts(item, plain) == ()      # type: ignore[arg-type]


def test_pixels_and_grids_equal_the_processors(samples, reference, config, processor, media):
    from PIL import Image, ImageOps
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    published = processor.image_processor
    pillow = Qwen2VLImageProcessorPil(
        patch_size=published.patch_size, merge_size=published.merge_size,
        temporal_patch_size=published.temporal_patch_size, size=dict(published.size),
        image_mean=published.image_mean, image_std=published.image_std)
    pictures = {key: [ImageOps.exif_transpose(Image.open(io.BytesIO(media[name]))).convert("RGB")
                      for name in CONVERSATIONS[key][1] if name in PHOTOS]
                for key in CONVERSATIONS}
    for key in ("mixed", "multi-turn", "video", "system-video", "two-videos"):
        inputs, theirs = samples[key].encoder_inputs, reference[key]
        video = inputs["video"]
        assert video["pixel_values_videos"].dtype == torch.uint8
        assert torch.equal(video["video_grid_thw"], theirs["video_grid_thw"]), key
        assert torch.equal(normalize_video_pixels(video["pixel_values_videos"],
                                                  config.modalities["video"]),
                           theirs["pixel_values_videos"]), key
        if "image" in inputs:
            # the published processor's grids, and the pixels of its Pillow backend, which
            # mimo's images follow (its torchvision backend resizes a level or two apart)
            image = inputs["image"]
            assert torch.equal(image["image_grid_thw"], theirs["image_grid_thw"]), key
            pixels = pillow(images=pictures[key], return_tensors="pt")["pixel_values"]
            assert torch.equal(normalize_pixels(image["pixel_values"],
                                                config.modalities["image"]), pixels), key


# ------------------------------------------------------------------- sampling and resize

SAMPLING_GRID = [(total, fps) for fps in (10, 23.976, 24, 25, 30, 60)
                 for total in (2, 3, 5, 17, 30, 49, 75, 506, 1213, 8000, 30000)]


@pytest.mark.parametrize("changes", [{}, {"fps": 1.0, "min_frames": 2, "max_frames": 64},
                                     {"cap_pixels_per_frame": True, "max_video_tokens": 20}])
def test_sampling_and_grids_equal_the_video_processors(processor, config, changes):
    from transformers import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    video = dataclasses.replace(config.modalities["video"], **changes)
    theirs = Qwen3VLVideoProcessor(
        patch_size=video.patch_size, temporal_patch_size=video.temporal_patch_size,
        merge_size=video.merge_size, fps=video.fps, min_frames=video.min_frames,
        max_frames=video.max_frames, cap_pixels_per_frame=video.cap_pixels_per_frame,
        max_video_tokens=video.max_video_tokens, image_mean=list(video.mean),
        image_std=list(video.std),
        size={"shortest_edge": video.min_pixels, "longest_edge": video.max_pixels})
    assert processor.video_processor.fps == config.modalities["video"].fps
    for total, fps in SAMPLING_GRID:
        indices = theirs.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)).tolist()
        assert sample_indices(total, fps, video) == indices, (total, fps)
        for width, height in ((128, 96), (96, 128), (1920, 1080), (33, 700), (20, 20)):
            t, h, w = video_grid_thw(total, fps, width, height, video)
            patches = theirs.get_num_of_video_patches(len(indices), height, width)
            assert t == -(-len(indices) // video.temporal_patch_size)
            assert t * h * w == patches, (total, fps, width, height)
    # a clip of one frame cannot fill a temporal patch: too short, as for Qwen2-VL
    item = {"member": "vid0.mp4", "frames": 1, "fps": 10.0, "width": 64, "height": 64,
            "duration": 0.1}
    with pytest.raises(Exception) as caught:
        VIDEO.item_tokens(item, video)                      # type: ignore[arg-type]
    assert getattr(caught.value, "reason", None) == "video_too_short"


# ------------------------------------------------------------------------------- positions

@pytest.fixture(scope="module")
def rope_model():
    """transformers' model class, for its ``get_rope_index``."""
    from transformers import AutoConfig, Qwen3VLModel
    config = AutoConfig.from_pretrained(str(REPLICA))     # the replica's tiny sizes
    return Qwen3VLModel(config)


def _rope_index(model, batch, tokens) -> torch.Tensor:
    ids = batch["input_ids"]
    inputs = batch["modality_inputs"]
    grids = {f"{m}_grid_thw": inputs[m][m][f"{m}_grid_thw"] for m in ("image", "video")
             if m in inputs}
    kinds = (ids == tokens["image"]).int() + 2 * (ids == tokens["video"]).int()
    positions, _ = model.get_rope_index(ids, mm_token_type_ids=kinds,
                                        attention_mask=batch["attention_mask"].long(), **grids)
    return positions


def test_mrope_positions_equal_get_rope_index_padded_and_packed(preprocessor, samples,
                                                                rope_model):
    rows = list(samples.values())
    padded, _ = Collator(preprocessor)(rows)
    tokens = preprocessor.text.modality_token_ids
    expected = _rope_index(rope_model, padded, tokens)
    real = padded["attention_mask"]
    assert torch.equal(padded["position_ids"][:, real], expected[:, real])
    # each temporal patch is its own image: a video's time positions are not one per patch
    # on a shared start, and no text position lies between a patch and the next
    video = samples["video"]
    at = video.input_ids == tokens["video"]
    assert len(set(video.position_ids[0][at].tolist())) == \
        int(video.encoder_inputs["video"]["video_grid_thw"][0, 0])
    packed, _ = Collator(preprocessor, packed=True)(rows)
    per_row = [expected[:, row, real[row]] for row in range(len(rows))]
    assert torch.equal(packed["position_ids"][:, 0], torch.cat(per_row, dim=1))


def test_language_ranks_build_the_same_without_decoding(config, records, samples):
    metadata_only = Preprocessor(config, with_media=False)
    for key, (record, _) in records.items():
        sample = metadata_only(record, None)
        assert sample.encoder_inputs == {}
        assert torch.equal(sample.input_ids, samples[key].input_ids), key
        assert torch.equal(sample.position_ids, samples[key].position_ids), key


# ---------------------------------------------------------------------------------- config

def test_config_keys_default_to_qwen2_vl_and_are_checked():
    assert (VideoConfig().sampling, VideoConfig().timestamps) == ("qwen2_vl", False)
    with pytest.raises(ConfigError, match="sampling is 'qwen4': use qwen2_vl or qwen3_vl"):
        VideoConfig(sampling="qwen4").validate()
    with pytest.raises(ConfigError, match="timestamps .* give wrap too"):
        VideoConfig(timestamps=True).validate()
    with pytest.raises(ConfigError, match="drop tokens_per_second"):
        VideoConfig(timestamps=True, wrap=("<a>", "<b>"), tokens_per_second=2.0).validate()
