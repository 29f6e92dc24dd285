"""Conversation → token ids with a per-token "trained" flag and modality markers expanded in place.

``TextEncoder`` is the one entry: it renders a conversation (``chat_render``: the chat template
or caption mode, with ``<image>``/``<audio>`` markers still in the text, and the trained
character spans), tokenizes a batch of texts at once, with offsets, by a copy of the tokenizer
in which the markers are atomic (through ``segment_tokenizer``'s piece cache when that is exact
for the tokenizer), turns the spans into the per-token mask (``trained_spans``), appends the
EOS after the answers ``append_eos`` asks for (``end_of_turn``), and expands each marker into
its item's placeholder tokens (``marker_expansion``). A token that straddles a span boundary, a
template that does not re-render the same prefix, or a modality or delimiter token typed
literally in the text (``typed_tokens``) is an error naming the sample — never a silently
wrong mask.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from tokenizers import AddedToken

from mimo_data.modalities import MARKERS
from mimo_data.preprocess.answer_parts import AnswerParts
from mimo_data.preprocess.chat_render import ChatRenderer, TextError, TrainedSpan
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.end_of_turn import EosAppending
from mimo_data.preprocess.marker_expansion import ItemTokens, MarkerExpander
from mimo_data.preprocess.record_kinds import KindRenderer, Messages, Rendered
from mimo_data.preprocess.segment_tokenizer import (SegmentCacheError, SegmentCachedTokenizer,
                                                    encode_texts, unsupported_reason)
from mimo_data.preprocess.tokenizer_loading import load_tokenizer, tokenizer_of_its_own
from mimo_data.preprocess.trained_spans import TrainedSpans
from mimo_data.preprocess.typed_tokens import TypedTokens, delimiter_tokens

__all__ = ["Encoded", "ItemTokens", "TextEncoder", "TextError", "load_tokenizer"]


@dataclass
class Encoded:
    """Token ids of a whole conversation and its loss mask (which tokens are targets of the
    loss); from ``encode_batch``, views into arrays shared with the other conversations of the
    batch."""
    ids: np.ndarray        # int64
    loss_mask: np.ndarray  # bool, per token of ids


class TextEncoder:
    """Renders conversations and tokenizes them, for one config and tokenizer.

    ``cache_tokens``: tokenize through ``SegmentCachedTokenizer`` when it is exact for the
    tokenizer (it checks itself against the tokenizer now and then); False: always the tokenizer.
    """

    def __init__(self, config: PreprocessConfig, tokenizer=None, *, cache_tokens: bool = True):
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config)
        # A private tokenizer in which the markers are atomic added tokens: one encode per
        # sample, identical to encoding the text between markers piece by piece (added tokens
        # split the text before the model's pre-tokenizer runs). A tokenizer.json saved with
        # padding or truncation on keeps it (transformers too): batches would be padded to
        # their longest text and texts cut at its max_length; this one does neither. A
        # conversation is tokenized whole; seq_length and length_policy decide what is kept.
        backend = tokenizer_of_its_own(self.tokenizer.backend_tokenizer)
        backend.add_special_tokens([AddedToken(m, special=True, normalized=False)
                                    for m in MARKERS.values()])
        self.backend = (SegmentCachedTokenizer(backend)
                        if cache_tokens and unsupported_reason(backend) is None else backend)
        self.vocab_size = len(self.tokenizer)
        self.markers = MarkerExpander(config, self.tokenizer, backend)
        self.modality_token_ids = self.markers.modality_token_ids
        self.renderer = ChatRenderer(config, self.tokenizer)
        self.answer_parts = AnswerParts(self.render, self.renderer.template)
        self.typed = TypedTokens(delimiter_tokens(
            self.tokenizer, self.renderer.template,
            {token for modality in config.modalities.values() for token in modality.wrap or ()}))
        self.kinds = KindRenderer(config, self.tokenizer, self.renderer.part_joiner)
        self.pad_token_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                             else self.tokenizer.eos_token_id)

    @property
    def template(self) -> str | None:
        """The chat template (None in caption mode)."""
        return self.renderer.template

    @property
    def has_generation_blocks(self) -> bool:
        return self.renderer.has_generation_blocks

    @property
    def contents_verbatim(self) -> bool:
        """Whether a conversation's text is its role shape's skeleton with the contents in
        place, proven from the template (``template_contents``)."""
        return self.renderer.contents_verbatim

    @property
    def eos_appending(self) -> EosAppending:
        """What ``append_eos`` comes to for this tokenizer and template."""
        return self.renderer.eos_appending

    def is_modality_token(self, token_id: int) -> bool:
        return self.markers.is_modality_token(token_id)

    def span(self, item: ItemTokens) -> int:
        """The ids ``item``'s marker becomes (``MarkerExpander.span``)."""
        return self.markers.span(item)

    def render(self, messages: Messages | Rendered) -> tuple[str, list[TrainedSpan]]:
        """The text and its trained character spans (``ChatRenderer.render``; a text rendered
        already, ``record_kinds``, as it is)."""
        if isinstance(messages, Rendered):
            return messages.text, messages.spans
        return self.renderer.render(messages)

    def encode(self, messages: Messages | Rendered,
               item_tokens: Sequence[ItemTokens]) -> Encoded:
        """Tokens of the conversation with marker i expanded to ``item_tokens[i]``'s ``tokens``
        copies of its modality's token (between its ``wrap`` tokens if it has them, in runs
        after its ``texts`` if it has them); TextError if they cannot be built."""
        encoded = self.encode_batch([(messages, item_tokens)])[0]
        if isinstance(encoded, TextError):
            raise encoded
        return encoded

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]],
                      item_tokens: Sequence[ItemTokens],
                      template_options: Mapping[str, Any] | None = None) -> np.ndarray:
        """Token ids of a conversation for the model to continue (generation): rendered with
        the template's generation prompt (``ChatRenderer.render_prompt``, with
        ``template_options``), marker i expanded to ``item_tokens[i]`` copies of its
        modality's token as ``encode`` does; TextError if they cannot be built."""
        tokens = encode_texts(self.backend, [self.renderer.render_prompt(messages,
                                                                         template_options)])
        failed: dict[int, TextError] = {}
        marker_at, counts, modality_tokens, texts = self.markers.markers(tokens, [item_tokens],
                                                                         failed)
        if failed:
            raise failed[0]
        return self.markers.expand(tokens.ids.copy(), None, marker_at, counts, modality_tokens,
                                   texts)[0]

    def encode_batch(self, conversations: Sequence[tuple[Messages | Rendered,
                                                         Sequence[ItemTokens]]]
                     ) -> list[Encoded | TextError]:
        """``encode`` of each (messages, item_tokens), or the TextError of that conversation.

        The texts are tokenized in one call and their markers, masks and expansions computed
        on the concatenated tokens: per-sample numpy calls on a few hundred tokens cost more
        than the work itself."""
        results: list[Encoded | TextError | None] = [None] * len(conversations)
        texts: list[str] = []
        which: list[int] = []
        starts, spans = [0], TrainedSpans()
        for i, (messages, _) in enumerate(conversations):
            typed = self.typed.error([("the text", messages.source)]
                                     if isinstance(messages, Rendered) else
                                     _written_texts(messages))
            try:
                if typed is not None:
                    raise typed
                text, text_spans = self.render(messages)
            except TextError as exc:
                results[i] = exc
                continue
            spans.add(len(texts), starts[-1], text_spans)
            texts.append(text)
            which.append(i)
            starts.append(starts[-1] + len(text))
        try:
            tokens = encode_texts(self.backend, texts)
        except SegmentCacheError as exc:
            raise SegmentCacheError(which[exc.index], str(exc)) from None
        failed: dict[int, TextError] = {}
        marker_at, counts, modality_tokens, run_texts = self.markers.markers(
            tokens, [conversations[i][1] for i in which], failed)
        mask = spans.inside(tokens.offsets, "".join(texts), starts, failed)
        ids, trained, bounds = tokens.ids, mask.trained, tokens.bounds
        if len(mask.eos_at):
            ids, trained, bounds, marker_at = self._with_eos(ids, trained, bounds, marker_at,
                                                             mask.eos_at, mask.eos_texts)
        if len(marker_at):
            ids, trained, repeats = self.markers.expand(ids, trained, marker_at, counts,
                                                        modality_tokens, run_texts)
            bounds = np.concatenate(([0], np.cumsum(repeats)))[bounds]
        for j, i in enumerate(which):
            a, b = bounds[j], bounds[j + 1]
            results[i] = failed[j] if j in failed else Encoded(ids[a:b], trained[a:b])
        return cast(list[Encoded | TextError], results)   # every slot is filled above

    def _with_eos(self, ids: np.ndarray, trained: np.ndarray, bounds: np.ndarray,
                  marker_at: np.ndarray, eos_at: np.ndarray, eos_texts: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The tokens of the texts with a trained EOS before each position of ``eos_at`` (the
        token after an answer's last), ending an answer of text ``eos_texts[k]``: the ids,
        the mask, each text's bounds and the markers' positions in them."""
        per_text = np.bincount(eos_texts, minlength=len(bounds) - 1)
        return (np.insert(ids, eos_at, self.tokenizer.eos_token_id),
                np.insert(trained, eos_at, True),
                bounds + np.concatenate(([0], np.cumsum(per_text))),
                marker_at + np.searchsorted(eos_at, marker_at, side="right"))


def _written_texts(messages: Messages) -> Iterator[tuple[str, str]]:
    """(where, text) of what a conversation's template writes from its data: each content,
    and an answer's calls, the tools and a tool turn's name and call id as JSON text."""
    for k, message in enumerate(messages):
        yield f"message {k} ({message['role']})", message["content"]
        if len(message) > 2:            # more than its role and content: maybe tool fields
            for key in ("tool_calls", "tools", "name", "tool_call_id"):
                if message.get(key):
                    yield f"message {k}'s {key}", json.dumps(message[key],
                                                             ensure_ascii=False)
