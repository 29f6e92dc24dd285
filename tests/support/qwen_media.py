"""The Qwen3-VL and Qwen3.5 data tests' conversations over corpus photos and clips (and one of
function calling, ``TOOL_USE``), and the published processor's output for them (the reference
those tests hold mimo's data rules to): records as the shards hold them, the processor loaded
as ``AutoProcessor`` loads it, each clip's frames decoded with plain PyAV, the chat template
given typed parts."""

from __future__ import annotations

import io
import json
from pathlib import Path

import av
import numpy as np
import pytest

from mimo_data.preprocess.preprocessor import media_item

CLIPS = ("pan_h264_24", "zoom_mpeg4_10", "rotated_h264_24")
PHOTOS = ("chelsea.jpg", "camera.png")

# key -> turns (markers lead each content) and the media, in marker order
Conversations = dict[str, tuple[list[dict], list[str]]]


def turns(*texts: str) -> list[dict]:
    """User and assistant turns, alternating."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(texts)]


def typed(messages: list[dict]) -> list[dict]:
    """The messages as the processor's template takes them: media markers as typed parts."""
    found = []
    for message in messages:
        text, parts = message["content"], []
        while text.startswith(("<image>", "<video>")):
            parts.append({"type": text[1:6]})
            text = text[7:]
        found.append({"role": message["role"],
                      "content": [*parts, {"type": "text", "text": text}]})
    return found


# function calling as OpenAI's API and transformers' templates take it: tools, a call with
# text and reasoning, another without, the tools' results, then a later query
TOOL_USE = {
    "tools": [{"type": "function", "function": {
        "name": "weather", "description": "The weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}],
    "messages": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo and Bergen?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two calls.",
         "tool_calls": [{"id": "a", "type": "function", "function": {
             "name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "rain"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "weather", "arguments": {"city": "Bergen", "days": [1, 2],
                                             'unit "C"': "a\tb"}}}]},
        {"role": "tool", "content": "sun"},
        {"role": "assistant", "content": "Rain in Oslo, sun in Bergen."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."}]}


def tool_use_messages() -> list[dict]:
    """TOOL_USE's messages as transformers' templates take them: arguments as objects, a
    call's null content empty."""
    return [{**message, "content": message["content"] or "", "tool_calls": [
        {**call, "function": {**call["function"], "arguments": json.loads(
            call["function"]["arguments"]) if isinstance(call["function"]["arguments"], str)
            else call["function"]["arguments"]}} for call in message["tool_calls"]]}
        if "tool_calls" in message else message for message in TOOL_USE["messages"]]


def processor(replica: Path):
    """The replica's published processor, every frame at its own pixel budget."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(str(replica), cap_pixels_per_frame=False)


def media_bytes(corpus: Path, corpus_videos) -> dict[str, bytes]:
    """The bytes of PHOTOS and CLIPS by name."""
    found = {name: (corpus / "images" / name).read_bytes() for name in PHOTOS}
    return found | {name: corpus_videos[name].data for name in CLIPS}


def records(conversations: Conversations, media: dict[str, bytes]
            ) -> dict[str, tuple[dict, dict]]:
    """key -> (the record, its members' bytes)."""
    found = {}
    for key, (messages, names) in conversations.items():
        items = [media_item("video" if name in CLIPS else "image", media[name], i)
                 for i, name in enumerate(names)]
        found[key] = ({"key": key, "messages": messages, "media": items},
                      {item["member"]: media[name] for item, name in zip(items, names)})
    return found


def frames(data: bytes, rotation: int) -> np.ndarray:
    """Every frame of a clip, plain PyAV, rotated for display."""
    with av.open(io.BytesIO(data)) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    return np.ascontiguousarray(np.rot90(decoded, rotation // 90, axes=(1, 2)))


def reference(processor, names: list[str], record: dict, media: dict[str, bytes],
              typed_already: bool = False):
    """The processor's output for the record (its media ``names`` in marker order) through its
    own chat template, with the video metadata (``typed_already``: the record's messages are
    typed parts as they are)."""
    from PIL import Image, ImageOps
    messages = record["messages"] if typed_already else typed(record["messages"])
    prompt = processor.apply_chat_template(messages, tokenize=False)
    images = [ImageOps.exif_transpose(Image.open(io.BytesIO(media[name]))).convert("RGB")
              for name in names if name in PHOTOS]
    videos = [item for item in record["media"] if item["modality"] == "video"]
    clips = [frames(media[name], item["rotation"])
             for name, item in zip([n for n in names if n in CLIPS], videos)]
    return processor(
        text=[prompt], images=images or None, videos=clips or None,
        video_metadata=[{"total_num_frames": item["frames"], "fps": item["fps"]}
                        for item in videos] or None, return_tensors="pt")
