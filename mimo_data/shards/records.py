"""Normalize one raw record (any input form) into the shard sample's messages and media order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mimo_data.modalities import MARKERS
from mimo_data.tally import CountedError

# ShareGPT/LLaVA speaker names and OpenAI/HF roles, mapped to the three roles we store.
ROLE_ALIASES = {"system": "system", "human": "user", "user": "user",
                "gpt": "assistant", "assistant": "assistant"}


class RecordError(CountedError):
    """A record that cannot become a sample; ``reason`` is its report category."""


def _content_text(content) -> str:
    """Message content as text: a string, or HF-style parts with media parts (``{"type":
    "image"}``, ``"audio"``, ``"video"``) as their markers."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif kind in MARKERS:
                pieces.append(MARKERS[kind])
            else:
                kinds = "|".join(repr(k) for k in ("text", *MARKERS))
                raise RecordError("malformed_record", f"unsupported content part {part!r}: "
                                  f"expected {{'type': {kinds}, ...}}")
        return "\n".join(pieces)
    raise RecordError("malformed_record", f"message content must be a string or a list of "
                      f"parts, got {type(content).__name__}")


def normalize_messages(turns) -> list[dict]:
    """Turns in ShareGPT (``from``/``value``) or chat (``role``/``content``) form → messages.

    Raises RecordError for unknown roles, missing fields, an empty conversation and text that
    cannot be encoded as UTF-8 (e.g. lone surrogates from ``\\ud800`` escapes).
    """
    if not isinstance(turns, list) or not turns:
        raise RecordError("malformed_record", "the conversation is missing or empty")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError("malformed_record", f"turn {i} is not an object")
        speaker = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if speaker is None or content is None:
            raise RecordError("malformed_record", f"turn {i} needs role/content or from/value")
        role = ROLE_ALIASES.get(str(speaker).lower())
        if role is None:
            raise RecordError("unknown_role", f"turn {i} has role {speaker!r}; known roles: "
                              f"{sorted(ROLE_ALIASES)}")
        text = _content_text(content)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RecordError("invalid_utf8",
                              f"turn {i} text is not valid Unicode: {exc}") from None
        messages.append({"role": role, "content": text})
    if all(m["role"] == "system" for m in messages):
        raise RecordError("malformed_record", "the conversation has only system turns")
    return messages


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


def check_marker_counts(order: list[str], counts: dict[str, int]) -> None:
    """Raise RecordError when a modality's marker count differs from its media count."""
    for modality, marker in MARKERS.items():
        markers = order.count(modality)
        if markers != counts.get(modality, 0):
            raise RecordError("marker_mismatch", f"{markers} {marker} marker(s) in the text but "
                              f"{counts.get(modality, 0)} {modality} item(s) in the record")
