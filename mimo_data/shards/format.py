"""The on-disk shard format written by `mimo-shard build`.

A dataset directory holds:

- ``NAME-000000.tar`` ... : standard WebDataset tars. One sample = ``KEY.json`` plus media
  members ``KEY.img0.jpg``, ``KEY.aud0.wav`` ... holding the original media bytes. Keys are
  zero-padded output ordinals (no dots), unique within the dataset.
- ``samples.parquet``: one row per sample (see ``SAMPLES_SCHEMA``): key, shard, byte offset and
  size of every member's data inside its tar, media metadata. Random access and exact counts
  without opening a tar.
- ``report.json``: the build report (records read / written / skipped by reason with the
  first few locations, and what each input gave).
- ``skipped.jsonl``: every skipped record, a JSON line each in the order read (an index in
  place's keys repeated across tars last): ``reason``, ``location`` (``file:line``,
  ``file#row``; ``tar:KEY`` for an index in place), ``detail``. For people: no reader needs
  it, and ``index.json`` does not list it.
- ``.mimo-cache/``: tables derived from the rest (``shards/cache.py``): the memory-mapped sample
  table (``sample_table.py``), the records table (``record_table.py``: every ``KEY.json``,
  what remote readers read records from), token tables per preprocessing config
  (``loading/``). Deleting it loses nothing but the time to compute them again.
- ``index.json``: written last and atomically. No index means no dataset.
- ``.mimo-claim``: there while a build or an indexing writes the folder (``shards/claim.py``).

A dataset indexed in place (``mimo-shard index``: existing WebDataset or Energon tars, not
rewritten) is format version 2 (``INDEXED_VERSION``): its index's ``shard_root`` (a local
directory or URL) holds the tars, named relative to it in the index and ``samples.parquet``;
the tars hold no ``KEY.json``, so the records are in ``records.parquet`` (column ``json``: the
bytes a ``KEY.json`` would hold, in sample order) and each media item's ``member`` is the tar's
own suffix (``jpg``, ``0.png``); keys are the tars' own. A mimo that reads only version 1 refuses
it rather than look for the tars beside the index.

``KEY.json`` (the sample record)::

    {"key": "000000042", "id": "<source id or null>",
     "source": {"file": "data/llava.jsonl", "line": 17}      # or {"file": ..., "row": 5}
     "messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "... <image> ...",
                   "weight": 0,                              # weight: only where 0 (below)
                   "tool_calls": [...], "tools": [...]}],    # tool use only (below)
     "media": [                                              # in marker order across messages
        {"modality": "image", "member": "img0.jpg", "format": "jpeg", "bytes": 51234,
         "width": 512, "height": 384, "mode": "RGB"},        # size after EXIF orientation
        {"modality": "audio", "member": "aud0.wav", "format": "wav", "bytes": 96044,
         "sample_rate": 16000, "channels": 1, "frames": 48000, "duration": 3.0}]}

An assistant message with ``"weight": 0`` is in the text but not in the loss (OpenAI's
fine-tuning format); the key is written only where it is 0 (a mimo older than the key, of
2026-11-30, reads such a dataset and trains those answers). The i-th ``<image>`` marker in
reading order (messages in order, left to right) is the i-th image item; the same holds for
``<audio>`` and ``<video>`` (``KEY.vid0.mp4``, with its codec, frame rate, frame count and
display rotation). Media items are listed in marker order.

Two adjacent text parts of a content given as typed parts are joined by ``TEXT_PART_BREAK``
(a private-use character, 2026-12-01; before, a newline): what a chat template writes
between them is its own (nothing in Qwen's, a space after each in LLaVA-1.5's, a newline
before each in llava-interleave's), so preprocessing puts it there for the run's template. A
mimo older than this trains the character as text.

Tool use (2026-12-01; before, such records were skipped as ``tool_use``): an assistant
message's ``tool_calls`` (``{"type": "function", "function": {"name": ..., "arguments":
{...}}}``, arguments an object), a tool's turn as role ``tool`` (with its ``name`` and
``tool_call_id`` where given), and the conversation's ``tools`` on its first message, so
that every part of a conversation (a prefix kept by ``truncate_turns`` too) carries them. A
mimo older than this reads such a record as a malformed one (an unknown role) or without
its calls and tools; the format version is unchanged.

Record kinds (``kind``; a record without one is a conversation, as every dataset built before
kinds were added):

- ``"conversation"``: ``messages`` as above.
- ``"caption"``: a caption pair (img2dataset's ``KEY.jpg`` + ``KEY.txt``, an audio clip and its
  transcript): ``text`` is the caption (no markers), ``media`` holds exactly one item, and
  there is no ``messages``. The preprocessing config says how it trains: as a conversation (a
  configured prompt with the item's marker, the caption as the answer) or as a caption (the
  item's tokens, then the text; only the text trained).
- ``"document"``: an interleaved document (OBELICS / MINT-1T: a document's texts and images in
  order): ``text`` is the whole document with each item's marker in its place, ``media`` in
  marker order, no ``messages``; trained as language modelling over the text.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NotRequired, TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mimo_data.files import file_sha256, parquet_batches
from mimo_data.modalities import MODALITIES, MediaItem
from mimo_data.tally import Tally


RecordKind = Literal["conversation", "caption", "document"]
RECORD_KINDS: tuple[RecordKind, ...] = ("conversation", "caption", "document")


def record_kind(record: ShardRecord) -> RecordKind:
    """The record's kind (``"conversation"`` for records written before kinds existed)."""
    return record.get("kind", "conversation")


class Message(TypedDict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str                 # text with <image> / <audio> / <video> markers in place
    weight: NotRequired[Literal[0]]   # an assistant turn left out of the loss (absent: trained)
    # an assistant turn's calls: {"type": "function", "function": {"name", "arguments": {}}}
    tool_calls: NotRequired[list[dict]]
    name: NotRequired[str]            # a tool's turn: the tool's name, where the record gave it
    tool_call_id: NotRequired[str]    # a tool's turn: the call it answers, where given
    # the conversation's tools (first message only), as chat templates take them:
    # {"type": "function", "function": {"name", "description", "parameters"}}
    tools: NotRequired[list[dict]]


# the build and index reports' count (``report.json`` ``counts``) of answers weighted 0
OUT_OF_LOSS = "answers_out_of_the_loss"


def answers_out_of_loss(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many of ``messages`` are answers weighted 0 (the reports' ``OUT_OF_LOSS``)."""
    return sum(message.get("role") == "assistant" and message.get("weight") == 0
               for message in messages)


# the build and index reports' count of conversations that use tools (calls, tools' turns,
# tools listed), so that a user sees the tool fields were read
USING_TOOLS = "conversations_using_tools"


def uses_tools(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a conversation uses tools (the reports' ``USING_TOOLS``)."""
    return any(message.get("tool_calls") or message.get("tools") or message.get("role") == "tool"
               for message in messages)


# the build and index reports' count of markers ``--markers-first`` placed before the first
# user text
MARKERS_PLACED_FIRST = "markers_placed_first"

# the index report's count of samples whose answer or caption was one of several given
# (Energon's VQA ``answers``, a JSON list of captions): the one that trains was chosen
TEXTS_CHOSEN = "texts_chosen_from_several"

# the build report's count of videos given as folders of frames (``--frames-fps``), each
# stored as one Motion-JPEG clip of them
VIDEOS_FROM_FRAMES = "videos_from_frame_folders"

# the build and index reports' count of videos with display rotation metadata (a phone held
# upright): mimo trains on their frames turned upright, which transformers' own PyAV loading
# does not do, so that one sees how many clips an inference stack may show sideways
VIDEOS_ROTATED = "videos_rotated"

# the build and index reports' count of videos whose marker was LLaVA-NeXT's ``<image>``
# (``records.media_markers``), so that a user sees which convention was read
VIDEOS_MARKED_AS_IMAGES = "videos_marked_with_image"


def conversation_counts(messages: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The reports' counts a conversation adds (``OUT_OF_LOSS``, ``USING_TOOLS``; where not
    0)."""
    return {name: int(number) for name, number in ((OUT_OF_LOSS, answers_out_of_loss(messages)),
                                                   (USING_TOOLS, uses_tools(messages)))
            if number}


def in_loss(message: Mapping[str, Any]) -> bool:
    """Whether a shard message (``Message``, or one made like it) is one the loss covers: an
    answer without ``"weight": 0`` (preprocessing refuses a record whose weight is anything
    else)."""
    return message.get("role") == "assistant" and message.get("weight") != 0


class ShardRecord(TypedDict):
    """``KEY.json``: one sample as the shards hold it."""
    key: str
    id: str | None
    source: dict[str, str | int]  # {"file": ..., "line" | "index" | "row": n}
    kind: NotRequired[RecordKind]  # absent: "conversation"
    messages: NotRequired[list[Message]]  # conversations
    text: NotRequired[str]       # captions (no markers) and documents (markers in place)
    media: list[MediaItem]       # in marker order across messages (or the document's text)


_LOCATIONS = {"line": "{}:{}", "index": "{}[{}]", "row": "{}#{}"}


def location(path: str, kind: str, number: int) -> str:
    """A record's human-readable location from its origin (``kind``: line, index or row)."""
    return _LOCATIONS[kind].format(path, number)


def record_origin(record: ShardRecord) -> str:
    """Where a sample was read from, as the build named it (``llava.json[15]``, ``a.jsonl:3``,
    ``t.parquet#8``; a tar indexed in place: its tar and key), and its id."""
    source = record.get("source") or {}
    kind = next((kind for kind in ("line", "index", "row") if kind in source), None)
    where = (location(str(source["file"]), kind, int(source[kind])) if kind and "file" in source
             else f"{source['file']} key {source['key']}" if "key" in source
             and "file" in source else "")
    named = f"id {record['id']!r}" if record.get("id") is not None else ""
    return ", ".join(part for part in (where, named) if part)


FORMAT_NAME = "mimo-shards"
FORMAT_VERSION = 1            # what `mimo-shard build` writes
INDEXED_VERSION = 2           # `mimo-shard index`: shard_root, records.parquet
READ_VERSIONS = (FORMAT_VERSION, INDEXED_VERSION)

INDEX_FILE = "index.json"
SAMPLES_FILE = "samples.parquet"
REPORT_FILE = "report.json"
SKIPPED_FILE = "skipped.jsonl"              # every skipped record (report.json: the first few)
FAILED_REPORT_FILE = "report.failed.json"   # a run that kept no sample, beside an old dataset
FAILED_SKIPPED_FILE = "skipped.failed.jsonl"  # and its skipped list
RECORDS_FILE = "records.parquet"   # indexed in place only
STAGING_DIR = ".staging"
CLAIM_FILE = ".mimo-claim"         # held by the run writing the folder (shards/claim.py)
# the report's reason for a sample an Energon split.yaml excludes (the dataset's own choice)
SPLIT_EXCLUDED = "excluded_by_split_yaml"
CLAIM_PROBE = f"{CLAIM_FILE}.now-"  # + a run's token: the store's clock read (a bucket's)

ROLES = ("system", "user", "assistant", "tool")
# between two adjacent text parts of a content (the module docstring)
TEXT_PART_BREAK = "\ue00b"


def shard_name(name: str, index: int) -> str:
    """File name of shard ``index`` of dataset ``name``."""
    return f"{name}-{index:06d}.tar"


def sample_key(ordinal: int) -> str:
    """Key of the ``ordinal``-th sample written (no dots, sorts in write order)."""
    return f"{ordinal:09d}"


# crc32 of the member's bytes: lets verify name the member a changed shard byte is in (absent
# from datasets built before it was added).
MEMBER_STRUCT = pa.struct([("name", pa.string()), ("offset", pa.int64()), ("size", pa.int64()),
                           ("crc32", pa.int64())])


def summary_column(modality: str, field: str) -> str:
    """The samples.parquet column of a modality's summary field: ``image_width``."""
    return f"{modality}_{field}"


def modality_counts(parquet: str) -> dict[str, dict[str, int]]:
    """The index's ``modalities`` of a ``samples.parquet``: per modality the samples holding
    an item of it and its items, and the text-only samples, from each modality's first summary
    column (one value an item), a batch at a time."""
    columns = {name: summary_column(name, next(iter(modality.summary_fields)))
               for name, modality in MODALITIES.items()}
    counts: dict[str, dict[str, int]] = {
        **{name: {"samples": 0, "items": 0} for name in MODALITIES}, "text_only": {"samples": 0}}
    for batch in parquet_batches(parquet, list(columns.values())):
        media = np.zeros(batch.num_rows, np.int64)
        for name, column in columns.items():
            items = pc.list_value_length(batch.column(column)).fill_null(0).to_numpy()
            counts[name]["items"] += int(items.sum())
            counts[name]["samples"] += int((items > 0).sum())
            media += items
        counts["text_only"]["samples"] += int((media == 0).sum())
    return counts


def index_fields(staging: str, shards: list[dict[str, Any]], report: Tally,
                 files: Sequence[str]) -> dict[str, Any]:
    """The index.json fields a build and an indexing in place both write, of the dataset in
    ``staging``: its shards, totals and modality counts, the size and sha256 of each of
    ``files``, and the records read and skipped (with what the kept ones hold, where any). The
    caller adds the format, version, name and build settings."""
    return {
        "shards": shards,
        "totals": {"samples": report.kept, "shards": len(shards),
                   "bytes": sum(shard["bytes"] for shard in shards)},
        "modalities": modality_counts(os.path.join(staging, SAMPLES_FILE)),
        "files": {name: {"bytes": os.path.getsize(os.path.join(staging, name)),
                         "sha256": file_sha256(os.path.join(staging, name))}
                  for name in files},
        "report": {"records_read": report.seen, "records_skipped": report.skipped_total,
                   **({"counts": dict(sorted(report.counts.items()))} if report.counts
                      else {})},
    }


# One row per sample in samples.parquet, in write order (shard by shard, key order); then per
# modality its items' summary fields (``Modality.summary_fields``) in marker order:
# image_width, image_height, audio_duration, video_width, video_height, video_duration.
SAMPLES_SCHEMA = pa.schema([
    ("key", pa.string()),
    ("shard", pa.string()),
    ("id", pa.string()),
    ("source", pa.string()),                   # "file:line" or "file#row"
    ("members", pa.list_(MEMBER_STRUCT)),      # all members, in tar order (sorted by name)
    ("num_turns", pa.int32()),
    ("text_chars", pa.int64()),
    *((summary_column(name, field), pa.list_(pa.type_for_alias(kind)))
      for name, modality in MODALITIES.items() for field, kind in modality.summary_fields.items()),
])
