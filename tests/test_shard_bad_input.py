"""Bad records: each is skipped with a counted reason and its location, the good records around
it are all written; ``--strict`` stops at the first one and leaves nothing behind."""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import struct
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import soundfile
from PIL import Image

from conftest import (chat, cli_main, file_bytes, read_json, run_cli, sample_records,
                      samples_table, write_jsonl)

BAD_LINE = 3  # the bad record sits between good-2 and good-3


@dataclass
class Case:
    record: object                  # dict, or raw bytes for a line that is not valid JSON
    reason: str
    args: list = field(default_factory=list)
    detail: str = ""                # what the report's detail must say (where it matters)


def _image_record(path, text="<image>\nWhat is this?") -> dict:
    return {"id": "bad", "image": str(path), "conversations": chat(text, "Something.")}


def _audio_record(path) -> dict:
    return {"id": "bad", "audio": str(path),
            "conversations": chat("<audio>\nTranscribe.", "Words.")}


def _scan_span(jpeg: bytes) -> tuple[int, int]:
    """Start and end of the entropy-coded data of a baseline JPEG's (first) scan."""
    sos = jpeg.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(jpeg[sos + 2:sos + 4], "big")
    return start, jpeg.rindex(b"\xff\xd9")


def _png_idat_span(png: bytes) -> tuple[int, int]:
    """Start and end of the first IDAT chunk's data."""
    tag = png.index(b"IDAT")
    length = int.from_bytes(png[tag - 4:tag], "big")
    return tag + 4, tag + 4 + length


def _flipped(data: bytes, start: int, count: int) -> bytes:
    out = bytearray(data)
    for i in range(start, start + count):
        out[i] ^= 0xFF
    return bytes(out)


def _bomb(directory, side: int) -> Path:
    """A real decompression bomb: a side x side bilevel PNG of zeros (a few KB on disk)."""
    path = directory / f"bomb-{side}.png"
    Image.new("1", (side, side)).save(path)
    assert path.stat().st_size < 100_000
    return path


@pytest.fixture(scope="session")
def bomb_png(tmp_path_factory) -> Path:
    """144 Mpx: above Pillow's default limit (89 Mpx), below twice it."""
    return _bomb(tmp_path_factory.mktemp("bomb"), 12000)


@pytest.fixture(scope="session")
def huge_png(tmp_path_factory) -> Path:
    """196 Mpx: above twice Pillow's default limit (where Pillow raises instead of warning)."""
    return _bomb(tmp_path_factory.mktemp("bomb"), 14000)


def _pixels(path) -> int:
    data = Path(path).read_bytes()
    if data.startswith(b"\x89PNG\r\n\x1a\n"):     # IHDR width, height: no Pillow limit here
        width, height = struct.unpack(">II", data[16:24])
        return width * height
    with Image.open(path) as image:
        return image.width * image.height


def case_missing_media(tmp_path, assets):
    return Case(_image_record(tmp_path / "no-such-photo.jpg"), "missing_media")


def case_corrupt_png(tmp_path, assets):
    png = assets["png"].read_bytes()
    start, end = _png_idat_span(png)
    path = tmp_path / "corrupt.png"
    path.write_bytes(_flipped(png, (start + end) // 2, 1))
    return Case(_image_record(path), "corrupt_image")


def case_corrupt_jpeg(tmp_path, assets):
    jpeg = assets["jpeg_large"].read_bytes()
    start, end = _scan_span(jpeg)
    path = tmp_path / "corrupt.jpg"
    path.write_bytes(_flipped(jpeg, (start + end) // 2, 64))
    return Case(_image_record(path), "corrupt_image")


def case_truncated_jpeg(tmp_path, assets):
    jpeg = assets["jpeg_large"].read_bytes()
    path = tmp_path / "truncated.jpg"
    path.write_bytes(jpeg[: len(jpeg) * 6 // 10])
    return Case(_image_record(path), "corrupt_image")


def case_truncated_png(tmp_path, assets):
    png = assets["png"].read_bytes()
    path = tmp_path / "truncated.png"
    path.write_bytes(png[: len(png) * 6 // 10])
    return Case(_image_record(path), "corrupt_image")


def case_undecodable_audio(tmp_path, assets):
    path = tmp_path / "noise.wav"
    path.write_bytes(random.Random(0).randbytes(16_000))
    return Case(_audio_record(path), "corrupt_audio")


def case_zero_byte_audio(tmp_path, assets):
    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    return Case(_audio_record(path), "empty_audio")


def case_zero_frame_wav(tmp_path, assets):
    info = soundfile.info(assets["wav"])
    path = tmp_path / "no-frames.wav"
    soundfile.write(path, np.zeros((0, info.channels), dtype="int16"), info.samplerate,
                    subtype=info.subtype)
    header = soundfile.info(path)
    assert (header.format, header.frames, header.samplerate) == ("WAV", 0, info.samplerate)
    return Case(_audio_record(path), "empty_audio")


def case_more_markers_than_images(tmp_path, assets):
    """Two markers and one item: the item left out of the record is said first."""
    return Case(_image_record(assets["jpeg"], "<image>\n<image>\nCompare them."),
                "marker_mismatch", detail="give the 1 item(s) left out of the record")


def case_fewer_markers_than_images(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["images"] = [record.pop("image"), str(assets["jpeg"])]
    return Case(record, "marker_mismatch", detail="1 <image> marker(s) in the text but 2 "
                "image item(s) in the record: each item goes where its <image> is in the "
                "text; write the 1 missing, or leave out the items that have none")


def case_a_marker_and_no_item(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record.pop("image")
    return Case(record, "marker_mismatch", detail="the record gives no item for them")


def case_a_marker_written_as_words_in_a_transcript(tmp_path, assets):
    """A transcript that speaks of the tag: its marker cannot be told from the item's."""
    record = _audio_record(assets["wav"])
    record["conversations"][0]["value"] = "<audio>\nTranscribe: is it the <audio> tag?"
    return Case(record, "marker_mismatch", detail="reword those words in the source data")


def case_a_marker_in_an_answer(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["conversations"][1]["value"] = "<image> A cat."
    return Case(record, "marker_mismatch", detail="turn 1 (assistant) holds ['<image>']")



def case_a_video_marker_for_an_image(tmp_path, assets):
    """Every modality that disagrees is named, not only the first."""
    return Case(_image_record(assets["jpeg"], "<video>\nWhat is this?"), "marker_mismatch",
                detail="in the record: give each item its marker where it goes (mimo-shard's "
                "--markers-first puts them before the first user text); 1 <video> marker(s) in "
                "the text but 0 video item(s) in the record")


def case_a_marker_in_capitals(tmp_path, assets):
    return Case(_image_record(assets["jpeg"], "<Image>\nWhat is this?"), "marker_mismatch",
                detail="the text writes <Image>, which is no marker (markers are lower case: "
                "<image>)")


def case_more_images_than_markers(tmp_path, assets):
    record = _image_record(assets["jpeg"], "<image>\nWhat is this?")
    record.pop("image")
    record["images"] = [str(assets["jpeg"]), str(assets["png"])]
    return Case(record, "marker_mismatch")


def case_malformed_json(tmp_path, assets):
    line = json.dumps(_image_record(assets["jpeg"])).encode()
    return Case(line[: len(line) // 2], "malformed_json")


def case_control_character_in_a_line(tmp_path, assets):
    """A raw control character inside a JSON string (a tab a script wrote as is)."""
    line = b'{"id": "bad", "conversations": [{"from": "human", "value": "a\x01b"}]}'
    return Case(line, "malformed_json", detail="Invalid control character at its character 62")


def case_unknown_role(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["conversations"][1]["from"] = "robot"
    return Case(record, "unknown_role")


# a tool call as OpenAI and transformers' chat templates take it
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris"}}}


def case_tool_call_without_a_name(tmp_path, assets):
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"arguments": {"city": "Paris"}}}]}
    return Case(record, "malformed_record")


def case_tool_call_arguments_not_an_object(tmp_path, assets):
    """Arguments as JSON text of a list: templates write an object's items."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1] = {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '["Paris"]'}}
    return Case(record, "malformed_record")


def case_tool_call_arguments_not_json(tmp_path, assets):
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "city=Paris"}}]}
    return Case(record, "malformed_record")


def case_tool_turn_calling(tmp_path, assets):
    """Only an assistant calls tools."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"] += [{"role": "tool", "content": "21", "tool_calls": [WEATHER_CALL]},
                           {"role": "assistant", "content": "It is 21 degrees."}]
    return Case(record, "malformed_record")


def case_tool_call_with_unknown_keys(tmp_path, assets):
    """Arguments under a key mimo does not read would be trained as a call without them."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "args": {"city": "Paris"}}}]}
    return Case(record, "malformed_record")


def case_function_call_turn_without_a_call(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["conversations"][1:] = [{"from": "function_call", "value": "[]"},
                                   {"from": "observation", "value": "21"},
                                   {"from": "gpt", "value": "It is 21 degrees."}]
    return Case(record, "malformed_record")


def case_call_turn_flagged_unlike_its_answer(tmp_path, assets):
    """ms-swift's ``tool_call`` turn joins the answer before it: one flagged out of the loss
    and the other not cannot be one answer."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1:] = [
        {"role": "assistant", "content": "Checking.", "loss": False},
        {"role": "tool_call", "content": json.dumps(WEATHER_CALL["function"])},
        {"role": "tool_response", "content": "21"},
        {"role": "assistant", "content": "It is 21 degrees."}]
    return Case(record, "malformed_record", detail="flag them alike")


def case_call_turn_with_reasoning_joining_its_answer(tmp_path, assets):
    """A call turn's reasoning would be left out of the answer it joins."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1:] = [
        {"role": "assistant", "content": "Checking."},
        {"role": "tool_call", "content": json.dumps(WEATHER_CALL["function"]),
         "reasoning_content": "I should call it."},
        {"role": "tool_response", "content": "21"},
        {"role": "assistant", "content": "It is 21 degrees."}]
    return Case(record, "malformed_record", detail="give the text in that answer")


def case_answer_with_a_loss_flag_not_a_boolean(tmp_path, assets):
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1]["loss"] = "false"
    return Case(record, "malformed_record")


def case_grounding_objects(tmp_path, assets):
    """ms-swift's grounding: placeholders its trainer fills per model, which mimo would
    train as text."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1]["content"] = "<ref-object><bbox> is playing."
    record["objects"] = {"ref": ["a dog"], "bbox": [[331.5, 761.4, 853.5, 1594.8]]}
    return Case(record, "malformed_record", detail="grounding 'objects'")


def case_kto_undesirable(tmp_path, assets):
    """A KTO example of an answer not to give (ms-swift's label: false; LLaMA-Factory's
    kto_tag): supervised fine-tuning would train it as one to give."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["label"] = False
    return Case(record, "malformed_record", detail="'label' is false: a KTO example of an "
                "answer not to give")


def case_preference_pair(tmp_path, assets):
    """LLaMA-Factory's preference pair: the conversation ends on the user's turn, the answers
    beside it (it was skipped as a conversation with no assistant turn)."""
    record = _image_record(str(assets["jpeg"]))
    record["conversations"] = record["conversations"][:1]
    record.update(chosen={"from": "gpt", "value": "A cat."},
                  rejected={"from": "gpt", "value": "A dog."})
    return Case(record, "malformed_record", detail="'chosen' and 'rejected' beside a "
                "conversation ending on the user's turn: a preference pair")


def case_alpaca_record(tmp_path, assets):
    """A form mimo does not read (LLaMA-Factory's alpaca with images): the detail names the
    record's keys and the forms mimo reads."""
    return Case({"id": "bad", "instruction": "<image>Describe.", "input": "",
                 "output": "A cat.", "images": [str(assets["jpeg"])]}, "malformed_record",
                detail="the keys 'id', 'images', 'input', 'instruction', 'output', and")


def case_marker_in_a_tool_call(tmp_path, assets):
    """Only the record's media items place markers; one in a call's arguments would be
    expanded as an item the record lacks."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1] = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "describe",
                                          "arguments": {"what": "<image>"}}}]}
    return Case(record, "marker_mismatch")


def case_lone_surrogate_in_a_tool(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["tools"] = [{"type": "function", "function": {"name": "get_weather",
                                                         "description": "half \ud800"}}]
    line = json.dumps(record)
    assert "\\ud800" in line
    return Case(line.encode(), "invalid_utf8")


def case_system_prompt_given_twice(tmp_path, assets):
    """LLaMA-Factory's record-level ``system`` beside a conversation's own system turn."""
    record = _image_record(assets["jpeg"])
    record["system"] = "Be brief."
    record["conversations"].insert(0, {"from": "system", "value": "Be thorough."})
    return Case(record, "malformed_record")


def case_tools_listed_without_names(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["tools"] = [{"type": "function", "function": {"parameters": {"type": "object"}}}]
    return Case(record, "malformed_record")


def case_answer_with_train_detail(tmp_path, assets):
    """axolotl's character spans to train, which mimo does not read."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1]["train_detail"] = [{"begin_offset": 0, "end_offset": 4,
                                              "train": True}]
    return Case(record, "malformed_record")


def case_answer_weighted_neither_0_nor_1(tmp_path, assets):
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][1]["weight"] = 0.5
    return Case(record, "malformed_record")


def case_question_weighted_1(tmp_path, assets):
    """A flag asking to train a user turn: mimo trains answers only, so it is refused."""
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["messages"][0]["weight"] = 1
    return Case(record, "malformed_record")


def case_every_answer_weighted_0(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["conversations"][1]["weight"] = 0
    return Case(record, "no_trained_tokens")


def case_every_answer_empty(tmp_path, assets):
    """Answers of whitespace alone: the template's end of turn would be all a sample trains,
    which preprocessing drops as empty_answers at every epoch; an answer out of the loss
    does not count."""
    record = _image_record(assets["jpeg"])
    record["conversations"][1]["value"] = " \n"
    record["conversations"] += [{"from": "human", "value": "And?"},
                                {"from": "gpt", "value": "Kept out.", "weight": 0},
                                {"from": "human", "value": "Parts?"},
                                {"from": "gpt", "value": [{"type": "text", "text": ""},
                                                          {"type": "text", "text": " "}]}]
    return Case(record, "empty_answers", detail="every trained answer (2) is empty")


def _tool_record(*turns) -> dict:
    """A conversation calling get_weather, then ``turns``, then the answer."""
    return {"id": "bad", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris"}}}]},
        *turns, {"role": "assistant", "content": "21 degrees."}]}


def case_tool_response_no_call_asked_for(tmp_path, assets):
    """A tool's response after a user's turn (LLaMA-Factory's observation right after the
    question): the answer after it would train on a result nothing called for."""
    return Case({"id": "bad", "conversations": [
        {"from": "human", "value": "Weather?"}, {"from": "observation", "value": "21"},
        {"from": "gpt", "value": "21 degrees."}]}, "malformed_record",
        detail="turn 1 is a tool's response after a user turn, which no call asked for")


def case_tool_responses_more_than_calls(tmp_path, assets):
    return Case(_tool_record({"role": "tool", "content": "21"}, {"role": "tool", "content": "22"}),
                "malformed_record",
                detail="turn 3 is response 2 to an answer that makes 1 call(s)")


def case_tool_response_naming_no_call(tmp_path, assets):
    return Case(_tool_record({"role": "tool", "tool_call_id": "c9", "content": "21"}),
                "malformed_record",
                detail="turn 2's tool_call_id 'c9' names none of the calls of the answer "
                "before it (c1)")


def case_tool_response_without_content(tmp_path, assets):
    return Case(_tool_record({"role": "tool", "tool_call_id": "c1", "content": None}),
                "malformed_record", detail="turn 2 is a tool's response without content")


def case_no_assistant_turn(tmp_path, assets):
    """A prompt without its answer: nothing a sample of it could train, at any epoch."""
    record = _image_record(assets["jpeg"])
    record["conversations"] = record["conversations"][:1]
    return Case(record, "no_trained_tokens")


def case_invalid_utf8_bytes(tmp_path, assets):
    line = json.dumps({"id": "bad", "conversations": chat("Caf__E9__ au lait?", "Yes.")}).encode()
    return Case(line.replace(b"__E9__", b"\xe9"), "invalid_utf8")   # Latin-1 byte, not UTF-8


def case_lone_surrogate_text(tmp_path, assets):
    line = json.dumps({"id": "bad", "conversations": chat("half a pair: \ud800", "Hm.")})
    assert "\\ud800" in line
    return Case(line.encode(), "invalid_utf8")


def case_lone_surrogate_id(tmp_path, assets):
    line = json.dumps({"id": "bad-\ud800", "conversations": chat("Hello?", "Hi.")})
    return Case(line.encode(), "invalid_utf8")


def case_lone_surrogate_media_path(tmp_path, assets):
    line = json.dumps(_image_record(f"{tmp_path}/photo-\ud800.jpg"))
    return Case(line.encode(), "invalid_utf8")


def case_escaped_byte_media_path(tmp_path, assets):
    # "\udc80" is how Python spells the undecodable file-name byte 0x80 (surrogateescape)
    line = json.dumps(_image_record(f"{tmp_path}/photo-\udc80.jpg"))
    return Case(line.encode(), "invalid_utf8")


def case_video_as_a_folder_of_frames(tmp_path, assets):
    # LLaVA-Hound's videos, in LLaVA-Video-178K too, are folders of frames
    frames = tmp_path / "frames" / "clip-1"
    frames.mkdir(parents=True)
    (frames / "00001.jpg").write_bytes(assets["jpeg"].read_bytes())
    return Case({"id": "bad", "video": str(frames),
                 "conversations": chat("<video>\nWhat happens?", "A pan.")},
                "missing_media", detail="is a folder, not a media file: a video's frames are "
                "read with --frames-fps")


def case_audio_as_a_folder(tmp_path, assets):
    """A folder where a speech clip goes: no word of video frames (said of videos alone)."""
    (tmp_path / "clips").mkdir()
    return Case(_audio_record(tmp_path / "clips"), "missing_media",
                detail="clips is a folder, not a media file: give the audio file itself")


def case_media_path_a_dangling_link(tmp_path, assets):
    # a dataset's links into a store not mounted here: the link said as one, its target named
    (tmp_path / "linked.jpg").symlink_to("/mnt/unmounted/photo.jpg")
    return Case(_image_record(tmp_path / "linked.jpg"), "missing_media",
                detail="linked.jpg: a symbolic link to /mnt/unmounted/photo.jpg, which does not "
                "exist (paths are relative")


def case_empty_bytes_beside_a_path(tmp_path, assets):
    # a table's {bytes, path} struct whose bytes are empty: the path tried, the bytes said
    record = {**_image_record(""), "image": {"bytes": "", "path": "e.jpg"}}
    return Case(record, "missing_media", detail="its bytes are empty (0 bytes), and the path "
                "beside them: media file")


def case_nul_in_media_path(tmp_path, assets):
    return Case(_image_record(f"{tmp_path}/photo\x00.jpg"), "missing_media")


def case_decompression_bomb(tmp_path, assets, bomb_png):
    assert _pixels(bomb_png) > Image.MAX_IMAGE_PIXELS   # above Pillow's (and the default) limit
    return Case(_image_record(bomb_png), "image_too_large")


def case_lowered_pixel_limit(tmp_path, assets):
    large, small = _pixels(assets["jpeg_large"]), _pixels(assets["jpeg"])
    assert small < large
    return Case(_image_record(assets["jpeg_large"]), "image_too_large",
                ["--max-image-pixels", str(large - 1)])


def case_video_frames_above_the_pixel_limit(tmp_path, assets):
    # each sampled frame is decoded whole: a clip of frames larger than the limit (which the
    # good records' photo is within) is refused as an image is
    import av

    side = math.isqrt(_pixels(assets["jpeg"])) // 2 * 2 + 2          # even, for h264
    clip = tmp_path / "large.mp4"
    with av.open(str(clip), "w") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        for _ in range(4):
            frame = av.VideoFrame.from_ndarray(np.zeros((side, side, 3), np.uint8), "rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return Case({"id": "bad", "video": str(clip),
                 "conversations": chat("<video>\nWhat happens?", "A still.")},
                "video_too_large", ["--max-image-pixels", str(side * side - 1)],
                f"{side}x{side} = {side * side} pixels a frame is above the limit of "
                f"{side * side - 1} (raise --max-image-pixels to keep it)")


def case_a_video_of_a_codec_ffmpeg_has_no_decoder_for(tmp_path, assets):
    """A clip whose codec (the sample entry's fourcc) FFmpeg does not know: PyAV gives its
    stream no codec context; skipped as an unsupported codec, not an AttributeError that
    stopped the build with no report."""
    import av

    clip = tmp_path / "unknown.mp4"
    with av.open(str(clip), "w") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width = stream.height = 16
        stream.pix_fmt = "yuv420p"
        for _ in range(4):
            frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), "rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    clip.write_bytes(clip.read_bytes().replace(b"avc1", b"zzzz"))
    return Case({"id": "bad", "video": str(clip),
                 "conversations": chat("<video>\nWhat happens?", "A still.")},
                "unsupported_codec", detail="its video codec is one FFmpeg knows no decoder for")


def case_audio_that_is_a_video_of_a_codec_ffmpeg_has_no_decoder_for(tmp_path, assets):
    """The same clip given as audio: said as a video without sound, not an AttributeError
    (PyAV's stream of no codec context) read as corrupt audio."""
    case_a_video_of_a_codec_ffmpeg_has_no_decoder_for(tmp_path, assets)    # writes unknown.mp4
    return Case(_audio_record(tmp_path / "unknown.mp4"), "unsupported_format",
                detail="a video without sound (a codec FFmpeg has no decoder for in mov")


def case_a_float_wav_holding_nan(tmp_path, assets):
    """A float WAV with a NaN sample decodes to NaN log-mels, every step it is in a NaN loss:
    corrupt, as a Parquet array holding NaN is."""
    samples, rate = soundfile.read(assets["wav"], dtype="float32")
    samples[len(samples) // 2] = np.nan
    soundfile.write(tmp_path / "nan.wav", samples, rate, subtype="FLOAT")
    return Case(_audio_record(tmp_path / "nan.wav"), "corrupt_audio",
                detail="float samples that are NaN or infinite")


def case_media_path_not_a_string(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["image"] = {"path": 42}
    return Case(record, "malformed_record")


def case_a_turn_whose_value_is_null(tmp_path, assets):
    """An export's null answer: said to be null, not taken for a key that is not there."""
    record = {"id": "bad", "conversations": [{"from": "human", "value": "Hi?"},
                                             {"from": "gpt", "value": None}]}
    return Case(record, "malformed_record", detail="turn 1 (gpt) has a null value: give its "
                "text as a string (an answer cut off in an export?), or leave the record out")


def _parts_record(*media_parts) -> dict:
    """A chat record whose user turn is transformers' content parts: ``media_parts`` first."""
    content = [*media_parts, {"type": "text", "text": "What is this?"}]
    return {"id": "bad", "messages": [{"role": "user", "content": content},
                                      {"role": "assistant", "content": "Something."}]}


def case_media_in_list_and_in_parts(tmp_path, assets):
    record = _parts_record({"type": "image", "image": str(assets["jpeg"])})
    record["images"] = [str(assets["jpeg"])]
    return Case(record, "malformed_record")


def case_some_media_parts_name_no_item(tmp_path, assets):
    return Case(_parts_record({"type": "image", "path": str(assets["jpeg"])},
                              {"type": "image"}), "malformed_record")


def case_image_and_images_that_differ(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["images"] = [str(assets["png"])]
    return Case(record, "malformed_record",
                detail="gives both 'images' and 'image', with different items")


def case_conversations_and_messages_that_differ(tmp_path, assets):
    record = _image_record(assets["jpeg"])
    record["messages"] = [{"role": "user", "content": "<image>\nOther?"},
                          {"role": "assistant", "content": "Yes."}]
    return Case(record, "malformed_record", detail="both 'conversations' and 'messages'")


def case_an_image_under_a_key_mimo_does_not_read(tmp_path, assets):
    """An export's own key for the image: refused naming it, not built text-only."""
    record = _image_record(assets["jpeg"], "What is this?")
    record["image_path"] = record.pop("image")
    return Case(record, "malformed_record", detail="names its image under 'image_path'")


def case_an_image_under_a_camel_case_key(tmp_path, assets):
    """The same in a JavaScript export's spelling."""
    record = _image_record(assets["jpeg"], "What is this?")
    record["imagePath"] = record.pop("image")
    return Case(record, "malformed_record", detail="names its image under 'imagePath'")


def case_an_image_under_its_key_misspelt(tmp_path, assets):
    """``imgae``: named as the image's key misspelt, not a marker without its image."""
    record = _image_record(assets["jpeg"])
    record["imgae"] = record.pop("image")
    return Case(record, "malformed_record", detail="names its image under 'imgae'")


def case_messages_not_a_list(tmp_path, assets):
    """A number where the turns go: said as what it is, under its key (it was "missing or
    empty")."""
    return Case({"id": "bad", "messages": 5}, "malformed_record",
                detail="its 'messages' holds 5 (type number), not a list of turns")


def case_an_id_that_is_an_object(tmp_path, assets):
    """An id that names no record (an object; true or false likewise): refused as what it is,
    not kept as Python's text of it ("{'a': 1}")."""
    return Case({"id": {"a": 1}, "conversations": chat("Which id?", "None.")},
                "malformed_record",
                detail='the id is {"a": 1}: give each record a string or a number as its id')


def case_records_wrapped_in_an_object(tmp_path, assets):
    """A download's ``{"data": [records]}`` (one line: read as one record): said as a list
    wrapped in an object, with the command that unwraps it."""
    return Case({"data": [{"id": "a", "conversations": chat("Hi?", "Hello.")}]},
                "malformed_record", detail="the record wraps a list of 1 objects under 'data' "
                "(a file of records inside an object?): give that list as the file, e.g. jq "
                "'.data' FILE > records.json")


def case_a_document_and_a_conversation_in_one_record(tmp_path, assets):
    """``texts`` beside ``messages``: refused, not built as the document with the
    conversation left out."""
    return Case({"id": "both", "texts": ["Hello there."], "images": [None],
                 "messages": [{"role": "user", "content": "Hi?"},
                              {"role": "assistant", "content": "Hello."}]},
                "malformed_record", detail="both a document's 'texts' and 'messages': a record "
                "is one document, conversation or caption pair")


def case_a_document_of_empty_lists(tmp_path, assets):
    """``texts: []`` (and ``images: []``): an empty document said as one, not as a record
    without a 'texts' document: ``empty_document``, as a Parquet table's row of them is."""
    return Case({"id": "doc", "texts": [], "images": []}, "empty_document",
                detail="the document has no text")


def case_a_document_whose_images_are_no_list(tmp_path, assets):
    """A text-only document without 'images' (or one image given as a string): said as what
    'images' is, not as lists of different lengths."""
    return Case({"id": "doc", "texts": ["Hello there.", "More."]}, "malformed_record",
                detail="a document's 'images' is missing: a document needs the lists 'texts' "
                "and 'images', parallel")


def case_duplicate_id(tmp_path, assets):
    return Case({"id": "good-1", "conversations": chat("Same id again?", "Yes.")},
                "duplicate_id")


CASES = {name[len("case_"):]: func for name, func in globals().items()
         if name.startswith("case_")}
KNOWN_BUGS: dict[str, str] = {}


def _make_case(name, tmp_path, assets, request) -> Case:
    func = CASES[name]
    if "bomb_png" in func.__code__.co_varnames[:func.__code__.co_argcount]:
        return func(tmp_path, assets, request.getfixturevalue("bomb_png"))
    return func(tmp_path, assets)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.xfail(reason=KNOWN_BUGS[name], strict=True))
    if name in KNOWN_BUGS else name for name in CASES])
def test_bad_record_is_skipped_and_counted(capsys, request, tmp_path, assets, good_records, name):
    case = _make_case(name, tmp_path, assets, request)
    records = [good_records[0], good_records[1], case.record, good_records[2]]
    path = write_jsonl(tmp_path / "input.jsonl", records)
    out = tmp_path / "out"

    code, _, err = cli_main(capsys, "build", path, "-o", out, "--no-progress", *case.args)
    assert code == 0, err

    report = read_json(out / "report.json")
    assert report["records_read"] == len(records)
    assert report["records_read"] == report["samples_written"] + report["records_skipped"]
    assert list(report["skipped_by_reason"]) == [case.reason], report["skipped_by_reason"]
    entry = report["skipped_by_reason"][case.reason]
    assert entry["count"] == 1
    assert [first["location"] for first in entry["first"]] == [f"{path}:{BAD_LINE}"]
    assert entry["first"][0]["detail"]
    assert case.detail in entry["first"][0]["detail"]
    # the record's own id beside where the build read it, one refused as it was read too
    if name in ("missing_media", "conversations_and_messages_that_differ", "unknown_role"):
        assert entry["first"][0]["id"] == case.record["id"] == "bad"
        listed = [json.loads(line) for line in
                  (out / "skipped.jsonl").read_text().splitlines()]
        assert listed == [{"reason": case.reason, **entry["first"][0]}]

    assert [row["id"] for row in samples_table(out)] == [r["id"] for r in good_records]
    assert read_json(out / "index.json")["totals"]["samples"] == len(good_records)

    summary = [line for line in err.splitlines() if line.startswith("mimo-shard:")]
    assert len(summary) == 1, err
    assert f"{case.reason} 1" in summary[0]
    numbers = [int(n) for n in re.findall(r"\b\d+\b", summary[0].split("→")[0])]
    assert {len(records), len(good_records), 1} <= set(numbers), summary[0]


def test_a_decoder_failing_unforeseen_skips_only_its_record(capsys, tmp_path, assets,
                                                             good_records, monkeypatch):
    """A decoding library failing on a file in a way no check foresaw (PyAV's stream without
    a codec context was one) skips that record as ``corrupt_<modality>``, naming the file and
    the error, and the build goes on (``--workers 0``: the probe patched in this process)."""
    from mimo_data.modalities import MODALITIES

    image = type(MODALITIES["image"])
    probe, odd = image.probe, tmp_path / "odd.jpg"
    shutil.copy(assets["jpeg"], odd)
    marked = odd.read_bytes() + b"\0"              # the same photo, a byte apart: its own file
    odd.write_bytes(marked)

    def failing(self, data, *args):
        if data == marked:
            raise AttributeError("'NoneType' object has no attribute 'codec'")
        return probe(self, data, *args)
    monkeypatch.setattr(image, "probe", failing)
    path = write_jsonl(tmp_path / "input.jsonl", [good_records[0], _image_record(odd),
                                                 good_records[1]])
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress",
                            "--workers", "0")
    assert code == 0, err
    skipped = read_json(tmp_path / "out" / "report.json")["skipped_by_reason"]
    assert list(skipped) == ["corrupt_image"] and skipped["corrupt_image"]["count"] == 1
    assert skipped["corrupt_image"]["first"][0]["detail"] == (
        f"image 0 ({odd}): reading it failed (AttributeError: 'NoneType' object has no "
        "attribute 'codec'); if the file opens elsewhere, convert it with ffmpeg")
    assert [row["id"] for row in samples_table(tmp_path / "out")] == ["good-1", "good-2"]


def test_several_bad_records_are_all_counted(capsys, tmp_path, assets, good_records):
    cases = [case_missing_media(tmp_path, assets), case_unknown_role(tmp_path, assets),
             case_missing_media(tmp_path, assets), case_truncated_png(tmp_path, assets)]
    records = [cases[0].record, good_records[0], cases[1].record, good_records[1],
               cases[2].record, cases[3].record, good_records[2]] + [cases[0].record] * 5
    path = write_jsonl(tmp_path / "input.jsonl", records)
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress")
    assert code == 0, err
    report = read_json(tmp_path / "out" / "report.json")
    skipped = report["skipped_by_reason"]
    assert {reason: entry["count"] for reason, entry in skipped.items()} == {
        "missing_media": 7, "unknown_role": 1, "corrupt_image": 1}
    assert [f["location"] for f in skipped["missing_media"]["first"]] == [
        f"{path}:{line}" for line in (1, 5, 8, 9, 10)]      # the first five
    assert report["records_skipped"] == 9 and report["samples_written"] == 3
    # skipped.jsonl lists every one, in input order, as the summary line says
    every = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").open()]
    assert [(entry["reason"], entry["location"]) for entry in every] == [
        ("missing_media", f"{path}:1"), ("unknown_role", f"{path}:3"),
        ("missing_media", f"{path}:5"), ("corrupt_image", f"{path}:6")] + [
        ("missing_media", f"{path}:{line}") for line in range(8, 13)]
    assert all(entry["detail"] for entry in every)
    assert f"(see {tmp_path / 'out' / 'report.json'}; skipped.jsonl beside it lists every " \
        "skipped record)" in err, err
    assert [row["id"] for row in samples_table(tmp_path / "out")] == ["good-1", "good-2", "good-3"]
    # every record skipped: its report is written, no dataset (the work is not done), and
    # the build of the fixed data goes to the same output without --overwrite
    path = write_jsonl(tmp_path / "bad.jsonl", [cases[0].record, cases[1].record])
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "none", "--no-progress")
    assert code == 1 and "no sample written, all 2 record(s) skipped" in err, err
    assert read_json(tmp_path / "none" / "report.json")["records_skipped"] == 2
    assert sorted(p.name for p in (tmp_path / "none").iterdir()) == ["report.json",
                                                                     "skipped.jsonl"]
    assert [json.loads(line)["location"] for line in (tmp_path / "none" / "skipped.jsonl")
            .open()] == [f"{path}:1", f"{path}:2"]
    assert f"(see {tmp_path / 'none' / 'report.json'}; skipped.jsonl beside it lists every " \
        "skipped record)" in err, err
    # given to the next command, that output's report is named, not an interrupted build
    # a folder that is not there: a usage error (2), as README's exit status says
    code, _, err = cli_main(capsys, "info", tmp_path / "nowhere")
    assert code == 2 and f"{tmp_path / 'nowhere'}: no such directory (check the path" in err, err
    # a build's input given for its dataset: the file, or its folder, said as input
    code, _, err = cli_main(capsys, "info", path)
    assert code == 2 and f"{path} is a file, not a dataset's folder (index.json beside its " \
        f"tars): a build's input becomes one with `mimo-shard build {path} --output DIR`" in err
    code, _, err = cli_main(capsys, "info", tmp_path)
    assert code == 2 and f"{tmp_path}: no index.json and no shards: a build's input (bad.jsonl" \
        f", input.jsonl), not a dataset; `mimo-shard build {tmp_path / 'bad.jsonl'} --output " \
        "DIR` makes one" in err, err
    # a build killed before its index, into the inputs' folder: its own files are no input
    (tmp_path / "samples.parquet").write_bytes(b"")
    code, _, err = cli_main(capsys, "info", tmp_path)
    assert code == 1 and "so this is not a complete dataset (an interrupted build" in err, err
    (tmp_path / "samples.parquet").unlink()
    for file, said in ((tmp_path / "out" / "index.json", f"it is one of the dataset "
                        f"{tmp_path / 'out'}'s files; give that folder"),
                       (tmp_path / "out" / "samples.parquet", "give that folder")):
        code, _, err = cli_main(capsys, "info", file)
        assert code == 2 and said in err, err
    code, _, err = cli_main(capsys, "info", tmp_path / "none")
    assert code == 1 and f"{tmp_path / 'none'}: no index.json: the build or indexing that " \
        f"wrote it kept no sample; {tmp_path / 'none' / 'report.json'} says why" in err, err
    path = write_jsonl(tmp_path / "fixed.jsonl", good_records)
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "none", "--no-progress")
    assert code == 0 and read_json(tmp_path / "none" / "index.json")["totals"]["samples"] == \
        len(good_records), err


def test_empty_tool_fields_are_no_tool_use(capsys, tmp_path, assets, good_records):
    """Datasets that carry the tool fields empty on every record (``tools: []``, an answer's
    ``tool_calls: null`` or ``[]``, a ``function_call`` of nulls, a table's ``"[ ]"``,
    ``"None"`` or NaN) train as conversations without tools."""
    records = [dict(good_records[0], tools=[], functions="None"),
               dict(good_records[1], tools="[ ]", functions=float("nan")),
               {"id": "chat", "tools": None, "messages": [
                   {"role": "user", "content": "Hi?"},
                   {"role": "assistant", "content": "Hello.", "tool_calls": None,
                    "function_call": {"name": None, "arguments": None}},
                   {"role": "user", "content": "And?"},
                   {"role": "assistant", "content": "Bye.", "tool_calls": []}]}]
    path = write_jsonl(tmp_path / "input.jsonl", records)
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress")
    assert code == 0, err
    report = read_json(tmp_path / "out" / "report.json")
    assert report["records_skipped"] == 0 and report["samples_written"] == 3, report
    assert "counts" not in report, report
    assert {key for record in sample_records(tmp_path / "out")
            for message in record["messages"] for key in message} == {"role", "content"}


def test_text_records_keys_near_a_media_name_are_metadata(capsys, tmp_path):
    """Only two letters of a media key swapped (``imgae``) is taken for it misspelt: a text
    record's own keys a letter or two from one (``videoid``, ``audit``, ``imagen``, ``radio``)
    are its metadata, and it builds."""
    text = {"id": "t", "conversations": [{"from": "human", "value": "Hi?"},
                                         {"from": "gpt", "value": "Hello."}]}
    records = [dict(text, id=f"t{i}", **{key: "dQw4w9WgXcQ"})
               for i, key in enumerate(("videoid", "audit", "imagen", "radio", "mage"))]
    path = write_jsonl(tmp_path / "input.jsonl", records)
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress")
    assert code == 0, err
    assert read_json(tmp_path / "out" / "report.json")["samples_written"] == len(records)


def test_tool_use_is_written_as_chat_templates_take_it(capsys, tmp_path):
    """The tool-use forms users bring become one: OpenAI/transformers' (calls with their
    arguments as JSON text or an object, ``content: null``, a ``tool`` turn with its call's
    id), OpenAI's older ``functions`` / ``function_call`` / ``function`` turn, LLaMA-Factory's
    ShareGPT (``function_call`` and ``observation`` turns, ``tools`` as JSON text of bare
    functions, the record's ``system`` prompt), Llama 3's (``parameters``, an ``ipython``
    turn, a number for a result and an id), ms-swift's agent format (``tool_call`` turns,
    which join the answer before them, parallel calls as consecutive ones, ``tool_response``
    turns): calls as ``{"type": "function", "function":
    {"name", "arguments": {...}}}``, a tool's turn as role ``tool``, the tools wrapped as
    templates take them, on the first message."""
    weather = {"name": "get_weather", "parameters": {"type": "object"}}
    wrapped = {"type": "function", "function": weather}
    call = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}
    records = [
        {"id": "openai", "tools": [wrapped], "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": {"temperature": 21}},
            {"role": "assistant", "content": "21 degrees."}]},
        {"id": "legacy", "functions": [weather], "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "function_call": {
                "name": "get_weather", "arguments": {"city": "Paris"}}},
            {"role": "function", "name": "get_weather", "content": "21"},
            {"role": "assistant", "content": "21 degrees."}]},
        {"id": "sharegpt", "tools": json.dumps([weather]), "system": "Use tools.",
         "conversations": [
            {"from": "human", "value": "Weather?"},
            {"from": "function_call", "value": json.dumps(call["function"])},
            {"from": "observation", "value": "21"},
            {"from": "gpt", "value": "21 degrees."}]},
        {"id": "ipython", "messages": [          # Llama 3's: arguments as "parameters"
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [{
                "name": "get_weather", "parameters": {"city": "Paris"}}]},
            {"role": "ipython", "content": 21, "tool_call_id": 5},
            {"role": "assistant", "content": "21 degrees."}]},
        {"id": "swift", "tools": json.dumps([wrapped]), "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "<think>\nTwo cities.\n</think>\n"},
            {"role": "tool_call", "content": json.dumps(call["function"])},
            {"role": "tool_call", "content": json.dumps(
                {"name": "get_weather", "arguments": {"city": "Rome"}})},
            {"role": "tool_response", "content": "21"},
            {"role": "tool_response", "content": "25"},
            {"role": "assistant", "content": "21 degrees."}]},
    ]
    path = write_jsonl(tmp_path / "input.jsonl", records)
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress")
    assert code == 0, err
    report = read_json(tmp_path / "out" / "report.json")
    assert report["records_skipped"] == 0 and report["counts"] == {
        "conversations_using_tools": 5}, report
    assert "5 samples written (conversations using tools: 5)" in err, err
    written = {record["id"]: record["messages"] for record in sample_records(tmp_path / "out")}
    question = {"role": "user", "content": "Weather?"}
    answer = {"role": "assistant", "content": "21 degrees."}
    assert written["openai"] == [
        {**question, "tools": [wrapped]},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "id": "c1"}]},
        {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "c1"}, answer]
    assert written["legacy"] == [
        {**question, "tools": [wrapped]}, {"role": "assistant", "content": "",
                                           "tool_calls": [call]},
        {"role": "tool", "content": "21", "name": "get_weather"}, answer]
    assert written["sharegpt"] == [   # its system prompt first, the tools on it
        {"role": "system", "content": "Use tools.", "tools": [wrapped]}, question,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "21"}, answer]
    assert written["ipython"] == [
        question, {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "content": "21", "tool_call_id": "5"}, answer]
    rome = {"type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Rome"}}}
    assert written["swift"] == [    # one answer: its reasoning and both calls
        {**question, "tools": [wrapped]},
        {"role": "assistant", "content": "<think>\nTwo cities.\n</think>\n",
         "tool_calls": [call, rome]},
        {"role": "tool", "content": "21"}, {"role": "tool", "content": "25"}, answer]
    # calls written in the answer's text (Hermes', ToolACE's data): their responses follow it
    from mimo_data.shards.records import normalize_messages
    calls_in_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}' \
        '\n</tool_call>'
    hermes = normalize_messages([
        {"from": "system", "value": "Use tools."}, {"from": "human", "value": "Weather?"},
        {"from": "gpt", "value": calls_in_text}, {"from": "tool", "value": "21"},
        {"from": "tool", "value": "25"}, {"from": "gpt", "value": "21 and 25 degrees."}])
    assert [m["role"] for m in hermes] == ["system", "user", "assistant", "tool", "tool",
                                          "assistant"]
    toolace = normalize_messages([question, {"role": "assistant", "content":
                                             "[get_weather(city='Paris')]"},
                                  {"role": "tool", "content": "21"}, answer])
    assert toolace[2] == {"role": "tool", "content": "21"}


def test_tool_fields_no_json_holds_are_malformed_records():
    """A table's struct columns can hold what JSON cannot (a date, bytes): in a tool's result
    or a call's arguments it is a counted malformed_record, never a crashed build."""
    import datetime
    from mimo_data.shards.records import RecordError, normalize_messages
    when = datetime.date(2026, 12, 1)
    question, answer = {"role": "user", "content": "When?"}, {"role": "assistant",
                                                             "content": "Today."}
    for turns in ([question, {"role": "tool", "content": {"date": when}}, answer],
                  [question, {"role": "assistant", "content": "", "tool_calls": [
                      {"type": "function", "function": {"name": "f",
                                                        "arguments": {"on": when}}}]}]):
        with pytest.raises(RecordError, match="not JSON") as caught:
            normalize_messages(turns)
        assert caught.value.reason == "malformed_record"


def test_answers_out_of_the_loss_are_weighted_0_in_the_shards(capsys, tmp_path):
    """OpenAI's ``weight`` (0 or 1), axolotl's ``training`` and ms-swift's ``loss`` (booleans)
    on answers: the
    shard's message holds ``"weight": 0`` where the answer is out of the loss, nothing
    otherwise, and the report counts those answers; a user turn's ``weight: 0`` (what mimo
    does anyway) and an empty ``train_detail`` (a table's null) are accepted."""
    turns = [{"role": "user", "content": "One?", "weight": 0},
             {"role": "assistant", "content": "A.", "weight": 0, "train_detail": None},
             {"role": "user", "content": "Two?"},
             {"role": "assistant", "content": "B.", "training": False},
             {"role": "user", "content": "Three?"},
             {"role": "assistant", "content": "C.", "weight": 1},
             {"role": "user", "content": "Four?"},
             {"role": "assistant", "content": "D.", "training": True},
             {"role": "user", "content": "Five?"},
             {"role": "assistant", "content": "E.", "loss": False},
             {"role": "user", "content": "Six?"},
             {"role": "assistant", "content": "F.", "loss": True}]
    path = write_jsonl(tmp_path / "input.jsonl", [{"id": "w", "messages": turns}])
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress")
    assert code == 0, err
    # the report counts them, so a user sees the flags were read
    assert read_json(tmp_path / "out" / "report.json")["counts"] == {
        "answers_out_of_the_loss": 3}
    assert "1 sample written (answers out of the loss: 3)" in err, err
    code, out, err = cli_main(capsys, "info", tmp_path / "out")   # and info, later
    assert code == 0 and "holds     answers out of the loss: 3" in out, out + err
    [record] = sample_records(tmp_path / "out")
    assert [m.get("weight") for m in record["messages"]] == \
        [None, 0, None, 0] + [None] * 5 + [0] + [None] * 2
    assert [set(m) for m in record["messages"]] == \
        [{"role", "content"}, {"role", "content", "weight"}] * 2 + [{"role", "content"}] * 5 \
        + [{"role", "content", "weight"}] + [{"role", "content"}] * 2


def test_markers_first_places_missing_markers_as_internvl_does(
        capsys, tmp_path, assets, corpus, corpus_videos):
    """Records whose text has no marker for their items (InternVL's single image, ms-swift's
    images and audio): without ``--markers-first`` each is a marker_mismatch whose detail
    names the flag; with it each item's marker goes before the first user text, counted. A
    modality with some markers but too few is still refused, so is one written in capitals
    (``<Image>``), and LLaVA-NeXT's video ``<image>`` stays the video's (no second marker
    placed)."""
    jpeg, png, wav = (str(assets[k]) for k in ("jpeg", "png", "wav"))
    clip = str(corpus / corpus_videos["pan_h264_24"].path)
    records = [
        {"id": "internvl", "image": jpeg, "conversations": chat("What is it?", "A cat.")},
        {"id": "swift", "images": [jpeg, png], "audios": [wav], "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Compare."}, {"role": "assistant", "content": "Same."}]},
        {"id": "llava-video", "video": clip, "conversations": chat("<image>\nWhat?", "A pan.")},
        {"id": "too-few", "images": [jpeg, png],
         "conversations": chat("<image>\nBoth?", "Yes.")},
        {"id": "capitals", "image": jpeg, "conversations": chat("<Image>\nWhat?", "A cat.")}]
    path = write_jsonl(tmp_path / "input.jsonl", records)
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "plain", "--no-progress")
    assert code == 0, err
    skipped = read_json(tmp_path / "plain" / "report.json")["skipped_by_reason"]
    assert skipped["marker_mismatch"]["count"] == 4
    assert [("--markers-first" in f["detail"]) for f in skipped["marker_mismatch"]["first"]] \
        == [True, True, False, False]
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress",
                            "--markers-first")
    assert code == 0, err
    report = read_json(tmp_path / "out" / "report.json")
    # too-few, and capitals: its <Image> is where the image goes, not words to train
    assert report["skipped_by_reason"]["marker_mismatch"]["count"] == 2
    assert report["counts"] == {"markers_placed_first": 4, "videos_marked_with_image": 1}
    written = {r["id"]: r for r in sample_records(tmp_path / "out")}
    assert written["internvl"]["messages"][0]["content"] == "<image>\nWhat is it?"
    assert [m["content"] for m in written["swift"]["messages"]] == [
        "Be brief.", "<image>\n<image>\n<audio>\nCompare.", "Same."]
    assert [item["modality"] for item in written["swift"]["media"]] == \
        ["image", "image", "audio"]
    assert written["llava-video"]["messages"][0]["content"] == "<video>\nWhat?"


def test_media_urls_are_counted_as_not_downloaded(capsys, tmp_path, assets, good_records):
    urls = ["http://example.com/1.jpg", "HTTPS://example.com/2.png", "https://example.com/3.jpg",
            "http://example.com/4.wav"]
    bad = [{"id": "doc", "texts": ["A page.", None], "images": [None, urls[0]]},
           _image_record(urls[1]) | {"id": "top-level"},
           _parts_record({"type": "image", "url": urls[2]}) | {"id": "part"},
           {"id": "struct", "audio": {"bytes": None, "path": urls[3]},
            "conversations": chat("<audio>\nTranscribe.", "Words.")}]
    path = write_jsonl(tmp_path / "input.jsonl", [*good_records, *bad])
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--no-progress")
    assert code == 0, err

    skipped = read_json(tmp_path / "out" / "report.json")["skipped_by_reason"]
    assert {reason: entry["count"] for reason, entry in skipped.items()} == {
        "missing_media": len(bad)}
    firsts = skipped["missing_media"]["first"]
    assert [f["location"] for f in firsts] == [f"{path}:{n}" for n in range(4, 4 + len(bad))]
    for url, first in zip(urls, firsts):
        assert url in first["detail"] and "is a URL" in first["detail"], first
        assert "img2dataset" in first["detail"] and "not found" not in first["detail"], first
    # a bucket's URL, and a path written with Windows' backslashes: said what they are
    code, _, err = cli_main(capsys, "build", write_jsonl(tmp_path / "more.jsonl", [
        *good_records, _image_record("s3://bucket/raw/1.jpg") | {"id": "bucket"},
        _image_record("photos\\1.jpg") | {"id": "windows"}]), "-o", tmp_path / "more",
        "--no-progress")
    assert code == 0, err
    bucket, windows = read_json(tmp_path / "more" / "report.json")["skipped_by_reason"][
        "missing_media"]["first"]
    assert bucket["detail"].startswith("'s3://bucket/raw/1.jpg' is an object store's URL, which "
                                       "mimo-shard build does not read media from"), bucket
    assert windows["detail"].endswith("not found (paths are relative to the input file's "
                                      "folder, or to --media-root; this one is written with "
                                      "backslashes, as Windows writes paths: write it with / "
                                      "(and without a drive letter))"), windows
    # a name its folder holds but for what prints alike (macOS's decomposed é, a trailing
    # space, letter case): the file it holds named, not "not found" alone
    (tmp_path / "alike").mkdir()
    held = [unicodedata.normalize("NFD", "café.jpg"), "rocket.jpg", "Astronaut.JPG"]
    for name in held:
        shutil.copy(assets["jpeg"], tmp_path / "alike" / name)
    given = [unicodedata.normalize("NFC", "café.jpg"), "rocket.jpg ", "astronaut.jpg"]
    code, _, err = cli_main(capsys, "build", write_jsonl(tmp_path / "alike.jsonl", [
        *good_records, *(_image_record(f"alike/{name}") | {"id": f"alike-{k}"}
                         for k, name in enumerate(given))]), "-o", tmp_path / "alike-out",
        "--no-progress")
    assert code == 0, err
    details = [first["detail"] for first in read_json(tmp_path / "alike-out" / "report.json")[
        "skipped_by_reason"]["missing_media"]["first"]]
    assert [detail.split(": ", 1)[1].split(": rename")[0] for detail in details] == [
        f"not found, but its folder holds {near!r}, another name for {name!r} only in {how}"
        for near, name, how in zip(held, given, (
            "its Unicode normalization (NFC and NFD: macOS and its zip files write names "
            "decomposed)", "white space around it", "letter case"))], details
    # a folder of more names than are read for one alike: "not found" alone
    from mimo_data import files
    files._names_alike.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(files, "_MAX_NAMES_ALIKE", 2)
        assert files.not_found(str(tmp_path / "alike" / "astronaut.jpg")) == "not found"
    files._names_alike.cache_clear()


# ----------------------------------------------------------------------------------- strict

@pytest.mark.parametrize("existing_dir", [False, True])
def test_strict_stops_at_the_first_bad_record_and_leaves_nothing(tmp_path, assets, good_records,
                                                                 existing_dir):
    bad = case_missing_media(tmp_path, assets).record
    later_bad = case_unknown_role(tmp_path, assets).record
    path = write_jsonl(tmp_path / "input.jsonl",
                       [good_records[0], good_records[1], bad, good_records[2], later_bad])
    out = tmp_path / "out"
    if existing_dir:
        out.mkdir()

    result = run_cli("build", path, "-o", out, "--strict", "--no-progress", check_rc=1)
    assert f"{path}:{BAD_LINE}" in result.stderr
    assert "missing_media" in result.stderr
    assert f"{path}:5" not in result.stderr        # it stopped at the first bad record
    assert "Traceback" not in result.stderr
    if existing_dir:
        assert out.is_dir() and file_bytes(out) == {} and list(out.iterdir()) == []
    else:
        assert not out.exists()


def test_strict_passes_a_clean_input(capsys, tmp_path, good_records):
    path = write_jsonl(tmp_path / "input.jsonl", good_records)
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "out", "--strict",
                            "--no-progress")
    assert code == 0, err
    assert [row["id"] for row in samples_table(tmp_path / "out")] == [
        r["id"] for r in good_records]


# ------------------------------------------------------------------------ pixel-limit knob

def test_raising_max_image_pixels_keeps_large_images(capsys, tmp_path, assets, bomb_png,
                                                     huge_png, good_records):
    records = [good_records[0], _image_record(bomb_png, "<image>\nAll black?"),
               _image_record(huge_png, "<image>\nStill black?") | {"id": "huge"}]
    path = write_jsonl(tmp_path / "input.jsonl", records)
    out = tmp_path / "out"
    code, _, err = cli_main(capsys, "build", path, "-o", out, "--no-progress",
                            "--max-image-pixels", str(_pixels(huge_png)))
    assert code == 0, err
    report = read_json(out / "report.json")
    assert report["records_skipped"] == 0, report["skipped_by_reason"]
    rows = samples_table(out)
    assert [(r["image_width"], r["image_height"]) for r in rows[1:]] == [
        ([12000], [12000]), ([14000], [14000])]

    code, _, err = cli_main(capsys, "verify", out, "--no-progress")
    assert code == 0, err

    # one pixel less and the largest is skipped again
    code, _, err = cli_main(capsys, "build", path, "-o", tmp_path / "lower", "--no-progress",
                            "--max-image-pixels", str(_pixels(huge_png) - 1))
    assert code == 0, err
    skipped = read_json(tmp_path / "lower" / "report.json")["skipped_by_reason"]
    assert {k: v["count"] for k, v in skipped.items()} == {"image_too_large": 1}
    assert skipped["image_too_large"]["first"][0]["location"] == f"{path}:3"
    assert skipped["image_too_large"]["first"][0]["detail"].endswith(
        "(raise --max-image-pixels to keep it)")      # the option that keeps it
