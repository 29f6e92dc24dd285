"""Caption pairs and interleaved documents → what ``TextEncoder.encode_batch`` takes.

A conversation goes to the encoder as its messages. A caption in ``captions.format: chat``
becomes the conversation of its modality's prompt and the caption as the answer. A caption in
``plain`` format and a document are rendered here, without a chat template (``Rendered``):

- plain caption: ``BOS? <marker> caption EOS``, the caption and the EOS trained (LLaVA's
  pre-training ``plain`` conversation; Qwen-VL's stage 1);
- document: ``BOS? text EOS`` with the items' markers in place in the text, all of it trained
  (language modelling); the markers' placeholders never are (``marker_expansion``), their wrap
  tokens only with ``documents.train_media_wraps`` (``trained_wraps``).

``BOS?``: the tokenizer's BOS where it puts one before every text (``added_bos``), as the chat
path does. ``roles`` gives any record as messages whose roles say what trains, for the checks
of ``mimo-inspect`` (the caption or the document as the assistant's).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from mimo_data.modalities import MARKERS
from mimo_data.preprocess.chat_render import TrainedSpan
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.tokenizer_loading import added_bos
from mimo_data.shards.format import RECORD_KINDS, TEXT_PART_BREAK, record_kind

Messages = Sequence[Mapping[str, Any]]
_MARKER_SPLIT = re.compile("|".join(re.escape(marker) for marker in MARKERS.values()))


class Rendered(NamedTuple):
    """A text rendered already, its trained character spans, and the record's own text in
    it."""
    text: str
    spans: list[TrainedSpan]
    source: str


def kind_of(record: Mapping[str, Any]) -> str:
    """The record's kind; ValueError (a malformed record) when it is none of ``RECORD_KINDS``."""
    kind = record_kind(record)       # type: ignore[arg-type]
    if kind not in RECORD_KINDS:
        raise ValueError(f"kind is {kind!r}: use {', '.join(RECORD_KINDS)} (or no kind: a "
                         "conversation)")
    return kind


def trains_as(kind: str, config: PreprocessConfig) -> str:
    """What records of ``kind`` train as under ``config``, in words: ``caption (plain)``."""
    return f"caption ({config.captions.format})" if kind == "caption" else kind


class KindRenderer:
    """The rendering of every record kind for one config and tokenizer; a conversation's
    adjacent text parts joined by ``part_joiner``, what its chat template writes between two
    (``ChatRenderer.part_joiner``)."""

    def __init__(self, config: PreprocessConfig, tokenizer, part_joiner: str = "\n"):
        self.config = config
        self.bos = added_bos(tokenizer)
        self.eos = tokenizer.eos_token
        self.part_joiner = part_joiner

    def encodable(self, record: Mapping[str, Any]) -> Messages | Rendered:
        """The record as the text encoder takes it: messages, or a ``Rendered`` text."""
        kind = kind_of(record)
        if kind == "conversation":
            return self._joined(record["messages"])
        if kind == "caption" and self.config.captions.format == "chat":
            return self._caption_messages(record)
        prefix = MARKERS[_caption_item(record)] if kind == "caption" else ""
        text = _text(record)
        head = self.bos + prefix
        return Rendered(head + text + self.eos,
                        [TrainedSpan(len(head), len(head) + len(text) + len(self.eos), False)],
                        text)

    def roles(self, record: Mapping[str, Any]) -> Messages:
        """The record as messages whose assistant contents are what trains (a document's text
        between its markers, one message a piece: the tokens around an item are not the
        text's)."""
        kind = kind_of(record)
        if kind == "conversation":
            return self._joined(record["messages"])
        if kind == "caption":
            if self.config.captions.format == "chat":
                return self._caption_messages(record)
            return [{"role": "user", "content": MARKERS[_caption_item(record)]},
                    {"role": "assistant", "content": _text(record)}]
        return [{"role": "assistant", "content": piece}
                for piece in _MARKER_SPLIT.split(_text(record)) if piece.strip()]

    def _joined(self, messages: Messages) -> Messages:
        """``messages`` with each ``TEXT_PART_BREAK`` in a content replaced by the template's
        joiner (the same list where there is none: most records)."""
        if not any(TEXT_PART_BREAK in content for message in messages
                   if isinstance(content := message.get("content"), str)):
            return messages
        return [{**message, "content": message["content"].replace(TEXT_PART_BREAK,
                                                                  self.part_joiner)}
                if isinstance(message.get("content"), str) else message
                for message in messages]

    def _caption_messages(self, record: Mapping[str, Any]) -> Messages:
        modality = _caption_item(record)
        prompt = self.config.captions.prompts.get(modality)
        if prompt is None:       # prompts are given for every marker's modality by default
            raise KeyError(f"captions.prompts has no {modality} prompt")
        return [{"role": "user", "content": prompt},
                {"role": "assistant", "content": _text(record)}]


def trained_wraps(ids: np.ndarray, trained: np.ndarray, wrap_ids: Sequence[int]) -> None:
    """Make the wrap tokens among ``ids`` targets (``documents.train_media_wraps``), in place;
    the first token is never one."""
    at = np.isin(ids, np.asarray(wrap_ids, dtype=ids.dtype))
    at[0] = False
    trained[at] = True


def _text(record: Mapping[str, Any]) -> str:
    text = record["text"]
    if not isinstance(text, str):
        raise TypeError(f"text is a {type(text).__name__}, not a string")
    return text


def _caption_item(record: Mapping[str, Any]) -> str:
    """The modality of a caption's one media item (ValueError unless it has exactly one)."""
    media = record["media"]
    if len(media) != 1:
        raise ValueError(f"a caption has exactly one media item, this one {len(media)}")
    return media[0]["modality"]
