"""Qwen3.5's data rules (``configs/preprocess_qwen3_5.yaml``) against transformers' own processor
of the published replicas (``AutoProcessor``: ``Qwen3VLProcessor``, as Qwen3.5's
preprocessor_config.json names it) and ``Qwen3_5Model`` / ``Qwen3_5MoeModel``'s
``get_rope_index``:

- input ids and token counts equal the processor's through the published chat template for an
  image, a video, both, two images, a system turn, several turns and text only (the dense
  replica; the MoE replica, whose files are the same, for one conversation);
- the training template (``mimo_data/preprocess/templates/qwen3_5.jinja``) renders the published
  template's text character for character, tool calls and reasoning included; the published
  template itself places no loss in a conversation of several turns (its earlier turns lose
  their think block): given (a config written by hand), mimo renders through its copy, and
  the same template edited by a character drops such a sample as ``template_mismatch``;
- trained: in each turn after the last user query what follows the template's generation
  prompt (``<think>\\n``): the closing ``</think>``, the answer and ``<|im_end|>``; in earlier
  turns the answer and ``<|im_end|>``;
- videos: the frame sampling, the resize and the ``<t seconds>`` timestamps are the replica's
  video processor's (Qwen3-VL's ``Qwen3VLVideoProcessor``, its published settings); the decoded
  pixels and grids are the processor's;
- M-RoPE positions equal ``get_rope_index`` (each temporal patch an image of its own), padded
  and packed; a metadata-only preprocessor (language ranks) gives the same ids and positions.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mimo_data.modalities.image import normalize_pixels
from mimo_data.modalities.video import (
    VIDEO, normalize_video_pixels, patch_timestamps, sample_indices, video_grid_thw)
from mimo_data.preprocess.collate import Collator
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.preprocessor import Preprocessor

from conftest import REPO
from support.qwen_media import (PHOTOS, TOOL_USE, Conversations, media_bytes, tool_use_messages,
                                turns, typed)
from support.qwen_media import processor as processor_of
from support.qwen_media import records as records_of
from support.qwen_media import reference as reference_of

PUBLISHED = REPO / "assets" / "models" / "published"
REPLICA = PUBLISHED / "Qwen--Qwen3.5-4B"
MOE_REPLICA = PUBLISHED / "Qwen--Qwen3.5-35B-A3B"
CONFIG = REPO / "configs" / "preprocess_qwen3_5.yaml"

# key -> turns (markers lead each content) and the media, in marker order
CONVERSATIONS: Conversations = {
    "image": (turns("<image>\nWhat animal is this?", "A cat."), ["chelsea.jpg"]),
    "video": (turns("<video>\nWhat moves?", "The camera pans across a person."),
              ["pan_h264_24"]),
    "mixed": (turns("<image><video>\nSame scene?", "No: a cat, then a camera zooming."),
              ["chelsea.jpg", "zoom_mpeg4_10"]),
    "two-images": (turns("<image><image>\nCompare them.", "A cat and a camera."),
                   ["chelsea.jpg", "camera.png"]),
    "system": ([{"role": "system", "content": "Answer in three words."},
                *turns("<image>\nWhat is it?", "A grey cat.")], ["chelsea.jpg"]),
    "multi-turn": (turns("<video>\nWhat is shown?", "A turned clip.",
                         "<image>\nAnd here?", "A camera.", "Which came first?",
                         "The clip."), ["rotated_h264_24", "camera.png"]),
    "text": (turns("What is a tar file?", "An archive."), []),
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
    return {key: reference_of(processor, CONVERSATIONS[key][1], record, media)
            for key, (record, _) in records.items()}


def _trained_texts(tokenizer, ids: np.ndarray, trained: np.ndarray) -> list[str]:
    runs = np.split(np.arange(len(trained)), np.flatnonzero(np.diff(trained.astype(int))) + 1)
    return [tokenizer.decode(ids[run]) for run in runs if len(run) and trained[run[0]]]


def test_input_ids_and_counts_equal_the_processors(preprocessor, records, samples, reference):
    for key, (record, _) in records.items():
        expected = reference[key]["input_ids"][0]
        assert preprocessor.text_batch([record])[0].ids.tolist() == expected.tolist(), key
        # the training sample's inputs: every token but the last (labels: the next tokens)
        assert samples[key].input_ids.tolist() == expected[:-1].tolist(), key
        for modality, grids in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
            counts = (reference[key][grids].prod(-1) // 4).tolist() if grids in reference[key] \
                else []
            assert samples[key].token_counts[modality] == counts, key
            token = preprocessor.text.modality_token_ids[modality]
            assert int((expected == token).sum()) == sum(counts), key


def test_a_conversation_of_typed_parts_gives_the_processors_ids(preprocessor, processor,
                                                                 media):
    """A record in transformers' chat form (each content typed parts: an image, text, a
    video; a call whose tool answers with an image, a screenshot say) is built into the text
    the processor's template writes from those parts: input ids equal the processor's for the
    same messages."""
    from mimo_data.shards.records import normalize_messages
    turns = [{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "What is this, "},
                {"type": "video"}, {"type": "text", "text": "and that?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A closer look."}],
              "tool_calls": [{"type": "function", "function": {"name": "zoom",
                                                               "arguments": {"x": 2}}}]},
             {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "x2"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A cat, a pan."}]}]
    messages = normalize_messages(turns)
    assert messages[0]["content"] == "<image>What is this, <video>and that?"
    names = ["chelsea.jpg", "pan_h264_24", "camera.png"]
    record, data = records_of({"parts": (messages, names)}, media)["parts"]
    theirs = reference_of(processor, names, {**record, "messages": turns}, media,
                          typed_already=True)
    assert preprocessor(record, data).input_ids.tolist() == \
        theirs["input_ids"][0][:-1].tolist()


def test_the_moe_repository_gives_the_same(config, records, media):
    """The MoE replica's own tokenizer and processor (its files are the dense one's)."""
    moe = dataclasses.replace(config, tokenizer=str(MOE_REPLICA))
    record, data = records["mixed"]
    expected = reference_of(processor_of(MOE_REPLICA), CONVERSATIONS["mixed"][1], record,
                            media)["input_ids"][0]
    assert Preprocessor(moe)(record, data).input_ids.tolist() == expected[:-1].tolist()


def test_trained_tokens_are_what_the_model_writes_after_the_generation_prompt(
        preprocessor, records, processor):
    """After the last user query: the text the published template adds to its generation
    prompt (``<|im_start|>assistant\\n<think>\\n``) through ``<|im_end|>``, less the newline
    that merges with the prompt's into one token; before it: the answer and ``<|im_end|>``,
    which the template writes with no think block."""
    tokenizer = processor.tokenizer
    for key, (record, _) in records.items():
        messages = typed(record["messages"])
        text = processor.apply_chat_template(messages, tokenize=False)
        last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
        expected = []
        for i, message in enumerate(record["messages"]):
            if message["role"] != "assistant":
                continue
            if i < last_query:
                assert f"<|im_start|>assistant\n{message['content']}<|im_end|>" in text, key
                expected.append(message["content"] + "<|im_end|>")
                continue
            prompt = processor.apply_chat_template(messages[:i], tokenize=False,
                                                   add_generation_prompt=True)
            written = processor.apply_chat_template(messages[:i + 1], tokenize=False)
            assert prompt.endswith("<think>\n") and written.startswith(prompt), key
            answer = written[len(prompt):]
            answer = answer[:answer.index("<|im_end|>") + len("<|im_end|>")]
            assert answer.startswith("\n</think>\n\n"), key
            expected.append(answer[1:])
        text = preprocessor.text_batch([record])[0]     # loss_mask: of the targets ids[1:]
        assert _trained_texts(tokenizer, text.ids[1:], text.loss_mask) == expected, key


# conversations past what the corpus records hold: reasoning, tool calls and their results
TEMPLATE_CASES = {
    "reasoning": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello."}],
    "tools": [
        {"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it.",
         "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo",
                                                                       "days": [1, 2]}}}]},
        {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "Rain."}],
    "history": [{"role": "user", "content": "A?"},
                {"role": "assistant", "content": "B.", "reasoning_content": "dropped"},
                {"role": "user", "content": "C?"}, {"role": "assistant", "content": "D."}],
}


def test_the_training_template_renders_the_published_text(config, records, processor):
    tagged = Path(config.chat_template).read_text()
    assert processor.chat_template == (REPLICA / "chat_template.jinja").read_text()
    assert "{%- generation %}" in tagged and "{%- generation %}" not in processor.chat_template
    cases = {key: typed(record["messages"]) for key, (record, _) in records.items()}
    for key, messages in (cases | TEMPLATE_CASES).items():
        for prompt in ({}, {"add_generation_prompt": True},
                       {"add_generation_prompt": True, "enable_thinking": False}):
            if prompt and messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            theirs = processor.apply_chat_template(messages, tokenize=False, **prompt)
            ours = processor.apply_chat_template(messages, tokenize=False,
                                                 chat_template=tagged, **prompt)
            assert ours == theirs, (key, prompt)


def test_tool_use_trains_what_the_model_writes(config, processor):
    """A function-calling conversation as ``mimo-shard build`` writes it: its input ids are
    the published template's text with the tools, tokenized (transformers' processor, the
    calls' arguments as objects); trained in each answer is what the template adds to its
    generation prompt after the last user query (the closing </think>, the text and the calls,
    <|im_end|>), and before it the answer, its calls and <|im_end|> (the template writes the
    turn without reasoning); the tools' turns and the tools train nowhere. mimo-inspect finds
    each call trained and no problem."""
    from mimo_data.inspect.stats import SampleInspector
    from mimo_data.shards.records import normalize_messages, tool_lists
    messages = normalize_messages(TOOL_USE["messages"], tool_lists(TOOL_USE))
    record = {"key": "tools", "media": [], "messages": messages}
    theirs, tools, tokenizer = tool_use_messages(), TOOL_USE["tools"], processor.tokenizer
    text = processor.apply_chat_template(theirs, tools=tools, tokenize=False)
    assert "<function=weather>\n<parameter=city>\nBergen" in text and "rain" in text
    preprocessor = Preprocessor(config, with_media=False)
    sample = preprocessor.text_batch([record])[0]
    assert sample.ids.tolist() == tokenizer(text)["input_ids"]
    last_query = max(i for i, m in enumerate(theirs) if m["role"] == "user")
    segments = iter(text.split("<|im_start|>assistant\n")[1:])
    expected = []
    for i, message in enumerate(theirs):
        if message["role"] != "assistant":
            continue
        segment = next(segments)
        if i < last_query:
            expected.append(segment[:segment.index("<|im_end|>") + len("<|im_end|>")])
            continue
        prompt = processor.apply_chat_template(theirs[:i], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        written = processor.apply_chat_template(theirs[:i + 1], tools=tools, tokenize=False)
        assert prompt.endswith("<think>\n") and written.startswith(prompt)
        answer = written[len(prompt):]
        expected.append(answer[1:answer.index("<|im_end|>") + len("<|im_end|>")])
    assert "<tool_call>" in expected[0] and expected[1].startswith("<tool_call>"), expected
    assert _trained_texts(tokenizer, sample.ids[1:], sample.loss_mask) == expected
    stats, _ = SampleInspector(config)(0, record)
    assert stats.dropped is None and stats.coverage_problems == [], stats.coverage_problems
    assert stats.empty_answers == 0 and stats.reasoning_dropped == 1
    # a template whose generation blocks end before the calls: the inspector names each
    # answer whose call does not train
    tagged = Path(config.chat_template).read_text()
    calls = tagged.index("        {%- if message.tool_calls and message.tool_calls is iterable")
    end = "        {{- '<|im_end|>' }}\n"
    broken = tagged[:calls] + "        {%- endgeneration %}\n" + tagged[calls:].replace(
        end + "        {%- endgeneration %}", end, 1)
    stats, _ = SampleInspector(dataclasses.replace(config, chat_template=broken))(0, record)
    assert [problem.split(":")[0] for problem in stats.coverage_problems] == [
        "turn 2 (assistant)", "turn 4 (assistant)"], stats.coverage_problems
    # weather, city, Oslo; weather, city, Bergen, days (a list: not a plain string value; the
    # last key and value are ones JSON escapes)
    assert [problem.split(": ")[1] for problem in stats.coverage_problems] == [
        f"{n} of {n} characters of its tool calls (names, argument names and string values) "
        "not trained" for n in (7 + 4 + 4, 7 + 4 + 6 + 4)]


def test_several_turns_need_the_training_template(config, records, tmp_path):
    """The published template writes earlier answers without the think block its generation
    prompt opens: incremental rendering cannot place them. Given as it is published (the
    tokenizer's own, no chat_template: a config written by hand), mimo renders through its
    copy with generation blocks (the same text): a conversation of several turns is kept with
    the copy's ids and mask; a template differing from the published one (a comment added:
    the same text) is the user's own, rendered as it is: that sample is dropped, counted."""
    single, multi = records["image"][0], records["multi-turn"][0]
    copy = Preprocessor(config, with_media=False).text_batch([multi])[0]
    published = Preprocessor(dataclasses.replace(config, chat_template=None), with_media=False)
    kept = published.text_batch([multi])[0]
    assert not isinstance(kept, Exception) and np.array_equal(kept.ids, copy.ids) and \
        np.array_equal(kept.loss_mask, copy.loss_mask) and kept.loss_mask.sum() > 0
    own = tmp_path / "own.jinja"
    own.write_text("{# a copy of the user's #}" + published.text.tokenizer.chat_template)
    edited = Preprocessor(dataclasses.replace(config, chat_template=str(own)), with_media=False)
    assert not isinstance(edited.text_batch([single])[0], Exception)
    failed = edited.text_batch([multi])[0]
    assert getattr(failed, "reason", None) == "template_mismatch"


def test_videos_carry_the_processors_timestamps(records, reference, processor, config):
    video = config.modalities["video"]
    item = records["video"][0]["media"][0]
    indices = sample_indices(item["frames"], item["fps"], video)
    theirs = processor._calculate_timestamps(indices, item["fps"], video.temporal_patch_size)
    assert patch_timestamps(item["frames"], item["fps"], video) == theirs
    texts = VIDEO.placeholder_texts(item, video)
    assert texts == tuple(f"<{t:.1f} seconds>" for t in theirs)
    assert len(texts) == int(reference["video"]["video_grid_thw"][0, 0]) > 1
    decoded = processor.tokenizer.decode(reference["video"]["input_ids"][0])
    assert decoded.count("<|vision_start|>") == len(texts) + 1
    assert all(text + "<|vision_start|>" in decoded for text in texts)


def test_sampling_and_grids_equal_the_replicas_video_processor(processor, config):
    """The replica's video processor, as its published files configure it, samples and
    resizes as the config does (the config's values are the published ones)."""
    from transformers.video_utils import VideoMetadata
    theirs, video = processor.video_processor, config.modalities["video"]
    assert type(theirs).__name__ == "Qwen3VLVideoProcessor"
    assert (theirs.fps, theirs.min_frames, theirs.max_frames, theirs.do_sample_frames) == (
        video.fps, video.min_frames, video.max_frames, True)
    assert dict(theirs.size) == {"shortest_edge": video.min_pixels,
                                 "longest_edge": video.max_pixels}
    for total, fps in ((3, 24.0), (49, 23.976), (75, 25.0), (1213, 30.0), (30000, 60.0)):
        indices = theirs.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)).tolist()
        assert sample_indices(total, fps, video) == indices, (total, fps)
        for width, height in ((128, 96), (1920, 1080), (33, 700)):
            t, h, w = video_grid_thw(total, fps, width, height, video)
            assert t * h * w == theirs.get_num_of_video_patches(len(indices), height, width)


def test_pixels_and_grids_equal_the_processors(samples, reference, config, processor, media):
    from PIL import Image, ImageOps
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    published = processor.image_processor
    pillow = Qwen2VLImageProcessorPil(
        patch_size=published.patch_size, merge_size=published.merge_size,
        temporal_patch_size=published.temporal_patch_size, size=dict(published.size),
        image_mean=published.image_mean, image_std=published.image_std)
    for key in ("mixed", "multi-turn"):
        inputs, theirs = samples[key].encoder_inputs, reference[key]
        video = inputs["video"]
        assert video["pixel_values_videos"].dtype == torch.uint8
        assert torch.equal(video["video_grid_thw"], theirs["video_grid_thw"]), key
        assert torch.equal(normalize_video_pixels(video["pixel_values_videos"],
                                                  config.modalities["video"]),
                           theirs["pixel_values_videos"]), key
        # the published processor's grids, and the pixels of its Pillow backend, which
        # mimo's images follow (its torchvision backend resizes a level or two apart)
        pictures = [ImageOps.exif_transpose(Image.open(io.BytesIO(media[name]))).convert("RGB")
                    for name in CONVERSATIONS[key][1] if name in PHOTOS]
        assert torch.equal(inputs["image"]["image_grid_thw"], theirs["image_grid_thw"]), key
        pixels = pillow(images=pictures, return_tensors="pt")["pixel_values"]
        assert torch.equal(normalize_pixels(inputs["image"]["pixel_values"],
                                            config.modalities["image"]), pixels), key


# ------------------------------------------------------------------------------- positions

def _rope_index(model, batch, tokens) -> torch.Tensor:
    ids = batch["input_ids"]
    inputs = batch["modality_inputs"]
    grids = {f"{m}_grid_thw": inputs[m][m][f"{m}_grid_thw"] for m in ("image", "video")
             if m in inputs}
    kinds = (ids == tokens["image"]).int() + 2 * (ids == tokens["video"]).int()
    positions, _ = model.get_rope_index(ids, mm_token_type_ids=kinds,
                                        attention_mask=batch["attention_mask"].long(), **grids)
    return positions


@pytest.mark.parametrize("replica", [REPLICA, MOE_REPLICA], ids=["dense", "moe"])
def test_mrope_positions_equal_get_rope_index_padded_and_packed(preprocessor, samples, replica):
    from transformers import AutoConfig, AutoModel
    model = AutoModel.from_config(AutoConfig.from_pretrained(str(replica)))
    assert type(model).__name__ in ("Qwen3_5Model", "Qwen3_5MoeModel")
    rows = list(samples.values())
    padded, _ = Collator(preprocessor)(rows)
    tokens = preprocessor.text.modality_token_ids
    expected = _rope_index(model, padded, tokens)
    real = padded["attention_mask"]
    assert torch.equal(padded["position_ids"][:, real], expected[:, real])
    # each temporal patch is its own image: a video's time positions are not one per patch
    # on a shared start
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
        assert torch.equal(sample.loss_mask, samples[key].loss_mask), key
        assert torch.equal(sample.position_ids, samples[key].position_ids), key


def test_a_checkpoint_trains_through_its_own_template_unless_it_is_the_published_one(tmp_path):
    """``--preprocessing-for`` names mimo's copy of the published template (with generation
    blocks) where the checkpoint holds the published one, re-saved by transformers too or kept
    in chat_template.json; a
    checkpoint with another template (an export of a run that trained its own, a user's) is
    trained through that one, as its export and transformers prompt with it."""
    from transformers import AutoProcessor

    from mimo_data.preprocess.tokenizer_loading import load_tokenizer
    from mimo_data.preprocess.templates import COPIES, QWEN3_5_PUBLISHED_SHA256
    from mimo_train.families.registry import preprocessing_for
    published = PUBLISHED / "Qwen--Qwen3.5-4B"

    def folder(name: str) -> Path:
        made = tmp_path / name
        made.mkdir(exist_ok=True)
        for each in published.iterdir():
            if not (made / each.name).exists() and not (
                    name == "resaved" and each.name.startswith(("tokenizer", "chat_template"))
                    or name == "in-json" and each.name == "chat_template.jinja"):
                (made / each.name).symlink_to(each)
        return made
    template = COPIES[QWEN3_5_PUBLISHED_SHA256]
    assert preprocessing_for(str(published))["chat_template"] == str(template)
    # the published text saved with a newline at its end (an editor's): Jinja drops it, the
    # same template, so mimo's copy all the same (not every multi-turn sample dropped)
    from mimo_data.preprocess.templates import copy_of
    assert copy_of((published / "chat_template.jinja").read_text() + "\n") == template
    assert copy_of((published / "chat_template.jinja").read_text().replace("\n", "\r\n")
                   + "\r\n") == template            # saved with Windows' line ends
    resaved = folder("resaved")
    AutoProcessor.from_pretrained(published).save_pretrained(resaved)
    assert preprocessing_for(str(resaved))["chat_template"] == str(template)
    # the template kept only in chat_template.json (transformers 4's processor save), which
    # the tokenizer does not read: named all the same
    in_json = tmp_path / "in-json"
    in_json.mkdir()
    (in_json / "chat_template.json").write_text(json.dumps(
        {"chat_template": (published / "chat_template.jinja").read_text()}))
    assert preprocessing_for(str(folder("in-json")))["chat_template"] == str(template)
    own = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n" \
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "chat_template.jinja").write_text(own)
    custom = folder("custom")
    config = preprocessing_for(str(custom))
    assert "chat_template" not in config
    assert load_tokenizer(PreprocessConfig.from_dict(config)).chat_template == own
