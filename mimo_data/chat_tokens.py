"""Conversation → token ids with a per-token "trained" flag and modality markers expanded in place.

The text is rendered once (the chat template in ``chat`` mode, plain concatenation in
``caption`` mode) with ``<image>``/``<audio>`` markers still in it. The trained character spans
come from the template itself: its ``{% generation %}`` blocks when it has them, otherwise
incremental rendering (the text an assistant turn adds after the generation prompt). Each span
runs to its end-of-turn token, inclusive. The text between markers is tokenized with offsets;
each marker becomes N copies of its modality token. A token that straddles a span boundary, a
template that does not re-render the same prefix, or a modality token typed literally in the
text is an error naming the sample — never a silently wrong mask.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from tokenizers import AddedToken
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from mimo_data.preprocess_config import PreprocessConfig
from mimo_data.shard_format import MARKERS

_MARKER_PATTERN = re.compile("|".join(re.escape(m) for m in MARKERS.values()))
_MARKER_MODALITY = {marker: modality for modality, marker in MARKERS.items()}
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TextError(Exception):
    """A conversation whose tokens or mask cannot be built; ``reason`` is its report category."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class Encoded:
    """Token ids of a whole conversation and which of them are trained (targets of the loss)."""
    ids: list[int]
    trained: list[bool]


def load_tokenizer(config: PreprocessConfig):
    """The configured tokenizer with each modality's special token added if missing."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    except Exception as exc:  # hub errors, missing files, bad configs all surface here
        raise ValueError(f"cannot load tokenizer {config.tokenizer!r}: {exc} (give a local "
                         "tokenizer directory, or a hub name reachable from here)") from None
    missing = [m.token for m in config.modalities.values()
               if m.token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in missing],
                             special_tokens=True)
    return tokenizer


def _chat_template(config: PreprocessConfig, tokenizer) -> str:
    override = config.chat_template
    if override and os.path.isfile(override):
        with open(override) as handle:
            override = handle.read()
    try:
        return tokenizer.get_chat_template(override)
    except ValueError as exc:
        raise ValueError(f"tokenizer {config.tokenizer!r} has no chat template and none is "
                         f"configured (chat_template:), or use mode: caption ({exc})") from None


class TextEncoder:
    """Renders conversations and tokenizes them, for one config and tokenizer."""

    def __init__(self, config: PreprocessConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config)
        self.backend = self.tokenizer.backend_tokenizer
        self.vocab_size = len(self.tokenizer)
        self.modality_token_ids = {name: self.tokenizer.convert_tokens_to_ids(m.token)
                                   for name, m in config.modalities.items()}
        self.eot = self.tokenizer.eos_token
        if self.eot is None:
            raise ValueError(f"tokenizer {config.tokenizer!r} has no eos token to end turns with")
        self.pad_token_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                             else self.tokenizer.eos_token_id)
        if config.mode == "chat":
            self.template = _chat_template(config, self.tokenizer)
            self.has_generation_blocks = bool(_GENERATION_BLOCK.search(self.template))
            self.template_kwargs = dict(self.tokenizer.special_tokens_map)

    # -- rendering ---------------------------------------------------------------------------

    def _render(self, messages, generation_prompt=False, with_spans=False):
        try:
            rendered, spans = render_jinja_template(
                [messages], chat_template=self.template, add_generation_prompt=generation_prompt,
                return_assistant_tokens_mask=with_spans, **self.template_kwargs)
        except Exception as exc:  # the template's own raise_exception(), jinja errors
            raise TextError("template_error", f"the chat template failed: {exc}") from None
        return rendered[0], (spans[0] if with_spans else None)

    def render(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The text and its trained character spans (each ending with the end-of-turn token)."""
        if self.config.mode == "caption":
            return self._render_caption(messages)
        if self.has_generation_blocks:
            text, spans = self._render(messages, with_spans=True)
        else:
            text, spans = self._render(messages)[0], []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before = self._render(messages[:i], generation_prompt=True)[0]
                after = self._render(messages[:i + 1])[0]
                if not (after.startswith(before) and text.startswith(after)):
                    raise TextError("template_mismatch", f"the chat template does not render "
                                    f"turn {i} as an extension of the turns before it, so the "
                                    "assistant span cannot be located; give a chat_template with "
                                    "{% generation %} blocks")
                spans.append((len(before), len(after)))
        return text, [self._through_eot(text, start, end) for start, end in spans]

    def _through_eot(self, text: str, start: int, end: int) -> tuple[int, int]:
        # Train up to and including the end-of-turn token; what the template adds after it
        # (a newline before the next turn) is not something the model must generate.
        stop = text.rfind(self.eot, start, end)
        if stop == -1:
            raise TextError("template_mismatch", f"an assistant turn does not end with the "
                            f"end-of-turn token {self.eot!r}: {text[start:end][-60:]!r}")
        return start, stop + len(self.eot)

    def _render_caption(self, messages):
        # Caption mode: no template; turns joined by newlines, each assistant text followed by
        # the eos token; the loss covers the assistant texts and their eos tokens.
        parts, spans, position = [], [], 0
        for message in messages:
            if parts:
                parts.append("\n")
                position += 1
            piece = message["content"]
            if message["role"] == "assistant":
                piece += self.eot
                spans.append((position, position + len(piece)))
            parts.append(piece)
            position += len(piece)
        return "".join(parts), spans

    # -- tokenizing --------------------------------------------------------------------------

    def encode(self, messages: list[dict], item_tokens: list[tuple[str, int]]) -> Encoded:
        """Tokens of the conversation with marker i expanded to ``item_tokens[i]`` = (modality,
        count) copies of that modality's token."""
        text, spans = self.render(messages)
        markers = list(_MARKER_PATTERN.finditer(text))
        found = [_MARKER_MODALITY[m.group()] for m in markers]
        expected = [modality for modality, _ in item_tokens]
        if found != expected:
            raise TextError("template_mismatch", f"the rendered text has markers {found}, the "
                            f"sample's media are {expected}")
        bounds = [0] + [x for m in markers for x in m.span()] + [len(text)]
        pieces = [(bounds[2 * i], bounds[2 * i + 1]) for i in range(len(markers) + 1)]
        encodings = self.backend.encode_batch([text[a:b] for a, b in pieces],
                                              add_special_tokens=False)
        ids, trained = [], []
        span_iter = _SpanCursor(spans)
        reserved = set(self.modality_token_ids.values())
        for index, ((base, _), encoding) in enumerate(zip(pieces, encodings)):
            for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
                if token_id in reserved:
                    raise TextError("literal_special_token", f"the text contains a modality "
                                    f"token ({self.tokenizer.convert_ids_to_tokens(token_id)}) "
                                    "typed literally; remove it from the source text")
                ids.append(token_id)
                trained.append(span_iter.inside(base + start, base + end, text))
            if index < len(markers):
                modality, count = item_tokens[index]
                ids.extend([self.modality_token_ids[modality]] * count)
                trained.extend([False] * count)
        return Encoded(ids, trained)


class _SpanCursor:
    """Classifies token character ranges (visited in order) against sorted trained spans."""

    def __init__(self, spans):
        self.spans = sorted(spans)
        self.position = 0

    def inside(self, start: int, end: int, text: str) -> bool:
        if start >= end:
            return False
        while self.position < len(self.spans) and self.spans[self.position][1] <= start:
            self.position += 1
        if self.position == len(self.spans):
            return False
        span_start, span_end = self.spans[self.position]
        if span_start <= start and end <= span_end:
            return True
        if end <= span_start:
            return False
        raise TextError("template_mismatch", f"token {text[start:end]!r} at characters "
                        f"{start}-{end} crosses the edge of a trained span "
                        f"({span_start}-{span_end}); the loss mask would be ambiguous")
