"""Normalize one raw record (any input form) into the shard sample's messages and media order."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mimo_data.errors import listed
from mimo_data.modalities import MARKERS, MediaError
from mimo_data.shards.format import (MARKERS_PLACED_FIRST, TEXT_PART_BREAK,
                                     VIDEOS_MARKED_AS_IMAGES)
from mimo_data.tally import CountedError

# ShareGPT/LLaVA speaker names and OpenAI/HF roles, mapped to the roles we store: a tool's
# turn is OpenAI/HF's ``tool``, OpenAI's older ``function``, Llama 3's ``ipython``,
# LLaMA-Factory's ShareGPT ``observation`` or ms-swift's ``tool_response``
ROLE_ALIASES = {"system": "system", "human": "user", "user": "user",
                "gpt": "assistant", "assistant": "assistant", "tool": "tool",
                "function": "tool", "ipython": "tool", "observation": "tool",
                "tool_response": "tool"}
# a call as a turn of its own whose value is the call's JSON: LLaMA-Factory's ShareGPT
# ``function_call``, ms-swift's ``tool_call`` (one a call; consecutive ones, parallel calls)
CALL_TURNS = ("function_call", "tool_call")


class RecordError(CountedError):
    """A record that cannot become a sample; ``reason`` is its report category."""

    @classmethod
    def of_media(cls, error: MediaError, where: str) -> RecordError:
        """A media item's check failing at ``where``, with the build option that keeps it."""
        remedy = (" (raise --max-image-pixels to keep it)"
                  if error.reason in ("image_too_large", "video_too_large") else "")
        return cls(error.reason, f"{where}: {error.detail}{remedy}")


def conversation_turns(record: dict) -> Any:
    """A conversation record's turns: its ``conversations`` or ``messages``
    (``malformed_record`` where it gives both, with different turns)."""
    if record.get("conversations") and record.get("messages") and \
            record["conversations"] != record["messages"]:
        raise RecordError("malformed_record", "the record gives both 'conversations' and "
                          "'messages', with different turns: give one")
    return record.get("conversations", record.get("messages"))


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number",
               bool: "boolean", type(None): "null"}


def json_type(value) -> str:
    """What a parsed JSON ``value`` is, in JSON's words (``null``, not ``NoneType``)."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def a_json_type(value) -> str:
    """``json_type`` with its article: "an object", "a string"."""
    kind = json_type(value)
    return f"{'an' if kind[:1] in ('a', 'e', 'i', 'o', 'u') else 'a'} {kind}"


# Typed content parts that stand for a media item, with its modality: transformers' own
# (``{"type": "image"}``) and OpenAI's (``image_url``, ``input_audio``; ``video_url`` as vLLM
# and Qwen's chat servers take it)
PART_MODALITIES = {**{modality: modality for modality in MARKERS}, "image_url": "image",
                   "video_url": "video", "input_audio": "audio"}


def _content_text(content) -> str:
    """Message content as text: a string, or HF-style parts with media parts (``{"type":
    "image"}``, ``"audio"``, ``"video"``; OpenAI's, ``PART_MODALITIES``) as their markers, a
    marker and the text beside it as they are (as Qwen's templates write parts, nothing
    between them), two texts joined by ``TEXT_PART_BREAK`` (what a template writes between
    them is its own: preprocessing puts it there). A text holding ``TEXT_PART_BREAK`` itself
    is refused: preprocessing would read it as a break."""
    if isinstance(content, str):
        return _without_break(content)
    if isinstance(content, list):
        pieces: list[str] = []
        texts = False                       # whether the last piece was a text
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text = _without_break(part["text"])
                pieces += [TEXT_PART_BREAK, text] if texts else [text]
                texts = True
            elif kind in PART_MODALITIES:
                pieces.append(MARKERS[PART_MODALITIES[kind]])
                texts = False
            else:
                kinds = "|".join(repr(k) for k in ("text", *PART_MODALITIES))
                raise RecordError("malformed_record", f"unsupported content part {part!r}: "
                                  f"expected {{'type': {kinds}, ...}}")
        return "".join(pieces)
    raise RecordError("malformed_record", f"message content must be a string or a list of "
                      f"parts, got {json_type(content)}")


def _without_break(text: str) -> str:
    """``text``, refused where it holds ``TEXT_PART_BREAK`` (a private-use character)."""
    if TEXT_PART_BREAK in text:
        shown = text if len(text) <= 60 else f"{text[:60]}..."
        raise RecordError("malformed_record", f"the text {shown!r} holds U+E00B, a private-use "
                          "character mimo's shards keep for the break between two text parts: "
                          "remove it from the record")
    return text


def as_turns(turns, where: str):
    """``turns``, refused naming ``where`` (the record's key, the table's column) when they
    are not a list (a number, a string, one object): they cannot be read as turns. A string
    holding a JSON list (a table's JSON text column written out as JSON lines) is that list."""
    if turns is None or isinstance(turns, list):
        return turns
    if isinstance(turns, str) and turns.lstrip().startswith("["):
        try:
            decoded = json.loads(turns)
        except json.JSONDecodeError as exc:
            raise RecordError("malformed_json", f"{where} holds a string that opens a JSON "
                              f"list but is no valid JSON ({exc}): give the turns as a list, "
                              "or as valid JSON text") from None
        if isinstance(decoded, list):
            return decoded
    text = repr(turns)
    shown = text if len(text) <= 60 else f"{text[:60]}..."
    raise RecordError("malformed_record", f"{where} holds {shown} (type "
                      f"{json_type(turns)}), not a list of turns (role/content or "
                      "from/value objects)")


def normalize_messages(turns, tools=None, system=None, objects=None) -> list[dict]:
    """Turns in ShareGPT (``from``/``value``) or chat (``role``/``content``) form → messages;
    ``system``: the record's own system prompt (LLaMA-Factory's ShareGPT ``system``), its
    first turn; ``objects``: ms-swift's grounding objects, refused where the text has their
    placeholders (``GROUNDING_PLACEHOLDERS``).
    An assistant turn's ``reasoning_content`` goes into its content as ``<think>...</think>``
    before the answer; one left out of the loss (``weight`` 0, ``training`` or ``loss``
    false) has ``"weight": 0``. Tool use as OpenAI and transformers' chat templates take it:
    an assistant turn's calls (``tool_calls``; OpenAI's older ``function_call``; a call turn,
    ``CALL_TURNS``, which joins the answer before it) as ``tool_calls`` of ``{"type":
    "function", "function": {"name", "arguments": {...}}}``, a tool's turn as role ``tool``,
    and ``tools`` (``tool_lists``: the record's ``tools``, OpenAI's older ``functions``) on
    the first message (``Message``).

    Raises RecordError for unknown roles, missing fields, an empty conversation, text that
    cannot be encoded as UTF-8 (e.g. lone surrogates from ``\\ud800`` escapes) and calls or
    tools that are not JSON objects with a name.
    """
    if turns is None:
        raise RecordError("malformed_record", "the conversation is missing")
    if not as_turns(turns, "the conversation"):
        raise RecordError("malformed_record", "the conversation has no turns")
    messages: list[dict] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError("malformed_record", f"turn {i} is not an object")
        speaker = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        calls = _calls(turn, i)
        call_turn = str(speaker).lower() in CALL_TURNS
        if call_turn:                               # the call is the turn's value
            if not _items(content, f"turn {i}'s call"):
                raise RecordError("malformed_record", f"turn {i} is a {speaker} turn "
                                  "without a call")
            speaker, calls, content = "assistant", _calls({"tool_calls": content}, i), ""
        if content is None and calls:               # OpenAI's content of a call: null
            content = ""
        if content is None and ROLE_ALIASES.get(str(speaker).lower()) == "tool":
            raise RecordError("malformed_record", f"turn {i} is a tool's response without "
                              "content: give the tool's result as its content (a string, or "
                              "its JSON)")
        if speaker is not None and content is None and any(
                key in turn for key in ("content", "value")):
            raise RecordError("malformed_record", f"turn {i} ({speaker}) has a null "
                              f"{'content' if 'content' in turn else 'value'}: give its text "
                              "as a string (an answer cut off in an export?), or leave the "
                              "record out")
        if speaker is None or content is None:
            keys = sorted(key for key, value in turn.items() if value is not None)
            nulls = sorted(key for key, value in turn.items() if value is None)
            null = f" ({', '.join(map(repr, nulls))} null)" if nulls else ""
            raise RecordError("malformed_record", f"turn {i} has keys {listed(keys)}{null}: a turn "
                              "needs role/content or from/value (`mimo-shard build` also reads "
                              "a list of {user, assistant} exchanges, the_cauldron's 'texts')")
        role = ROLE_ALIASES.get(str(speaker).lower())
        if role is None:
            raise RecordError("unknown_role", f"turn {i} has role {speaker!r}; known roles: "
                              f"{listed(sorted([*ROLE_ALIASES, *CALL_TURNS]))}")
        if calls and role != "assistant":
            raise RecordError("malformed_record", f"turn {i} ({role}) holds tool calls: only "
                              "an assistant turn calls tools")
        if role == "tool" and not isinstance(content, str) and not _parts(content):
            try:                                    # a result given as JSON
                content = json.dumps(content, ensure_ascii=False)
            except (TypeError, ValueError) as exc:  # a table's date or bytes, say
                raise RecordError("malformed_record", f"turn {i}'s result is not JSON: "
                                  f"{exc}") from None
        text = _content_text(content)
        reasoning = turn.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            # as Qwen3's and Qwen3.5's templates take it: the reasoning in a think block
            # before the answer, which is how they split an answer that holds it
            if "</think>" in text:
                raise RecordError("malformed_record", f"turn {i} has a reasoning_content and "
                                  "a </think> in its content: give its reasoning once")
            text = f"<think>\n{_without_break(reasoning.strip())}\n</think>\n\n{text}"
        _utf8(text, f"turn {i} text")
        if role == "assistant" and (marked := [m for m in MARKERS.values() if m in text]):
            raise RecordError("marker_mismatch", f"turn {i} (assistant) holds {marked}: an "
                              "answer would train the model to write the media's "
                              "placeholders; give media in user turns (or a tool's result), "
                              "and reword a marker written as words (an HTML tag) in the "
                              "source data")
        message: dict[str, Any] = {"role": role, "content": text}
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            for key in ("name", "tool_call_id"):
                if isinstance(turn.get(key), (str, int)) and not isinstance(turn[key], bool):
                    message[key] = str(turn[key])
                elif turn.get(key) is not None:
                    raise RecordError("malformed_record", f"turn {i}'s {key} is "
                                      f"{turn[key]!r}: give a string")
        if not _trained(turn, i, role) and role == "assistant":
            message["weight"] = 0
        if call_turn and messages and messages[-1]["role"] == "assistant":
            _join_calls(messages[-1], message, i)
            continue
        if role == "tool":
            _check_response(messages, message, i)
        messages.append(message)
    if not (system is None or isinstance(system, float) and math.isnan(system)
            or isinstance(system, str) and not system.strip()):       # a table's null, NaN
        if not isinstance(system, str):
            raise RecordError("malformed_record", f"the record's system is a "
                              f"{json_type(system)}, not a string")
        if messages[0]["role"] == "system":
            raise RecordError("malformed_record", "the record has a system prompt and its "
                              "conversation a system turn: give the system prompt once")
        _utf8(system, "the record's system prompt")
        messages.insert(0, {"role": "system", "content": _without_break(system)})
    if all(m["role"] == "system" for m in messages):
        raise RecordError("malformed_record", "the conversation has only system turns")
    answers = [m for m in messages if m["role"] == "assistant"]
    if not answers:          # what preprocessing would drop, at every epoch, had it been kept
        raise RecordError("no_trained_tokens", "the conversation has no assistant turn: "
                          "nothing to train on")
    if all("weight" in m for m in answers):
        raise RecordError("no_trained_tokens", f"every answer ({len(answers)}) has weight 0: "
                          "nothing to train on")
    trained = [m for m in answers if "weight" not in m]
    if all(not m.get("tool_calls") and not m["content"].replace(TEXT_PART_BREAK, "").strip()
           for m in trained):
        # what preprocessing drops whatever the template: its end of turn alone would train
        raise RecordError("empty_answers", f"every trained answer ({len(trained)}) is empty: "
                          "training it would teach the model to answer with nothing")
    if _given(objects) and any(mark in m["content"] for m in messages
                               for mark in GROUNDING_PLACEHOLDERS):
        raise RecordError("malformed_record", "the record has ms-swift's grounding 'objects', "
                          "for <ref-object>/<bbox> placeholders mimo does not fill: write the "
                          "model's own grounding text into the content instead (Qwen2-VL: "
                          "<|object_ref_start|>a dog<|object_ref_end|><|box_start|>(x1,y1),"
                          "(x2,y2)<|box_end|>, on its 0-1000 scale)")
    tool_list = _tools(tools)
    if tool_list:
        messages[0]["tools"] = tool_list
    if not any(key in m for m in messages for key in ("tool_calls", "tools", "name",
                                                       "tool_call_id")):
        return messages
    # the calls' and tools' own fields: JSON the shard can hold, no marker only media may place
    try:
        written = json.dumps([[m.get("tool_calls"), m.get("tools"), m.get("name"),
                               m.get("tool_call_id")] for m in messages], ensure_ascii=False)
    except (TypeError, ValueError) as exc:      # a table's date or bytes, say
        raise RecordError("malformed_record", f"a tool call or tool holds a value that is not "
                          f"JSON: {exc}") from None
    _utf8(written, "a tool call, tool or tool turn's name")
    _no_markers(written, "a tool call or tool")
    return messages


def _check_response(messages: list[dict], response: dict, i: int) -> None:
    """A tool's response (turn ``i``, after ``messages``) answers a call, as OpenAI's format
    requires: it follows the answer that calls (its ``tool_calls``, or calls written in its
    text, as Hermes' data has them) and that answer's other responses, is not one more
    response than the answer's calls, and names one of them where both give ids. Otherwise a
    sample would train the answer after a result that no call asked for."""
    start = len(messages)
    while start and messages[start - 1]["role"] == "tool":
        start -= 1
    answer = messages[start - 1] if start else None
    if answer is None or answer["role"] != "assistant":
        where = "as the first turn" if answer is None else f"after a {answer['role']} turn"
        raise RecordError("malformed_record", f"turn {i} is a tool's response {where}, which "
                          "no call asked for: a tool's response follows the answer that calls "
                          "the tool (its tool_calls); give that answer, or make the turn a "
                          "user's")
    calls = answer.get("tool_calls") or []
    if calls and len(messages) - start >= len(calls):
        raise RecordError("malformed_record", f"turn {i} is response {len(messages) - start + 1}"
                          f" to an answer that makes {len(calls)} call(s): give one response "
                          "a call")
    ids = [call["id"] for call in calls if "id" in call]
    named = response.get("tool_call_id")
    if named is not None and ids and named not in ids:
        raise RecordError("malformed_record", f"turn {i}'s tool_call_id {named!r} names none "
                          f"of the calls of the answer before it ({', '.join(ids)})")


def _join_calls(answer: dict, call: dict, i: int) -> None:
    """A call turn ``i`` after an answer (its text, or another call turn) joins it: one
    answer, as ms-swift joins them and chat templates write an answer's text and calls."""
    if call["content"]:                 # its reasoning_content, which would be left out
        raise RecordError("malformed_record", f"turn {i} is a call with text of its own (its "
                          "reasoning) that joins the answer before it: give the text in "
                          "that answer")
    if ("weight" in answer) != ("weight" in call):
        raise RecordError("malformed_record", f"turn {i} is a call that joins the answer "
                          "before it, but one of them is in the loss and the other is not: "
                          "flag them alike")
    answer["tool_calls"] = [*answer.get("tool_calls", ()), *call["tool_calls"]]


# ms-swift's grounding placeholders, which it fills per model at training from a record's
# ``objects`` (Qwen2-VL's 0-1000 scale, Qwen2.5-VL's pixels of the resized image): mimo writes
# no model's grounding text, so such a record would train the placeholders as text;
# ``objects`` without a placeholder (a detection set's labels) are left as any other field
GROUNDING_PLACEHOLDERS = ("<ref-object>", "<bbox>")


def tool_lists(record: Mapping[str, Any]) -> list:
    """A record's tool lists, for ``normalize_messages``: ``tools`` and OpenAI's older
    ``functions``."""
    return [record.get("tools"), record.get("functions")]


def _tools(lists) -> list[dict]:
    """The tools of ``tool_lists`` as transformers' chat templates take them: each
    ``{"type": "function", "function": {"name", ...}}`` (a bare function, as OpenAI's older
    ``functions`` and LLaMA-Factory's ``tools`` give them, wrapped so); a table's JSON text
    read."""
    found = []
    for value in lists or ():
        for k, tool in enumerate(_items(value, "the record's tools")):
            function, wrapped = _function(tool, f"the record's tool {k}", '"parameters": {...}')
            found.append(tool if wrapped else {"type": "function", "function": function})
    return found


def _items(value, where: str) -> list:
    """The items of a tool list or a turn's calls: none where empty, a table's JSON text
    read, one item alone as a list of one."""
    if not _given(value):
        return []
    if isinstance(value, str):
        value = _json(value, where)
    return value if isinstance(value, list) else [value]


def _function(item, where: str, rest: str) -> tuple[dict, bool]:
    """The function of a tool or call, and whether the item wraps it (``{"type": "function",
    "function": {...}}``, the form templates take) or is it; RecordError without a name."""
    wrapped = isinstance(item, dict) and isinstance(item.get("function"), dict)
    function = item["function"] if wrapped else item
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name.strip():
        raise RecordError("malformed_record", f"{where} has no function name: it is "
                          f'{{"type": "function", "function": {{"name": ..., {rest}}}}}'
                          " (or the function alone)")
    return function, wrapped


def _calls(turn: Mapping[str, Any], i: int) -> list[dict]:
    """Turn ``i``'s tool calls (``tool_calls``, OpenAI's older ``function_call``), each
    ``{"type": "function", "function": {"name", "arguments": {...}}}`` (and its ``id``);
    arguments given as JSON text are read (templates write them from an object)."""
    calls = []
    for key in ("tool_calls", "function_call"):
        for k, call in enumerate(_items(turn.get(key), f"turn {i}'s {key}")):
            where = f"turn {i}'s {key} {k}"
            function, wrapped = _function(call, where, '"arguments": {...}')
            name = function["name"]
            given = {key for key, value in function.items() if value is not None}
            known = {"name", "arguments", "parameters"} | (set() if wrapped else {"id", "type"})
            if given - known or {"arguments", "parameters"} <= given:
                raise RecordError("malformed_record", f"{where} has keys "
                                  f"{listed(sorted(given))}: a call is its name and its "
                                  "arguments (under 'arguments', or 'parameters' as Llama 3's)")
            arguments = function.get("arguments")
            if arguments is None:
                arguments = function.get("parameters")
            if isinstance(arguments, str):
                arguments = _json(arguments, f"{where}'s arguments") if arguments.strip() \
                    else None
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, dict):
                raise RecordError("malformed_record", f"{where}'s arguments are "
                                  f"{json_type(arguments)}, not a JSON object")
            call_id = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
            calls.append({"type": "function", "function": {"name": name,
                                                            "arguments": arguments},
                          **call_id})
    return calls


def _json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RecordError("malformed_record", f"{where} is not JSON ({exc}): give it as JSON "
                          "text, or as the object itself") from None


def _parts(content) -> bool:
    """Whether a content is HF-style typed parts (``_content_text``: text and media parts)."""
    return isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") in ("text", *PART_MODALITIES)
        for part in content)


def _trained(turn: dict, i: int, role: str) -> bool:
    """Whether turn ``i`` is in the loss, as its own flag says: OpenAI's fine-tuning
    ``weight`` (0 or 1, assistant turns), axolotl's ``training`` or ms-swift's ``loss`` (a
    boolean); an assistant turn without one is, any other is not (a flag asking for it is
    refused: mimo trains answers only)."""
    flags = {key: turn[key] for key in ("weight", "training", "loss")
             if turn.get(key) is not None}
    if _given(turn.get("train_detail")):
        raise RecordError("malformed_record", f"turn {i} has a train_detail (character spans "
                          "to train), which mimo does not read: give the turn a weight of 0 "
                          "or 1")
    trained = role == "assistant"
    for key, value in flags.items():
        if key == "weight" and value in (0, 1) and not isinstance(value, bool):
            wanted = value == 1
        elif key in ("training", "loss") and isinstance(value, bool):
            wanted = value
        else:
            raise RecordError("malformed_record", f"turn {i} has {key} {value!r}: a weight is "
                              "0 (not trained) or 1, a training or loss flag true or false")
        if wanted and role != "assistant":
            raise RecordError("malformed_record", f"turn {i} ({role}) has {key} {value!r}, "
                              "but mimo trains the assistant's turns only: remove the flag")
        trained = trained and wanted
    return trained


def _given(value) -> bool:
    """Whether a record's tools, a turn's calls or its train_detail hold anything: not None,
    false, NaN, a list or mapping of nothing (``[{}]``, ``{"name": null}``), nor a string
    that is blank, ``None``, or JSON of nothing (tables store them as JSON text)."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "null", "nan", "false"):
            return False
        try:
            return _given(json.loads(text))
        except ValueError:
            return True
    if isinstance(value, dict):
        return any(_given(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_given(item) for item in value)
    if isinstance(value, float) and math.isnan(value):
        return False
    return value is not None and value is not False


def marker_order(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Modalities of the markers in reading order, e.g. ``["image", "audio", "image"]``."""
    found: list[str] = []
    for message in messages:
        text = message["content"]
        positions = [(pos, modality) for modality, marker in MARKERS.items()
                     for pos in _find_all(text, marker)]
        found.extend(modality for _, modality in sorted(positions))
    return found


def _find_all(text: str, needle: str):
    start = text.find(needle)
    while start != -1:
        yield start
        start = text.find(needle, start + len(needle))


def media_markers(messages: list[dict], counts: Mapping[str, int],
                  markers_first: bool = False) -> tuple[list[str], dict[str, int]]:
    """The modalities of ``messages``' markers in reading order, checked against the record's
    item ``counts`` (``marker_mismatch``), and the reports' counts of what was read so
    (``VIDEOS_MARKED_AS_IMAGES``, ``MARKERS_PLACED_FIRST``; where not 0).

    ``markers_first``: a modality with items and no marker anywhere gets one for each item
    before the first user text (``<image>\n`` each, in ``messages``), as InternVL's trainer
    places them (ms-swift's too, without the newlines, and it also fills in markers where only
    some are missing); with some markers but too few it is still refused.

    LLaVA-NeXT's video data (LLaVA-Video-178K, LLaVA-OneVision's videos) marks each video
    with ``<image>``, which its trainer reads as the video's frames. Where a record has
    videos, no image and no ``<video>`` marker, and as many ``<image>`` markers as videos,
    those markers can be nothing but the videos': they become ``<video>`` in ``messages``
    (in place). Any other disagreement is refused as before."""
    order = marker_order(messages)
    videos = counts.get("video", 0)
    relabeled = placed = 0
    if (videos and not counts.get("image") and "video" not in order
            and order.count("image") == videos):
        for message in messages:
            message["content"] = message["content"].replace(MARKERS["image"], MARKERS["video"])
        order, relabeled = ["video" if m == "image" else m for m in order], videos
    if markers_first:
        placed = _place_missing_markers(messages, counts)
        order = marker_order(messages) if placed else order
    wrong = [(modality, order.count(modality), counts.get(modality, 0)) for modality in MARKERS
             if order.count(modality) != counts.get(modality, 0)]
    if wrong:                   # each modality that disagrees: a <video> typed for an <image>
        text = "".join(message["content"] for message in messages)
        raise RecordError("marker_mismatch", "; ".join(
            f"{markers} {MARKERS[modality]} marker(s) in the text but {items} {modality} "
            f"item(s) in the record" + _mismatch_hint(markers, items, markers_first, modality,
                                                      text)
            for modality, markers, items in wrong))
    return order, {name: number for name, number in ((VIDEOS_MARKED_AS_IMAGES, relabeled),
                                                      (MARKERS_PLACED_FIRST, placed)) if number}


def _mismatch_hint(markers: int, items: int, markers_first: bool, modality: str,
                   text: str) -> str:
    """What to do about ``markers`` of ``modality``'s markers in a record's ``text`` for its
    ``items`` items."""
    cased = sorted(set(re.findall(re.escape(MARKERS[modality]), text, re.IGNORECASE))
                   - {MARKERS[modality]})
    if markers < items and cased:
        return (f": the text writes {', '.join(cased)}, which is no marker (markers are lower "
                f"case: {MARKERS[modality]})")
    if not markers and not markers_first:
        return (": give each item its marker where it goes (mimo-shard's --markers-first "
                "puts them before the first user text)")
    if not items:
        return (f": the record gives no item for them (each goes in the record's "
                f"'{modality}s' list or '{modality}' item, a content part, or a tar's member)")
    if markers < items:
        return (f": each item goes where its {MARKERS[modality]} is in the text; write the "
                f"{items - markers} missing, or leave out the items that have none")
    if markers > items:
        return (f": each {MARKERS[modality]} in a text places an item: give the "
                f"{markers - items} item(s) left out of the record, or, where a marker is "
                "written as words (in a transcript, or a question about the tag), which cannot "
                "be told from one, reword those words in the source data")
    return ""


def _place_missing_markers(messages: list[dict], counts: Mapping[str, int]) -> int:
    """``media_markers``' ``markers_first``: the markers it placed."""
    text = "".join(message["content"] for message in messages)
    # a marker written in other letters (<Image>) is where the item was meant: not placed
    # before it (which would train those letters as words), said as a mismatch instead
    missing = {modality: counts[modality] for modality, marker in MARKERS.items()
               if counts.get(modality) and marker.lower() not in text.lower()}
    lead = "".join(f"{MARKERS[modality]}\n" * number for modality, number in missing.items())
    first = next((m for m in messages if m["role"] == "user"), None)
    if not lead or first is None:
        return 0
    first["content"] = lead + first["content"]
    return sum(missing.values())


def _utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RecordError("invalid_utf8", f"{what} is not valid Unicode: {exc}") from None


def _no_markers(text: str, what: str) -> None:
    typed = [marker for marker in MARKERS.values() if marker in text]
    if typed:
        raise RecordError("marker_mismatch", f"{what} holds the marker(s) {typed}, which only "
                          "the record's media items may place")


# What a document's pieces are joined with: each text and each media item on its own line.
DOCUMENT_JOIN = "\n"


def normalize_document(texts, images) -> tuple[str, list]:
    """An interleaved document (OBELICS / MINT-1T: parallel ``texts`` and ``images`` lists,
    one of the two non-null at each position, a blank string or an image struct of nulls read
    as null) → its text with an ``<image>`` marker in each image's place (pieces joined by
    ``DOCUMENT_JOIN``) and its images' refs in order. A position with neither (a piece a
    cleaning emptied) holds nothing and is left out.

    RecordError: ``malformed_record`` (lists missing, of different lengths, a position with
    both), ``invalid_utf8``, ``marker_mismatch`` (a marker typed in a text),
    ``empty_document`` (no text, or only whitespace).
    """
    for name, value in (("texts", texts), ("images", images)):
        if not isinstance(value, (list, tuple)):
            raise RecordError("malformed_record", f"a document's {name!r} is " + (
                "missing" if value is None else a_json_type(value)) + ": a document "
                "needs the lists 'texts' and 'images', parallel, one of the two non-null at "
                "each position (a null in 'images' at each text's, and each image at a null "
                "of 'texts')")
    if len(texts) != len(images):
        raise RecordError("malformed_record", f"'texts' has {len(texts)} positions and "
                          f"'images' {len(images)}; they must be parallel")
    pieces, refs = [], []
    for i, (text, image) in enumerate(zip(texts, images)):
        text = None if isinstance(text, str) and not text.strip() else text
        image = None if _no_image(image) else image
        if text is None and image is None:
            continue
        if text is not None and image is not None:
            raise RecordError("malformed_record", f"position {i} has both a text and an image; "
                              "at most one of 'texts' and 'images' may be non-null there")
        if text is not None:
            if not isinstance(text, str):
                raise RecordError("malformed_record", f"text {i} is {a_json_type(text)}, "
                                  "not a string")
            _utf8(text, f"text {i}")
            _no_markers(text, f"text {i}")
            pieces.append(text)
        else:
            pieces.append(MARKERS["image"])
            refs.append(image)
    if not any(isinstance(t, str) and t.strip() for t in texts):
        raise RecordError("empty_document", f"the document has no text ({len(refs)} image(s) "
                          "only): nothing to train on")
    return DOCUMENT_JOIN.join(pieces), refs


def mmc4_document(text_list, image_info) -> tuple[list, list]:
    """An MMC4 document (``text_list``: its sentences; ``image_info``: its images, each with
    ``image_name``, its file, ``matched_text_index``, the sentence CLIP matched it to, and
    where OpenFlamingo's shards embed it, ``image_base64``) as the parallel ``texts`` and
    ``images`` of ``normalize_document``: each image just before the sentence it is matched
    to, as OpenFlamingo places them (several matched to one sentence in their order in
    ``image_info``), the sentences between two images one piece joined by spaces. Every image
    is kept, whatever its ``matched_sim``.

    RecordError ``malformed_record`` naming the sentence or image that is not of that form.
    """
    if not isinstance(text_list, list):
        raise RecordError("malformed_record", f"MMC4's 'text_list' is {a_json_type(text_list)}"
                          ", not a list of sentences")
    for i, sentence in enumerate(text_list):
        if not isinstance(sentence, str):
            raise RecordError("malformed_record", f"MMC4 sentence {i} is "
                              f"{a_json_type(sentence)}, not a string")
        # said by its index in text_list (the document's pieces hold the images' too)
        _utf8(sentence, f"MMC4 sentence {i}")
        _no_markers(sentence, f"MMC4 sentence {i}")
    if not isinstance(image_info, list):
        raise RecordError("malformed_record", f"MMC4's 'image_info' is "
                          f"{a_json_type(image_info)}, not a list of images")
    before: list[list] = [[] for _ in text_list]
    for j, info in enumerate(image_info):
        name = info.get("image_name") if isinstance(info, dict) else None
        embedded = info.get("image_base64") if isinstance(info, dict) else None
        if not (isinstance(name, str) and name) and not embedded:
            raise RecordError("malformed_record", f"MMC4 image {j} has no 'image_name' (its "
                              "file's name) and no 'image_base64' (its bytes)")
        index = info.get("matched_text_index")
        if not isinstance(index, int) or isinstance(index, bool) or \
                not 0 <= index < len(text_list):
            raise RecordError("malformed_record", f"MMC4 image {j}" + (
                f" ({name})" if name else "") + f" has matched_text_index {index!r}, not the "
                f"index of one of its {len(text_list)} sentences")
        before[index].append({"bytes": embedded, "path": name or None} if embedded else name)
    # MMC4's text_list holds a document's sentences (not paragraphs): joined by a space, as
    # OpenFlamingo joins them, not a trained newline after each
    texts: list = []
    images: list = []
    for sentence, matched in zip(text_list, before):
        if not matched and texts and texts[-1] is not None:
            if sentence.strip():
                texts[-1] = f"{texts[-1]} {sentence}" if texts[-1].strip() else sentence
            continue
        texts += [None] * len(matched) + [sentence]
        images += [*matched, None]
    return texts, images


def _no_image(image) -> bool:
    """A document's image position that holds none: null, "", or a struct of nulls (an HF
    ``Image`` column's null after a pandas round trip: ``{bytes: None, path: None}``)."""
    return image is None or image == "" or (
        isinstance(image, dict) and all(value in (None, "") for value in image.values()))


def normalize_caption(caption, media: dict[str, list]) -> str:
    """A caption pair's text, checked: a non-empty string (``empty_caption``), valid UTF-8,
    no marker in it, and exactly one media item in ``media`` (``malformed_record``)."""
    items = sum(len(refs) for refs in media.values())
    if not items:
        fields = " and ".join(repr(name) for name in media)
        raise RecordError("malformed_record", "the caption pair has no media item" + (
            f" (its {fields} null or empty)" if fields else "") + ": a caption goes with one "
            "image, audio clip or video; give the record its item, or leave the record out")
    if items != 1:
        raise RecordError("malformed_record", f"a caption pair has exactly one media item, "
                          f"this record {items}")
    if not isinstance(caption, str):
        raise RecordError("malformed_record", f"the caption is {a_json_type(caption)}, "
                          "not a string")
    _utf8(caption, "the caption")
    _no_markers(caption, "the caption")
    if not caption.strip():
        raise RecordError("empty_caption", "the caption is empty: nothing to train on")
    return caption
