"""How the members of an existing WebDataset sample become a mimo record: the layouts
``mimo-shard index`` reads, and telling them apart.

- ``pairs`` (img2dataset: LAION, DataComp, CC12M, COYO): ``KEY.jpg`` + ``KEY.txt`` (+ the
  ``KEY.json`` of its download metadata) → a caption record (``kind: "caption"``).
- ``conversation`` (LLaVA / ShareGPT exports of other frameworks): ``KEY.json`` holding
  ``conversations`` or ``messages`` with ``<image>`` / ``<audio>`` / ``<video>`` markers, its
  media ``KEY.jpg`` or ``KEY.0.jpg``, ``KEY.1.png`` ... (``KEY.img0.jpg`` ... as mimo's build
  writes them), ``KEY.wav``, ``KEY.mp4`` in marker order (several of a modality by the number
  ending their names).
- ``documents`` (interleaved documents, OBELICS / MINT-1T shape): ``KEY.json`` holding the
  parallel ``texts`` and ``images`` lists, the images ``KEY.jpg`` or ``KEY.0.jpg``, ``KEY.1.png``
  ... (by number): the i-th non-null ``images`` entry is the i-th image member → a document
  record (``kind: "document"``).
- ``vqa`` (Energon's VQAWebdataset field map): a question and an answer member → a one-turn
  conversation about the image.

A member name may read a field of a JSON member (``json[caption]``, ``json[answers][0]``) and
list alternatives (``jpg,png``: the first present), as Energon's ``field_map`` does. Member
suffixes are lowercase (the tar walk lowercases them, as webdataset does), and so are the
member names a map gives (``JPG`` reads ``KEY.jpg``; a JSON field keeps its case).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from mimo_data.errors import listed
from mimo_data.modalities import MARKERS, MODALITIES
from mimo_data.shards.format import TEXTS_CHOSEN, conversation_counts
from mimo_data.shards.records import (RecordError, conversation_turns, media_markers,
                                      normalize_document, normalize_messages, tool_lists)

LAYOUTS = ("pairs", "conversation", "documents", "vqa")
LAYOUT_WORDS = {"pairs": "caption pairs", "conversation": "conversations",
                "documents": "documents", "vqa": "questions and answers"}

# member extension -> modality (``jpeg`` too: img2dataset and others write it; the other
# names the same containers are written with: a TIFF's ``tif``, Ogg Opus's ``opus``, MPEG-4's
# ``m4v``; what a member holds is then probed from its bytes, as at build)
MEDIA_EXTENSIONS = {**{ext: name for name, m in MODALITIES.items()
                       for ext in (*m.extensions, *m.extensions.values())},
                    "tif": "image", "opus": "audio", "m4v": "video"}
# ``0.jpg``, ``img10.jpg`` (mimo's build), ``image_2.png``: the number ending the name orders
# several members of one modality
_NUMBERED = re.compile(r"^.*?(\d+)\.[^.]+$")
_ACCESS = re.compile(r"^(?P<member>[^[\]]+)(?P<path>(?:\[[^[\]]+\])*)$")


@dataclass(frozen=True)
class MemberMap:
    """Which members a layout reads (None: found by extension)."""
    layout: str
    media: str | None = None        # pairs / vqa: the medium member (``jpg``)
    text: str = "txt"               # pairs: the caption; vqa: the answer
    json: str = "json"              # pairs: metadata kept in the record's source;
    #                                 conversation: the conversation; documents: the document
    question: str = ""              # vqa: the question member
    weights: str = ""               # vqa: the answers' weights (Energon's answer_weights)
    markers_first: bool = False     # conversation: place missing markers first (media_markers)

    def __post_init__(self) -> None:
        object.__setattr__(self, "json", self.json.lower())

    def describe(self) -> str:
        if self.layout == "pairs":
            return (f"caption pairs: KEY.{self.media or '<image/audio>'} + KEY.{self.text} "
                    f"(metadata KEY.{self.json} if present)")
        if self.layout == "vqa":
            return (f"question-answer: KEY.{self.media or '<image>'}, question KEY."
                    f"{self.question}, answer KEY.{self.text}"
                    + (f" (weighed by KEY.{self.weights})" if self.weights else ""))
        if self.layout == "documents":
            return (f"interleaved documents: KEY.{self.json} with texts + images lists, images "
                    "KEY.[N.]jpg/png ...")
        return f"conversations: KEY.{self.json} with markers, media KEY.[N.]jpg/png/wav/mp4 ..."


@dataclass
class Synthesized:
    """A record's fields (no ``key``, ``source`` or ``media``), its media as ``(modality,
    member suffix)`` in marker order (their metadata still to probe), and what the sample's
    metadata member adds to its ``source`` (img2dataset's ``url`` and ``key``)."""
    fields: dict[str, Any]
    media: list[tuple[str, str]]
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    # what the record holds that the index report counts (``records.media_markers``',
    # ``format.conversation_counts``, ``_chosen``'s)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


def _text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8-sig")     # a leading BOM (Windows editors) is no text
    except UnicodeDecodeError as exc:
        raise RecordError("invalid_utf8", f"{what} is not UTF-8: {exc}") from None


def _json(members: dict[str, bytes], name: str) -> Any:
    """Member ``name`` read as JSON from its bytes, as webdataset's decoder reads it (UTF-8,
    with or without a BOM, or UTF-16/32: json finds which)."""
    try:
        return json.loads(members[name])
    except UnicodeDecodeError as exc:      # a ValueError too: said as a text member's is
        raise RecordError("invalid_utf8", f"member KEY.{name} is not UTF-8 (nor UTF-16/32) "
                          f"text: {exc}") from None
    except ValueError as exc:
        raise RecordError("malformed_json", f"member KEY.{name}: {exc}") from None


# field()'s reason for a JSON member without the answers' weights: the first answer trains
_NO_WEIGHTS = "no_weights"


def field(members: dict[str, bytes], spec: str, what: str,
          unfound: str = "malformed_record") -> tuple[str, Any] | None:
    """The member ``spec`` names (``txt``, ``json[caption]``, ``jpg,png``) as ``(member, value:
    bytes, or the JSON value read: a JSON member's, ``answers.json`` say, is read whole as
    Energon decodes it)``: the first alternative present (a JSON member without the field read
    is not: the next is tried, as Energon's ``field_map`` does); None when none is, a
    RecordError ``unfound`` naming the field when only JSON members without it were."""
    missing = None
    for option in spec.split(","):
        match = _ACCESS.match(option.strip())
        if match is None:
            raise RecordError("malformed_record", f"{what}: cannot read member spec {option!r}")
        member, path = match["member"].lower(), re.findall(r"\[([^[\]]+)\]", match["path"])
        if member not in members:
            continue
        if not path:
            return member, (_json(members, member) if member.rpartition(".")[2] == "json"
                            else members[member])
        value = _json(members, member)
        try:
            for step in path:
                value = value[int(step)] if isinstance(value, list) else value[step]
        except (KeyError, IndexError, ValueError, TypeError):
            keys = f" (its keys there: {', '.join(sorted(map(str, value))[:12])})" \
                if isinstance(value, dict) else ""
            missing = missing or RecordError(unfound, f"{what}: member KEY.{member} has no "
                                             f"{option.strip()}{keys}")
            continue
        return member, value
    if missing is not None:
        raise missing
    return None


def _as_text(found: tuple[str, Any], what: str, empty: str = "empty_text") -> str:
    member, value = found
    if isinstance(value, bytes):
        value = _text(value, f"member KEY.{member}")
    if not isinstance(value, str) or not value.strip():
        raise RecordError(empty, f"{what} (KEY.{member}) is empty or not text")
    return value.strip()


def _chosen(found: tuple[str, Any], weights: tuple[str, Any] | None, what: str
            ) -> tuple[tuple[str, Any], dict[str, int]]:
    """One text of a list of them (Energon's VQA ``answers``, a JSON list of captions): the
    highest of ``weights`` (Energon's ``answer_weights``; the first of equals), else the
    first, as the one that trains; and the report's count (``TEXTS_CHOSEN``) where there were
    several. A single text, or a list of one, is as given."""
    member, value = found
    if isinstance(value, list) and not value:
        return found, {}                    # said empty where it is read as text
    texts = value if isinstance(value, list) else [value]
    index = 0
    if weights is not None:                 # one number a text: [w], or w for a lone text
        read = _numbers(*weights)
        given = read if isinstance(read, list) else [read]
        if not (len(given) == len(texts) and all(
                isinstance(w, int | float) and not isinstance(w, bool) for w in given)):
            raise RecordError("malformed_record", f"{what}'s weights (KEY.{weights[0]}) are "
                              f"{str(read)[:80]}: give a number for each of its "
                              f"{len(texts)} text{'s' if len(texts) > 1 else ''} (a JSON list "
                              "or a .npy array)")
        index = max(range(len(given)), key=given.__getitem__)
    if len(texts) < 2:
        return (member, texts[0]), {}
    return (member, texts[index]), {TEXTS_CHOSEN: 1}


def _numbers(member: str, value: Any) -> Any:
    """Weights as read: a ``.npy`` member's array as a list (webdataset's decoder gives
    Energon the numpy array), other values as they are."""
    if not (isinstance(value, bytes) and member.rpartition(".")[2].lower() == "npy"):
        return value
    import io

    import numpy as np
    try:
        return np.load(io.BytesIO(value), allow_pickle=False).tolist()
    except (ValueError, OSError) as exc:
        raise RecordError("malformed_record", f"member KEY.{member} is not a .npy array: "
                          f"{exc}") from None


def _medium(members: dict[str, bytes], spec: str | None) -> tuple[str, str] | None:
    """``(modality, member)`` of a pair's medium: ``spec``'s member, or the one media member."""
    if spec is not None:
        found = field(members, spec, "the medium")
        return None if found is None else (_modality_of(found[0]), found[0])
    media = [name for name in members if name.rpartition(".")[2].lower() in MEDIA_EXTENSIONS]
    if len(media) > 1:
        dotted = all("." in name.rpartition(".")[0] or name[0].isdigit() for name in media)
        raise RecordError("malformed_record", "several media members "
                          f"({listed(sorted(media))}); name "
                          "the pair's medium with --media-member" + (
                              " (or, if these are several samples: webdataset's key ends at "
                              "the first dot of a file name, so KEY.000.jpg and KEY.001.jpg "
                              "are one sample; write keys without dots)" if dotted else ""))
    return (_modality_of(media[0]), media[0]) if media else None


def _modality_of(member: str) -> str:
    extension = member.rpartition(".")[2].lower()
    if extension not in MEDIA_EXTENSIONS:
        raise RecordError("unsupported_format", f"member KEY.{member}: the extension "
                          f"{extension!r} is none of {listed(sorted(MEDIA_EXTENSIONS))}")
    return MEDIA_EXTENSIONS[extension]


def _conversation_media(members: dict[str, bytes]) -> dict[str, list[str]]:
    """Media members by modality, in their order: one alone (``jpg``), or several by the number
    ending their names (``0.jpg``, ``1.png`` ...; ``img2.jpg`` before ``img10.jpg``). Several
    without a number each, or two with one number, have no order: refused."""
    found: dict[str, list[str]] = {}
    for name in members:
        extension = name.rpartition(".")[2].lower()
        if extension in MEDIA_EXTENSIONS:
            found.setdefault(MEDIA_EXTENSIONS[extension], []).append(name)
    ordered = {}
    for modality, names in found.items():
        numbers = [_NUMBERED.match(name) for name in names]
        if len(names) > 1 and (None in numbers or
                               len({int(n[1]) for n in numbers if n}) < len(names)):
            raise RecordError("malformed_record", f"{modality} members "
                              f"({listed(sorted(names))}) have no "
                              "order: number them in marker order (KEY.0.jpg, KEY.1.png ...)")
        ordered[modality] = [name for _, name in sorted(
            (int(n[1]) if n else 0, name) for n, name in zip(numbers, names))]
    return ordered


# a conversation JSON's fields that may name its sample's media members, by modality
_NAMING_FIELDS = {"image": ("images", "image"), "video": ("videos", "video"),
                  "audio": ("audios", "audio")}


def _as_named(names: list[str], refs: list, key: str, what: str) -> list[str]:
    """One modality's members ``names`` (in numbered order) in the order the JSON's ``refs``
    (``what``) name them, where every ref names a member of its own: as the file ``KEY.1.jpg``
    (of sample ``key``, any folder before it) or the member ``1.jpg`` alone. As they are
    otherwise (refs that are the source's own paths, kept as metadata: ``scene/1.jpg`` names
    nothing). RecordError where refs name this sample's files (``KEY.1.jpg``) but not each of
    its members once: which medium goes with which marker would be a guess."""
    lowered = {name.lower(): name for name in names}
    prefix = f"{key}.".lower()

    def member(ref) -> tuple[str | None, bool]:
        """The member ``ref`` names, and whether it names it by this sample's key."""
        if not isinstance(ref, str):
            return None, False
        base = ref.rsplit("/", 1)[-1].lower()
        if key and base.startswith(prefix) and base[len(prefix):] in lowered:
            return lowered[base[len(prefix):]], True
        return lowered.get(ref.lower()), False
    found = [member(ref) for ref in refs]
    named = [name for name, _ in found]
    if None not in named and sorted(map(str, named)) == sorted(names):
        return [str(name) for name in named]
    if any(by_key for _, by_key in found):
        raise RecordError("marker_mismatch", f"{what} names {[str(r) for r in refs][:6]}, but "
                          f"the sample's members are {names}: name each member once, in the "
                          "order of the markers (or leave the members' numbers to order them)")
    return names


def _dotted_hint(members: dict[str, bytes], wanted: str) -> str:
    """Why a sample lacks ``KEY.wanted`` where its key has a dot (``conv.v1.json``: webdataset's
    key ends at the first dot, so the member is ``v1.json``), or ""."""
    dotted = sorted(name for name in members if name.lower().endswith(f".{wanted}"))
    return (f"; the sample has a member {dotted[0]!r}: webdataset's key ends at the first "
            "dot of a file name, so a key with a dot (conv.v1.json) leaves its JSON a member "
            "'v1.json' of key 'conv'. Write keys without dots") if dotted else ""


def _document(members: dict[str, bytes], mapping: MemberMap, key: str) -> Synthesized:
    """An interleaved document: its JSON's ``texts`` + ``images``, the images by number (or
    as the ``images`` name them, ``_as_named``)."""
    if mapping.json not in members:
        raise RecordError("missing_json", f"no KEY.{mapping.json} member (the document)"
                          f"{_dotted_hint(members, mapping.json)}")
    raw = _json(members, mapping.json)
    if not isinstance(raw, dict):
        raise RecordError("malformed_record", f"KEY.{mapping.json} is not an object with "
                          "'texts' and 'images'")
    text, refs = normalize_document(raw.get("texts"), raw.get("images"))
    media = _conversation_media(members)
    others = sorted(m for m in media if m != "image")
    if others:
        raise RecordError("malformed_record", f"{others} member(s) in a document: its items "
                          "are images")
    images = media.get("image", [])
    if len(images) != len(refs):
        raise RecordError("marker_mismatch", f"{len(refs)} image(s) in KEY.{mapping.json}'s "
                          f"'images' but {len(images)} image member(s)")
    images = _as_named(images, refs, key, f"KEY.{mapping.json}'s 'images'")
    record_id = raw.get("id")
    return Synthesized({"id": None if record_id is None else str(record_id),
                        "kind": "document", "text": text},
                       [("image", name) for name in images])


def synthesize(members: dict[str, bytes], mapping: MemberMap, sample_key: str = ""
               ) -> Synthesized:
    """The record of sample ``sample_key``'s members (RecordError, with its report reason,
    otherwise)."""
    if mapping.layout == "documents":
        return _document(members, mapping, sample_key)
    if mapping.layout == "conversation":
        if mapping.json not in members:
            raise RecordError("missing_json", f"no KEY.{mapping.json} member (the conversation)"
                              f"{_dotted_hint(members, mapping.json)}")
        raw = _json(members, mapping.json)
        turns, tools, system, objects = (
            conversation_turns(raw), tool_lists(raw), raw.get("system"),
            raw.get("objects")) if isinstance(raw, dict) else (None,) * 4
        if isinstance(raw, dict) and turns is None:
            raise RecordError("malformed_record", f"KEY.{mapping.json} has the keys "
                              f"{listed(map(repr, sorted(raw)[:12]))}, and a conversation's "
                              "are 'messages' or "
                              "'conversations' (role/content or from/value turns): convert "
                              "other forms first, or give the --layout they are")
        messages = normalize_messages(turns, tools, system, objects)
        media = _conversation_media(members)
        for modality, names in media.items():
            key = next((k for k in _NAMING_FIELDS[modality]
                        if isinstance(raw, dict) and raw.get(k)), None)
            if key is not None:
                refs = raw[key] if isinstance(raw[key], list) else [raw[key]]
                media[modality] = _as_named(names, refs, sample_key,
                                            f"KEY.{mapping.json}'s {key!r}")
        order, counts = media_markers(
            messages, {modality: len(names) for modality, names in media.items()},
            mapping.markers_first)
        counts.update(conversation_counts(messages))
        seen = dict.fromkeys(MARKERS, 0)
        ordered = []
        for modality in order:
            ordered.append((modality, media[modality][seen[modality]]))
            seen[modality] += 1
        record_id = raw.get("id")
        return Synthesized({"id": None if record_id is None else str(record_id),
                            "messages": messages}, ordered,
                           counts=counts)
    medium = _medium(members, mapping.media)
    # a caption's field missing from its JSON is a medium without its caption (missing_text)
    # (a question-answer sample without its question or answer: missing_member)
    text = field(members, mapping.text, "the answer" if mapping.layout == "vqa" else
                 "the caption", "missing_member" if mapping.layout == "vqa" else
                 "missing_text")
    if mapping.layout == "vqa":
        question = field(members, mapping.question, "the question", "missing_member")
        if medium is None or question is None or text is None:
            raise RecordError("missing_member", "a question-answer sample needs its medium, "
                              f"KEY.{mapping.question} and KEY.{mapping.text}")
        marker = MARKERS[medium[0]]
        try:                        # a sample without weights (its JSON without the field)
            weights = field(members, mapping.weights, "the answer's weights", _NO_WEIGHTS) \
                if mapping.weights else None
        except RecordError as error:    # a broken member or spec stays the sample's fault
            if error.reason != _NO_WEIGHTS:
                raise
            weights = None
        answer, counts = _chosen(text, weights, "the answer")
        asked, answered = _as_text(question, "the question"), _as_text(answer, "the answer")
        if any(m in answered for m in MARKERS.values()):
            raise RecordError("marker_mismatch", f"the answer (KEY.{mapping.text}) holds a "
                              "media marker; the sample's one medium goes in the question")
        # the question's own marker, as LLaVA-style data converted to Energon has it
        # ("<image>\nWhat is shown?"), places the medium; without one it goes first
        placed = sum(asked.count(m) for m in MARKERS.values())
        if placed > 1 or placed and marker not in asked:
            raise RecordError("marker_mismatch", f"the question (KEY.{mapping.question}) holds "
                              f"{placed} media marker(s) for the sample's one {medium[0]} "
                              f"({marker}): give it one {marker} where the {medium[0]} goes, "
                              "or none (placed before the question)")
        messages = [{"role": "user", "content": asked if placed else f"{marker}\n{asked}"},
                    {"role": "assistant", "content": answered}]
        return Synthesized({"id": None, "messages": messages}, [medium], counts=counts)
    if medium is None:
        named = (f" (no KEY.{mapping.media} member; the sample has {listed(sorted(members))})"
                 if mapping.media else f" (the sample has {listed(sorted(members))}; a medium's "
                 f"member ends in one of {listed(sorted(MEDIA_EXTENSIONS))})")
        if text is None:            # neither of a pair: a member of something else
            raise RecordError("missing_media", f"the sample has neither a medium nor "
                              f"KEY.{mapping.text}{named}")
        raise RecordError("missing_media", f"KEY.{text[0]} has no medium beside it (a caption "
                          f"without its image, clip or audio){named}")
    if text is None:
        raise RecordError("missing_text", f"KEY.{medium[1]} has no KEY.{mapping.text} beside it "
                          "(an image without its caption; the sample has "
                          f"{listed(sorted(members))})" + (
                              f"; webdataset's key ends at the first dot of a file name, so "
                              f"KEY.{medium[1]} is a member {medium[1]!r}, not a medium of "
                              "a key with a dot: index with --media-member "
                              f"{medium[1]} --text-member "
                              f"{medium[1].partition('.')[0]}.{mapping.text}, or write keys "
                              "without dots" if "." in medium[1] else ""))
    text, counts = _chosen(text, None, "the caption")
    caption = _as_text(text, "the caption", "empty_caption")
    if any(marker in caption for marker in MARKERS.values()):
        raise RecordError("marker_mismatch", "a caption holds a media marker")
    source: dict[str, Any] = {}
    # the metadata member, also when the caption is one of its fields (``json[caption]``)
    if mapping.json in members and not (text[0] == mapping.json and isinstance(text[1], bytes)):
        meta = _json(members, mapping.json)
        if isinstance(meta, dict):      # img2dataset: url, key, status, width, height ...
            source = {k: meta[k] for k in ("url", "key") if isinstance(meta.get(k), str | int)}
    return Synthesized({"id": None, "kind": "caption", "text": caption}, [medium], source,
                       counts)


def detect(samples: list[dict[str, bytes]], json_member: str = "json") -> str | None:
    """The layout of a tar's first samples' members: ``conversation`` when a JSON member holds
    a conversation, ``documents`` when it holds ``texts`` and ``images``, ``pairs`` when a
    medium sits beside a ``txt``; None: none of them."""
    json_member = json_member.lower()
    for members in samples:
        if json_member in members:
            try:
                raw = json.loads(members[json_member])
            except ValueError:
                raw = None
            if isinstance(raw, dict) and ("conversations" in raw or "messages" in raw):
                return "conversation"
            if isinstance(raw, dict) and "texts" in raw and "images" in raw:
                return "documents"
    for members in samples:
        if "txt" in members and any(name.rpartition(".")[2].lower() in MEDIA_EXTENSIONS
                                    for name in members):
            return "pairs"
    return None
