"""Input readers: LLaVA/ShareGPT JSON and JSONL, Parquet tables, NeMo speech manifests.

A JSON(L) record or Parquet table is a conversation (``conversations`` / ``messages``), an
interleaved document (OBELICS / MINT-1T: parallel ``texts`` and ``images`` lists) or a caption
pair (``caption`` and one media item, no conversation); ``RawRecord.kind`` says which.

Every source splits into cheap ``Task``s in the main process (one per record, in file order)
and turns a task into a ``RawRecord`` in whichever process validates it. Parquet is read with
pyarrow one row group at a time, so embedded media never sit in memory all at once.
"""

from __future__ import annotations

import codecs
import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mimo_data.errors import listed
from mimo_data.files import PARQUET_MAGIC, compression_of, decompress_command, not_found
from mimo_data.shards import storage
from mimo_data.shards.format import location
from mimo_data.modalities import MARKERS, MODALITIES
from mimo_data.shards.records import (PART_MODALITIES, RecordError, as_turns,
                                      conversation_turns, json_type, mmc4_document,
                                      tool_lists)


class SourceError(Exception):
    """A whole input that cannot be read (not one bad record): the build stops."""


@dataclass(frozen=True)
class Task:
    """One record to read: ``locator`` is what its source needs to load it."""
    source: int
    locator: Any
    location: str          # human readable: "file:line", "file[index]", "file#row"
    origin: tuple          # ("line", n) | ("index", i) | ("row", r), stored in the sample JSON


@dataclass
class RawRecord:
    """A record before normalization: ``media`` maps a modality name to its items' refs
    (paths, bytes or ``{bytes, path}``) in marker order (a document's ``image``: its
    ``images`` as given, a list parallel to ``text`` or what ``normalize_document``
    refuses). ``text``: a caption's, or a document's ``texts`` list. ``audio_duration``: a
    speech manifest's ``duration`` of its clip, checked against the probed one
    (``validate.check_audio_duration``). ``tools``: a conversation's tool lists
    (``records.tool_lists``), where the record has them; ``system``: its own system prompt
    (LLaMA-Factory's ShareGPT ``system``), where it has one."""
    id: str | None
    turns: object
    media: dict[str, Any] = field(default_factory=dict)
    kind: str = "conversation"
    text: object = None
    audio_duration: float | None = None
    tools: object = None
    system: object = None
    objects: object = None        # ms-swift's grounding objects, where the record has them
    form: str = ""                # a document's published form other than texts/images: mmc4


def media_field(modality: str) -> str:
    """The record key and Parquet column role of a modality's item list: ``images``; a
    single item may also come under the modality's own name (``image``)."""
    return f"{modality}s"


# Keys and columns that users' exports name a record's media by and mimo does not read
# (``image_path``, ``img``, ``video_file``, ``audio_filepath``, in any case: ``imagePath``,
# ``Image``...): a record or a table whose media are under one of them is refused, naming it,
# not built text-only.
# (A URL is no such key: mimo downloads nothing, and a URL kept as metadata is common.)
_UNREAD_MEDIA_NAME = {
    "image": re.compile(r"(image|img|picture|photo)s?(_?(file|path|filename|bytes))?s?"),
    "video": re.compile(r"videos?(_?(file|path|filename|bytes))?s?"),
    "audio": re.compile(r"(audio|wav)s?(_?(file|filepath|path|filename|bytes))?s?"),
}


def _unread_media_names(names, read: set[str]) -> dict[str, str]:
    """modality -> a key or column among ``names`` that looks like its media (or is its
    name misspelt: ``imgae``) and is none of the ``read`` ones."""
    found: dict[str, str] = {}
    for modality, pattern in _UNREAD_MEDIA_NAME.items():
        name = next((n for n in names if n not in read and (
            pattern.fullmatch(str(n).lower()) or _misspelt(str(n).lower(), modality))), None)
        if name is not None:
            found[modality] = name
    return found


def _misspelt(name: str, modality: str) -> bool:
    """Whether ``name`` is ``modality`` or its plural with two adjacent letters swapped
    (``imgae``, ``vidoe``): a looser likeness would take a text record's own keys (``audit``,
    ``videoid``, ``imagen``) for media."""
    return any(len(name) == len(word) and name != word and any(
        name == word[:i] + word[i + 1] + word[i] + word[i + 2:] for i in range(len(word) - 1))
        for word in (modality, modality + "s"))


def _check_unread(record: dict, media: dict[str, list], unread: dict[str, str], how: str,
                  text: object = None) -> None:
    """RecordError where a modality the record has no item of has a value under a key or
    column that looks like its media (``unread``) and mimo does not read, and either the
    record has no media at all (it would train text-only) or its ``text`` marks that modality
    (the marker's item is there): a source clip's path kept beside a record's image is
    metadata. ``how``: what reads it instead."""
    if not unread:
        return
    bare = not any(media.values())
    marked = {modality for modality, marker in MARKERS.items() if marker in str(text)}
    for modality, name in unread.items():
        if not media.get(modality) and _as_list(record.get(name)) and (
                bare or modality in marked):
            what = how.format(name=name, modality=modality, items=media_field(modality))
            raise RecordError("malformed_record", f"the record names its {modality} under "
                              f"{name!r}, which mimo does not read: {what}")


def _media_items(plural, single, where: str, modality: str) -> list:
    """A record's ``modality`` items: its list (``images``), else its single item (``image``);
    a null, empty or blank value or item is none (tables and ``datasets.to_json`` write a null
    ``images`` beside an ``image``). Both given, and different: refused."""
    items, one = ([item for item in _as_list(value) if not _none(item)]
                  for value in (plural, single))
    if items and one and items != one:
        raise RecordError("malformed_record", f"{where} gives both {media_field(modality)!r} "
                          f"and {modality!r}, with different items: give one")
    return items or one


def _none(item) -> bool:
    """An item that names nothing: null, blank, or a table's struct whose fields are all
    null or empty (``{bytes: null, path: null}``)."""
    if isinstance(item, dict):
        return not any(item.values())
    return item is None or isinstance(item, str) and not item.strip()


_RENAME = "give it as {items!r} (a list) or {modality!r} (rename the key in the source data)"
_READ_COLUMN = "read that column with --{modality}-column {name}"


def _part_keys(modality: str) -> tuple[str, ...]:
    """Keys of a transformers chat content part that may name its item, in the order
    transformers reads them (``{"type": "image", "image": "photo.jpg"}``; ``base64``: its
    bytes as base64 text, as axolotl writes them)."""
    return (modality, "url", "path", "base64")


def _media_parts(turns) -> Iterator[tuple[str, dict]]:
    """Each media content part of ``turns`` with its modality, in reading order. Malformed
    turns yield nothing here: normalization reports them."""
    for turn in turns if isinstance(turns, list) else ():
        content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in PART_MODALITIES:
                yield PART_MODALITIES[kind], part


def _part_items(turns) -> dict[str, list]:
    """Per modality, the item each of its content parts names (None for a bare part), in
    reading order."""
    found: dict[str, list] = {name: [] for name in MODALITIES}
    for modality, part in _media_parts(turns):
        found[modality].append(_part_item(part, part["type"]))
    return found


def _indexed(items: list, turns, modality: str, listed: list | None = None) -> list:
    """``items`` (the record's list) in the order its bare ``modality`` parts name them by
    ``index`` (TRL's llava-instruct-mix-vsft rows: ``{"type": "image", "index": 1, "text":
    null}``): the marker of each part takes the item it names, not the next in the list.
    Parts without an index take the list's order. An index counts the list as written
    (``listed``: with its null items, which are none)."""
    indices = [part.get("index") for of, part in _media_parts(turns) if of == modality]
    given = [index for index in indices if index is not None]
    if not given:
        return items
    if not listed or [item for item in listed if not _none(item)] != items:
        listed = items                 # the items came from the single `image`, not the list
    field_name = media_field(modality)
    if len(given) != len(indices) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(listed)
            for i in given):
        raise RecordError("malformed_record", f"the {modality} content parts' 'index' values "
                          f"{indices[:12]} do not each name one of the {len(listed)} "
                          f"{field_name!r} items (0 to {len(listed) - 1}): give every part "
                          "the index of its item, or none (the list's order)")
    null = next((i for i in given if _none(listed[i])), None)
    if null is not None:
        raise RecordError("malformed_record", f"an index of the {modality} content parts names "
                          f"{field_name}[{null}], which is null: name an item that is there")
    unnamed = sorted({i for i, item in enumerate(listed) if not _none(item)} - set(given))
    if unnamed:
        raise RecordError("malformed_record", f"{field_name}[{unnamed[0]}] is named by no "
                          f"{modality} content part's 'index' ({indices[:12]}): every item "
                          "needs its part (its marker)")
    return [listed[i] for i in given]


def _part_item(part: dict, kind: str):
    """The item a media part names: transformers' ``{"type": "image", "image" | "url" |
    "path": ...}``; OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL
    alone; ``video_url`` alike), a URL being a path, ``file://`` or ``data:`` one (read where
    every reference is: ``validate``); OpenAI's ``{"type": "input_audio", "input_audio":
    {"data": <base64>, "format": "wav"}}`` as the ``data:`` URL of its bytes."""
    if kind in MODALITIES:
        key = next((key for key in _part_keys(kind) if part.get(key) is not None), None)
        if key == "base64" and isinstance(part[key], str):     # bytes as text: never a path
            return f"data:;base64,{part[key]}"
        return None if key is None else part[key]
    value = part.get(kind)
    if kind == "input_audio":
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            return None
        return f"data:audio/{value.get('format', '')};base64,{value['data']}"
    url = value.get("url") if isinstance(value, dict) else value
    return url if isinstance(url, str) and url else None


def with_part_items(media: dict[str, list], turns, listed: dict[str, list] | None = None
                    ) -> dict[str, list]:
    """``media`` plus, for each modality it has no items of, the items its content parts name
    (transformers' ``{"type": "image", "image" | "url" | "path": ...}``). RecordError
    ``malformed_record`` when a modality has both, or only some of its parts name an item."""
    merged = dict(media)
    for modality, items in _part_items(turns).items():
        named = [item for item in items if item is not None]
        if not named:
            if media.get(modality):
                merged[modality] = _indexed(media[modality], turns, modality,
                                            (listed or {}).get(modality))
            continue
        openai = [kind for kind, of in PART_MODALITIES.items() if of == modality and kind != of]
        keys = "/".join(map(repr, _part_keys(modality))) + "".join(
            f", or {kind}'s url" for kind in openai)
        if media.get(modality):
            raise RecordError("malformed_record", f"the record has both top-level "
                              f"{media_field(modality)!r}/{modality!r} items and {modality} "
                              f"items named in its content parts ({keys}); give each item "
                              "once: in the list (with bare parts) or in its part")
        if len(named) != len(items):
            raise RecordError("malformed_record", f"{len(items) - len(named)} of the "
                              f"{len(items)} {modality} content parts name no item ({keys}); "
                              f"name one in every part, or in none and list them in "
                              f"{media_field(modality)!r}")
        merged[modality] = named
    return merged


def _are_exchanges(turns) -> bool:
    """Whether ``turns`` are the_cauldron's ``{user, assistant}`` exchanges."""
    return isinstance(turns, list) and bool(turns) and all(
        isinstance(t, dict) and "user" in t and "assistant" in t
        and not {"role", "from"} & t.keys() for t in turns)


def exchanges(turns, media: dict[str, list]):
    """``turns`` as role/content messages when they are the_cauldron's ``{user, assistant}``
    exchanges (else as they are); without a marker in them, ``media``'s items go before the
    first user text, where Idefics2 trained on them."""
    if not _are_exchanges(turns):
        return turns
    messages = [{"role": role, "content": turn[role]} for turn in turns
                for role in ("user", "assistant")]
    first = messages[0]["content"]
    if isinstance(first, str) and not any(
            isinstance(m["content"], str) and marker in m["content"]
            for m in messages for marker in MARKERS.values()):
        lead = "".join(f"{MARKERS[name]}\n" * len(items) for name, items in media.items())
        messages[0] = {"role": "user", "content": lead + first}
    return messages


def _as_list(value) -> list:
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _record_id(value) -> str | None:
    """A record's id as text: a string, or a number's digits (``7``: ``"7"``); RecordError for
    what names no record (true/false, an object, a list)."""
    if value is None:
        return None
    if isinstance(value, (bool, dict, list)):
        raise RecordError("malformed_record", f"the id is {json.dumps(value, default=str)}: "
                          "give each record a string or a number as its id")
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:   # e.g. a lone surrogate from a "\ud800" escape
        raise RecordError("invalid_utf8", f"the id is not valid Unicode: {exc}") from None
    return text


def _id_of(read: Callable[[], Any], key: str) -> str | None:
    """A record's ``key`` as an id, from ``read()`` (the record): None where it has none, or
    where the record, or its id, cannot be read."""
    try:
        record = read()
        return _record_id(record.get(key)) if isinstance(record, dict) else None
    except (RecordError, OSError, ValueError):
        return None


def _json_object(raw: bytes, what: str) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError("invalid_utf8", f"{what} is not UTF-8: {exc}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:     # its own "line 2" would read as the file's
        # (the control-character message ends in "at" already)
        raise RecordError("malformed_json", f"{what} is not valid JSON: "
                          f"{exc.msg.removesuffix(' at')} at its character {exc.pos + 1}") \
            from None
    if not isinstance(value, dict):
        raise RecordError("malformed_json", f"{what} is a JSON {json_type(value)}, "
                          "expected an object")
    return value


class ConversationFile:
    """LLaVA/ShareGPT records: a JSON array (``.json``) or one object per line (``.jsonl``).

    Keys: ``id``, per modality ``image``/``images``, ``audio``/``audios``,
    ``video``/``videos`` (one item or a list), and ``conversations`` (``from``/``value``) or
    ``messages`` (``role``/``content``; content parts may name their items instead).
    """

    def __init__(self, path: str, media_root: str | None = None, lines: bool = False):
        self.path = path
        self.media_root = media_root or os.path.dirname(os.path.abspath(path))
        self.lines = lines   # one object per line (JSONL), else a JSON array

    def tasks(self, source: int):
        if self.lines:
            yield from _line_tasks(self.path, source)
            return
        records = self.records()
        for i in range(len(records)):
            record, records[i] = records[i], None    # released once its task is made
            yield Task(source, record, location(self.path, "index", i), ("index", i))

    def records(self) -> list:
        """A JSON array file's records: parsed whole (JSONL is read a line at a time)."""
        try:
            # utf-8-sig: a leading BOM (as Windows editors write) is not part of the array
            text = Path(self.path).read_bytes().decode("utf-8-sig")
            if not text.strip():                    # no record, as an empty JSONL holds
                return []
            records = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            what = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else "not valid JSON"
            objects = isinstance(exc, json.JSONDecodeError) and \
                exc.msg == "Extra data" and text.lstrip().startswith("{")
            raise SourceError(f"{self.path}: {what} ({exc})" + (
                ": JSON objects one after another, written over several lines (pretty-"
                "printed; jq without -c): write one a line, as JSONL (e.g. jq -c . FILE > "
                "records.jsonl)" if objects else
                "; fix it, or convert it to JSONL so that bad records can be skipped one by "
                "one (one object a line, its first character no '[', which reads as a JSON "
                "list whatever the file's name; e.g. jq -c '.[]' FILE > records.jsonl, where "
                "jq reads it)")) from None
        if isinstance(records, dict) and (keys := _record_keys(records)):
            raise SourceError(f"{self.path}: a JSON object, one record (its keys "
                              f"{listed(keys)}), where a JSON array of records is read: put it "
                              f"in [ ], or write it as one JSONL line (e.g. jq -c . {self.path} "
                              "> records.jsonl)")
        if not isinstance(records, list):
            inside = [key for key, value in records.items() if isinstance(value, list)] \
                if isinstance(records, dict) else []
            # LLaMA-Factory's dataset_info.json: each dataset's file_name, its column mapping
            registry = isinstance(records, dict) and records and all(
                isinstance(value, dict) and "file_name" in value for value in records.values())
            raise SourceError(f"{self.path}: expected a JSON array of records, "
                              f"got a JSON {json_type(records)}" + (
                                  f" holding a list under {inside[0]!r}: give that list as the "
                                  f"file (e.g. jq '.{inside[0]}' {self.path} > records.json)"
                                  if len(inside) == 1 else
                                  ": LLaMA-Factory's dataset_info.json, which names datasets' "
                                  "files; give the files it names (their keys named as mimo "
                                  "reads them: docs/preprocessing.md, 'Coming from "
                                  "LLaMA-Factory')" if registry else ""))
        return records

    def record_id(self, task: Task) -> str | None:
        """The id of the record ``task`` locates, where it has one (for a skip refused while
        the record was read); None where it cannot be read."""
        return _id_of(lambda: _json_object(task.locator, "the line")
                      if isinstance(task.locator, bytes) else task.locator, "id")

    def load(self, task: Task) -> RawRecord:
        record = task.locator
        if isinstance(record, bytes):
            record = _json_object(record, "the line")
        elif not isinstance(record, dict):
            raise RecordError("malformed_json", f"record is a JSON {json_type(record)}, "
                              "expected an object")
        turns = conversation_turns(record)
        if turns is None and _are_exchanges(record.get("texts")):
            turns = record["texts"]         # the_cauldron's rows written as JSON(L)
        elif record.get("texts") is not None and (
                record["texts"] != [] or turns is None and "caption" not in record
                and "text_list" not in record):
            # (a merged export's null, or [] beside a conversation, caption or MMC4 document:
            # absent; [] alone: an empty document, normalize_document's empty_document as a
            # table's row is)
            also = [k for k in ("conversations", "messages", "caption") if record.get(k)]
            if also:            # one of them would be left out without a word
                raise RecordError("malformed_record", f"both a document's 'texts' and "
                                  f"{also[0]!r}: a record is one document, conversation or "
                                  "caption pair; give each its own record")
            return RawRecord(id=_record_id(record.get("id")), turns=None, kind="document",
                             text=record["texts"], media={"image": record.get("images")})
        elif turns is None and "text_list" in record and "image_info" in record:
            texts, images = mmc4_document(record["text_list"], record["image_info"])
            return RawRecord(id=_record_id(record.get("id")), turns=None, kind="document",
                             text=texts, media={"image": images}, form="mmc4")
        media = {name: _media_items(record.get(media_field(name)), record.get(name),
                                    "the record", name) for name in MODALITIES}
        unread = _unread_media_names(record, {*MODALITIES, *map(media_field, MODALITIES)})
        if "caption" in record and turns is None:
            _check_unread(record, media, unread, _RENAME)
            return RawRecord(id=_record_id(record.get("id")), turns=None, media=media,
                             kind="caption", text=record["caption"])
        if turns is None and "audio_filepath" in record:
            raise RecordError("malformed_record", "a speech manifest's record (audio_filepath) "
                              "read as a conversation (in a JSON list, among conversations, "
                              "or with --input-format llava): a manifest is a JSONL file of "
                              "such records alone, one per line, as NeMo writes it; give them "
                              "a file of their own (read as a manifest when its first record "
                              "is one, or with --input-format manifest)")
        if turns is None and len(record) == 1:        # (looked at only for no conversation)
            [(key, value)] = record.items()
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                raise RecordError("malformed_record", f"no conversation: the record wraps a "
                                  f"list of {len(value)} objects under {key!r} (a file of "
                                  "records inside an object?): give that list as the file, "
                                  f"e.g. jq '.{key}' FILE > records.json, or jq -c "
                                  f"'.{key}[]' FILE > records.jsonl")
        transcript = next((key for key in _TRANSCRIPT_KEYS if isinstance(record.get(key), str)),
                          None)
        if turns is None and media["audio"] and transcript:
            raise RecordError("malformed_record", f"no conversation: a speech record, its audio "
                              f"and its transcript under {transcript!r} (Common Voice's, a "
                              "datasets to_json's form): give the transcript as 'caption' "
                              "(a caption pair: the model hears the audio, writes the text), "
                              f"e.g. jq -c '. + {{caption: .{transcript}}} | "
                              f"del(.{transcript})' FILE > pairs.jsonl, or write a NeMo "
                              "manifest (audio_filepath, duration, text)")
        if turns is None:
            raise RecordError("malformed_record", f"no conversation: the record has the keys "
                              f"{listed(map(repr, sorted(record)[:12]))}, and mimo reads "
                              "'messages' or "
                              "'conversations' (role/content or from/value turns), a 'caption' "
                              "pair, a 'texts' document or MMC4's 'text_list' and "
                              "'image_info': convert other forms first (alpaca's "
                              "instruction/input/output, query/response, video QA's q/a)")
        key = "conversations" if record.get("conversations") is not None else "messages"
        turns = as_turns(turns, f"its {key!r}")
        _refuse_preference(record, turns)
        turns = exchanges(turns, media)
        media = with_part_items(media, turns, {
            name: _as_list(record.get(media_field(name))) for name in MODALITIES})
        _check_unread(record, media, unread, _RENAME, turns)
        return RawRecord(id=_record_id(record.get("id")), turns=turns, media=media,
                         tools=tool_lists(record), system=record.get("system"),
                         objects=record.get("objects"))


# where speech datasets keep a clip's transcript (Common Voice's sentence, LibriSpeech's and
# most datasets' text)
_TRANSCRIPT_KEYS = ("sentence", "text", "transcript", "transcription", "normalized_text")


# the keys of preference training's records (KTO's flags, a preference pair's answers)
PREFERENCE_KEYS = ("kto_tag", "label", "chosen", "rejected")


def _refuse_preference(record: dict, turns) -> None:
    """RecordError for a record of preference training, which supervised fine-tuning would
    read wrongly: a KTO example marked undesirable (LLaMA-Factory's ``kto_tag``, ms-swift's
    ``label``: false), whose answer would train as one to give, and LLaMA-Factory's pair of
    ``chosen`` and ``rejected`` answers beside ``turns`` ending on the user's turn."""
    flag = next((key for key in ("kto_tag", "label") if record.get(key) is False), None)
    if flag:
        raise RecordError("malformed_record", f"{flag!r} is false: a KTO example of an answer "
                          "not to give, which supervised fine-tuning would train as one to "
                          "give; leave the record out (or keep its context with the answer's "
                          f"'weight': 0); where {flag!r} means something else, rename it")
    last = turns[-1] if isinstance(turns, list) and turns else None
    role = last.get("role", last.get("from")) if isinstance(last, dict) else None
    if record.get("chosen") is not None and record.get("rejected") is not None and \
            str(role).lower() in ("user", "human"):
        raise RecordError("malformed_record", "'chosen' and 'rejected' beside a conversation "
                          "ending on the user's turn: a preference pair (LLaMA-Factory's), "
                          "which mimo does not train; for supervised fine-tuning on the chosen "
                          "answer, append it to the conversation as its last assistant turn "
                          "and leave 'rejected' out")


class SpeechManifest:
    """NeMo-style JSONL (``audio_filepath``, ``text``, ``duration``): one user/assistant turn
    each. A ``duration`` that disagrees with the file's is refused
    (``validate.check_audio_duration``), as is a non-zero ``offset``: mimo does not cut
    segments out of a file."""

    def __init__(self, path: str, instruction: str, media_root: str | None = None):
        self.path = path
        self.instruction = instruction
        self.media_root = media_root or os.path.dirname(os.path.abspath(path))

    def tasks(self, source: int):
        yield from _line_tasks(self.path, source)

    def record_id(self, task: Task) -> str | None:
        """The id of the line ``task`` locates, where it has one (``ConversationFile``'s)."""
        return _id_of(lambda: _json_object(task.locator, "the line"), "id")

    def load(self, task: Task) -> RawRecord:
        record = _json_object(task.locator, "the line")
        audio, text = record.get("audio_filepath"), record.get("text")
        if not isinstance(audio, str) or not isinstance(text, str):
            given = {key: type(value).__name__ for key, value in record.items()}
            lacking = [key for key, value in (("audio_filepath", audio), ("text", text))
                       if not isinstance(value, str)]
            raise RecordError("malformed_record", "a manifest line needs string fields "
                              f"'audio_filepath' and 'text'; this one has {given}, no string "
                              f"{' nor '.join(map(repr, lacking))} (under another key? "
                              "rename it)")
        offset = record.get("offset")
        if offset is not None and not (isinstance(offset, (int, float)) and
                                       not isinstance(offset, bool) and math.isfinite(offset)
                                       and offset >= 0):
            raise RecordError("malformed_record", f"'offset' of {audio} is {offset!r}: give "
                              "where the segment starts in seconds (0 for the whole file), or "
                              "leave the field out")
        if offset:
            raise RecordError("malformed_record", "segments with a non-zero 'offset' are not "
                              "supported; cut the clip into its own file first")
        # 0 (what manifest writers give an empty file): the file's probe says what it holds
        duration = record.get("duration")
        if duration is not None and not (isinstance(duration, (int, float)) and
                                         not isinstance(duration, bool) and
                                         math.isfinite(duration) and duration >= 0):
            raise RecordError("malformed_record", f"'duration' of {audio} is {duration!r}: give "
                              "the clip's length in seconds, or leave the field out")
        typed = [marker for marker in MARKERS.values() if marker in text]
        if typed:           # the markers check would speak of turns the line does not have
            raise RecordError("marker_mismatch", f"the transcript ('text') holds {typed[0]}, "
                              "which marks a medium's place: reword it (a transcript is the "
                              "answer the model writes)")
        turns = [{"role": "user", "content": f"<audio>\n{self.instruction}"},
                 {"role": "assistant", "content": text}]
        return RawRecord(id=_record_id(record.get("id")), turns=turns, media={"audio": [audio]},
                         audio_duration=duration)


# transcript columns of the hub's speech tables: LibriSpeech's, Common Voice's, FLEURS',
# VoxPopuli's
TRANSCRIPT_COLUMNS = ("text", "sentence", "transcription", "transcript", "normalized_text",
                      "raw_transcription")


class ParquetTable:
    """Hugging Face style tables: a media column per modality (``images``/``image``,
    ``audios``/``audio``, ``videos``/``video``) of ``{bytes, path}`` structs (or lists of them)
    or path strings; the conversation as a list of turns or a JSON string. A table with a
    ``texts`` column holds interleaved documents (OBELICS / MINT-1T, with ``images``) unless
    its items are ``{user, assistant}`` exchanges (the_cauldron: a conversation); one with a
    ``caption`` column and no conversation, caption pairs. A column named on the command line
    decides the kind."""

    def __init__(self, path: str, media_root: str | None = None, columns: dict | None = None):
        self.path = path
        self.media_root = media_root or os.path.dirname(os.path.abspath(path))
        try:
            schema = pq.ParquetFile(path).schema_arrow
        except (pa.ArrowException, OSError) as error:     # its footer: read first
            raise SourceError(
                f"{path}: not a readable Parquet file ({error}): a partial download or a "
                "damaged copy (fetch it again)" + (
                    "; a JSON or JSONL file is read with --input-format llava or manifest"
                    if not path.lower().endswith(".parquet") else "")) from None
        names = set(schema.names)
        wanted = dict(columns or {})
        named = [role for role in ("texts", "conversation", "caption") if wanted.get(role)]
        if len(named) > 1:
            raise SourceError(f"{path}: --texts-column, --messages-column and --caption-column "
                              "each choose what a row is (a document, a conversation, a "
                              "caption pair): give one")
        if not named and "texts" in names and not wanted.get("conversation") and \
                _holds_exchanges(schema.field("texts").type):
            named, wanted["conversation"] = ["conversation"], "texts"
        self.columns = {role: _pick_column(path, names, wanted.get(role), candidates)
                        for role, candidates in (
                            ("id", ("id",)), ("tools", ("tools", "functions")),
                            ("system", ("system",)), ("objects", ("objects",)),
                            ("conversation", ("messages", "conversations")),
                            ("texts", ("texts",)), ("caption", ("caption",)),
                            *((media_field(name), (media_field(name), name))
                              for name in MODALITIES))}
        for role in ("texts", "conversation", "caption"):
            if named and role != named[0]:
                self.columns[role] = None        # the named column decides what a row is
        # a row's single item where its list is null or empty (both columns, none named)
        self.single = {name: name for name in MODALITIES if not wanted.get(media_field(name))
                       and {name, media_field(name)} <= names}
        # columns that look like a modality's media this table has no column of: read, so
        # that a row whose items are there alone is refused, naming the flag that reads them
        self.unread = {modality: name for modality, name in _unread_media_names(
            sorted(names), set()).items() if not self.columns[media_field(modality)]}
        # preference training's columns, read to refuse its rows (``_refuse_preference``)
        self.preference = tuple(name for name in PREFERENCE_KEYS if name in names)
        found = [role for role in ("texts", "conversation", "caption") if self.columns[role]]
        if not found and {"text_list", "image_info"} <= names:
            raise SourceError(f"{path} holds MMC4's columns text_list and image_info: MMC4 is "
                              "read from its JSON / JSONL records (mimo-shard build "
                              "FILE.jsonl); write the table as JSONL first, e.g. python -c "
                              "\"import json, pyarrow.parquet as pq; [print(json.dumps(r)) for "
                              f"r in pq.read_table('{path}').to_pylist()]\" > mmc4.jsonl")
        if not found:
            # a speech table's transcript column, as the hub's ASR sets name it
            transcript = next((c for c in TRANSCRIPT_COLUMNS if c in names), None)
            hint = (f" ({transcript!r} looks like captions or a speech table's transcripts: "
                    f"--caption-column {transcript} reads each row as a caption pair of its "
                    "medium, trained as the preprocessing config's captions say)"
                    if transcript else "")
            raise SourceError(f"{path}: none of the columns 'messages', 'conversations' "
                              f"(conversations), 'texts' (documents) or 'caption' (caption "
                              f"pairs) found (columns are {listed(sorted(names))}): name the "
                              "column holding them with --messages-column, --texts-column or "
                              "--caption-column; another form (question/answer, alpaca's "
                              "instruction/output) is converted to messages first"
                              f"{hint}")
        # documents beside conversations (none named: each found by its name), a merged
        # table: which a row is cannot be told (a caption column beside either is metadata)
        if found[:2] == ["texts", "conversation"]:
            raise SourceError(f"{path}: the columns {self.columns['texts']!r} (documents) and "
                              f"{self.columns['conversation']!r} (conversations): name the one "
                              "its rows are with --texts-column or --messages-column (one table "
                              "is one form; split a merged table first)")
        self.kind = {"texts": "document", "conversation": "conversation",
                     "caption": "caption"}[found[0]]
        if self.kind == "caption" and not self.unread and not any(
                self.columns[media_field(name)] for name in MODALITIES):
            raise SourceError(f"{path}: caption pairs (column {self.columns['caption']!r}) "
                              f"and no column of their media found (columns are "
                              f"{listed(sorted(names))}): name it with --image-column (or "
                              "--audio-column, --video-column)")

    def tasks(self, source: int):
        metadata = pq.ParquetFile(self.path).metadata
        row = 0
        for group in range(metadata.num_row_groups):
            for offset in range(metadata.row_group(group).num_rows):
                yield Task(source, (group, offset), location(self.path, "row", row), ("row", row))
                row += 1

    def row_group_starts(self) -> list[int]:
        """The first row of each row group, and the number of rows last."""
        metadata = pq.ParquetFile(self.path).metadata
        starts = [0]
        for group in range(metadata.num_row_groups):
            starts.append(starts[-1] + metadata.row_group(group).num_rows)
        return starts

    def record_id(self, task: Task) -> str | None:
        """The id of the row ``task`` locates, where the table has an id column
        (``ConversationFile``'s)."""
        column = self.columns["id"]
        if not column:
            return None
        group, offset = task.locator
        return _id_of(lambda: _read_row_group(self.path, group, (column,))[offset], column)

    def load(self, task: Task) -> RawRecord:
        group, offset = task.locator
        columns = tuple(dict.fromkeys((*(c for c in self.columns.values() if c),
                                       *self.single.values(), *self.unread.values(),
                                       *self.preference)))
        record = _read_row_group(self.path, group, columns)[offset]
        column = self.columns
        record_id = _record_id(record.get(column["id"])) if column["id"] else None
        if self.kind == "document":
            images = record.get(column["images"]) if column["images"] else None
            return RawRecord(id=record_id, turns=None, kind="document",
                             text=record[column["texts"]], media={"image": images})
        media = {name: _media_items(record.get(column[media_field(name)]),
                                    record.get(self.single[name]) if name in self.single
                                    else None, "the row", name)
                 for name in MODALITIES if column[media_field(name)]}
        if self.kind == "caption":
            _check_unread(record, media, self.unread, _READ_COLUMN)
            return RawRecord(id=record_id, turns=None, media=media, kind="caption",
                             text=record[column["caption"]])
        turns = record[column["conversation"]]
        turns = _json_value(turns) if isinstance(turns, (str, bytes)) else _without_nulls(turns)
        _refuse_preference(record, turns)
        turns = exchanges(as_turns(turns, f"its column {column['conversation']!r}"), media)
        media = with_part_items(media, turns, {
            name: _as_list(record.get(column[media_field(name)])) for name in MODALITIES
            if column[media_field(name)]})
        _check_unread(record, media, self.unread, _READ_COLUMN, turns)
        tools = record.get(column["tools"]) if column["tools"] else None
        return RawRecord(id=record_id, turns=turns, media=media,
                         tools=[tools if isinstance(tools, str) else _without_nulls(tools)],
                         system=record.get(column["system"]) if column["system"] else None,
                         # a table's JSON text or struct (its nulls: none given)
                         objects=_without_nulls(record.get(column["objects"]))
                         if column["objects"] else None)


def _without_nulls(value):
    """A nested column's value without the null fields Arrow fills in: a table's structs share
    one type, so a row's call or tool holds every other row's fields as nulls (``{"city":
    "Oslo", "n": null}``), which templates would write as its own."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _holds_exchanges(kind: pa.DataType) -> bool:
    """Whether a column's type is a list of ``{user, assistant, ...}`` structs."""
    item = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else None
    return item is not None and pa.types.is_struct(item) and \
        {"user", "assistant"} <= {item.field(i).name for i in range(item.num_fields)}


def _json_value(raw):
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise RecordError("invalid_utf8", f"the conversation is not UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise RecordError("malformed_json", f"the conversation is not valid JSON: {exc}") from None


def _record_keys(value: dict) -> list[str]:
    """The keys that make the JSON object ``value`` one record: a conversation's, a
    document's, a caption's, an utterance's, or media named by path; none where its media
    keys hold other objects (a COCO annotations file's ``images``: a list of objects)."""
    media = [key for key in (*MODALITIES, *map(media_field, MODALITIES))
             if isinstance(value.get(key), str) or isinstance(value.get(key), list) and all(
                 item is None or isinstance(item, str) for item in value[key])]
    return sorted(media + [key for key in ("conversations", "messages", "texts", "caption",
                                           "text_list", "audio_filepath") if key in value])


def _pick_column(path, names, wanted, candidates) -> str | None:
    """The column ``wanted`` (SourceError where there is none), else the first of
    ``candidates`` the table has (None: none)."""
    if wanted:
        if wanted not in names:
            raise SourceError(f"{path}: no column {wanted!r}; columns are {listed(sorted(names))}")
        return wanted
    return next((c for c in candidates if c in names), None)


@functools.lru_cache(maxsize=2)
def _read_row_group(path: str, group: int, columns: tuple) -> list[dict]:
    # Records of one row group, cached: consecutive tasks usually hit the same group.
    return pq.ParquetFile(path).read_row_group(group, columns=list(columns)).to_pylist()


def _line_tasks(path: str, source: int):
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if number == 1:   # a leading BOM (as Windows editors write) is not part of record 1
                line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield Task(source, line, location(path, "line", number), ("line", number))


def open_source(path: str, *, input_format: str = "auto", media_root: str | None = None,
                instruction: str = "Transcribe the audio.", columns: dict | None = None):
    """The reader for ``path``. ``auto`` picks by extension; a ``.json`` file whose first line
    is a whole JSON object is JSONL (NeMo names its manifests so); JSONL is a speech manifest
    when its first well-formed record has ``audio_filepath``."""
    if storage.is_remote(path):
        bucket = path.partition("://")[0] in ("s3", "gs", "gcs", "az", "abfs")
        raise SourceError(f"{path}: mimo-shard build reads its inputs from local files (its "
                          "--output may be a bucket): copy the records' files and their media "
                          "here first" + (" (e.g. aws s3 sync s3://BUCKET/raw/ raw/, gsutil -m "
                                          "rsync)" if bucket else "") + "; tars in a bucket "
                          "are indexed where they are with mimo-shard index")
    if os.path.isdir(path):
        raise SourceError(f"{path}: is a folder; give the records' files (JSON, JSONL, Parquet "
                          "or a speech manifest), whose records name the media (a folder of "
                          "WebDataset tars is indexed in place with mimo-shard index)")
    if not os.path.isfile(path):
        raise SourceError(f"{path}: input file {not_found(path)}")
    with open(path, "rb") as data:
        head = data.read(4096)
    first = _first_line(head)
    _refuse_compressed(path, head)
    _refuse_wide_text(path, head)
    fmt = input_format
    suffix = os.path.splitext(path)[1].lower()          # TRAIN.JSONL as train.jsonl
    if fmt != "parquet" and suffix in (".tsv", ".csv", ".txt") and not (
            first.startswith(b"[") or _json_lines(path)):    # (an array first: it may be one line)
        raise SourceError(f"{path}: mimo-shard build reads no {suffix} file: write utterances "
                          "(Common Voice's TSV, LibriSpeech's trans.txt) as a NeMo speech "
                          "manifest, a JSONL of {\"audio_filepath\", \"text\"} a line "
                          "(docs/datasets.md shows how), and image captions as JSONL records "
                          "of {\"image\", \"caption\"}; then give that")
    if fmt == "auto" and suffix not in (".parquet", ".json", *_LINES_SUFFIXES):
        raise SourceError(f"{path}: cannot tell the input format from the extension (.json, "
                          f".jsonl, .ndjson or .parquet); pass --input-format "
                          "llava|manifest|parquet")
    if fmt == "auto" and suffix == ".parquet":
        fmt = "parquet"
    # a file opening a JSON array is one whatever its name (a list of records saved as .jsonl)
    lines = fmt in ("auto", "llava") and not first.startswith(b"[") and (
        suffix in _LINES_SUFFIXES or _json_lines(path))
    if lines and first == b"{":
        raise SourceError(f"{path}: its first line is '{{' alone: JSON objects written over "
                          "several lines (pretty-printed; jq without -c), where JSONL holds "
                          "one a line: write them so (e.g. jq -c . FILE > records.jsonl)")
    if fmt == "auto":
        fmt = "manifest" if lines and _first_record_has(path, "audio_filepath") else "llava"
    if fmt == "parquet":
        return ParquetTable(path, media_root, columns)
    if head.startswith(PARQUET_MAGIC):
        raise SourceError(f"{path}: a Parquet file, given --input-format {fmt}: give "
                          "--input-format parquet, or leave it out")
    if fmt == "manifest":
        return SpeechManifest(path, instruction, media_root)
    if fmt == "llava":
        return ConversationFile(path, media_root, lines=lines)
    raise SourceError(f"unknown input format {fmt!r}")


_SNIFF_LINES = 20   # non-blank lines read to find the first well-formed record
_LINES_SUFFIXES = (".jsonl", ".ndjson")


# the byte-order marks of text in UTF-16 or UTF-32 (Windows Notepad's "Unicode", PowerShell's
# default output), whose every record would read as malformed UTF-8
_WIDE_BOMS = {codecs.BOM_UTF32_LE: "UTF-32", codecs.BOM_UTF32_BE: "UTF-32",
              codecs.BOM_UTF16_LE: "UTF-16", codecs.BOM_UTF16_BE: "UTF-16"}


def _refuse_wide_text(path: str, head: bytes) -> None:
    """SourceError for records written in UTF-16 or UTF-32 (its byte-order mark first:
    ``head``, the file's first bytes)."""
    kind = next((name for bom, name in _WIDE_BOMS.items() if head.startswith(bom)), None)
    if kind:
        raise SourceError(f"{path}: {kind} text (its byte-order mark {head[:2].hex(' ')}, as "
                          "Windows Notepad and PowerShell write it): convert it to UTF-8 "
                          f"first (e.g. iconv -f {kind} -t UTF-8 {path} > "
                          f"{os.path.splitext(path)[0]}.utf8{os.path.splitext(path)[1]})")


def _refuse_compressed(path: str, head: bytes) -> None:
    """SourceError for a compressed input (``train.jsonl.gz``; ``head``: the file's first
    bytes): its records are read by line number and row from the file itself, so it is
    decompressed first."""
    kind = compression_of(head)
    if kind:
        command = decompress_command(kind, path)
        raise SourceError(f"{path}: {kind}-compressed: decompress it first (e.g. {command}) "
                          "and give the file it writes")


def _leading_records(path: str):
    """The first non-blank lines of ``path`` (up to ``_SNIFF_LINES``), each as a JSON object
    or None where the line is not one."""
    with open(path, "rb") as lines:
        seen = 0
        for line in lines:
            line = line.removeprefix(codecs.BOM_UTF8) if seen == 0 else line
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError:   # UnicodeDecodeError included
                value = None
            yield value if isinstance(value, dict) else None
            seen += 1
            if seen == _SNIFF_LINES:
                return


def _first_line(head: bytes) -> bytes:
    """The first non-blank line of ``head`` (a file's first bytes), stripped, without a BOM:
    one opening '[' is a JSON array (never read as lines: it may be one long)."""
    head = head.removeprefix(codecs.BOM_UTF8)
    return next((line.strip() for line in head.splitlines() if line.strip()), b"")


def _json_lines(path: str) -> bool:
    """Whether ``path`` (no JSON array) holds one JSON object per line: its first non-blank
    line is one."""
    return next(_leading_records(path), None) is not None


def _first_record_has(path: str, key: str) -> bool:
    """Whether the first well-formed JSON object among the leading lines has ``key`` (a
    malformed first line does not decide the format of the whole file)."""
    return key in next((r for r in _leading_records(path) if r is not None), {})
