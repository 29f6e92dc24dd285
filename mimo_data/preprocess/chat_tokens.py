"""Conversation → token ids with a per-token "trained" flag and modality markers expanded in place.

The text is rendered once (the chat template in ``chat`` mode, plain concatenation in
``caption`` mode) with ``<image>``/``<audio>`` markers still in it. The trained character spans
come from the template itself: its ``{% generation %}`` blocks when it has them, otherwise
incremental rendering (the text an assistant turn adds after the generation prompt). Each span
runs to its end-of-turn token, inclusive. The text is tokenized once, with offsets, by a copy
of the tokenizer in which the markers are atomic (through ``segment_tokenizer``'s piece cache
when that is exact for the tokenizer); each marker becomes N copies of its modality token. A
token that straddles a span boundary, a template that does not re-render the same prefix, or a
modality token typed literally in the text is an error naming the sample — never a silently
wrong mask.

Incremental rendering costs one render per assistant turn and one more per turn before it, so
it runs once per conversation *shape* (its roles), on a skeleton whose contents are
placeholders; a sample then renders once, and its text must equal the skeleton with its
contents filled in (the template inserted every content verbatim, once), which makes its spans
the skeleton's (a template that does so for the whole conversation is taken to do so for its
prefixes too). Otherwise, e.g. for a template that trims or branches on contents, the sample
takes the per-sample incremental path. When ``template_contents`` proves from the template's
syntax that it outputs contents as they are, a sample is not rendered at all: its text is the
filled skeleton.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np

from tokenizers import AddedToken, Tokenizer
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import (_compile_jinja_template,
                                                   render_jinja_template)

from mimo_data.errors import ConfigError
from mimo_data.preprocess.config import PreprocessConfig, looks_like_path
from mimo_data.tally import CountedError
from mimo_data.preprocess.segment_tokenizer import (SegmentCacheError, SegmentCachedTokenizer,
                                         TokenBatch, encode_texts, unsupported_reason)
from mimo_data.modalities import MARKERS
from mimo_data.preprocess.template_contents import contents_inserted_verbatim

_GENERATION_BLOCK = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")
# Placeholder for the content of message k in a skeleton render (private-use code points).
_SLOT = "\ue000{}\ue001"
_SLOT_PATTERN = re.compile("\ue000([0-9]+)\ue001")
_MAX_SKELETONS = 256


class TextError(CountedError):
    """A conversation whose tokens or mask cannot be built; ``reason`` is its report category."""


class ItemTokens(NamedTuple):
    """What one media marker expands into: ``tokens`` copies of its modality's token, between
    the modality's wrap tokens; with ``texts`` (``Modality.placeholder_texts``) in
    ``len(texts)`` equal runs, each after its text and between the wrap tokens, all of them
    between the wrap tokens again."""
    modality: str
    tokens: int
    texts: tuple[str, ...] = ()


@dataclass
class Encoded:
    """Token ids of a whole conversation and its loss mask (which tokens are targets of the
    loss); from ``encode_batch``, views into arrays shared with the other conversations of the
    batch."""
    ids: np.ndarray        # int64
    loss_mask: np.ndarray  # bool, per token of ids


def load_tokenizer(config: PreprocessConfig):
    """The configured tokenizer with each modality's special token added if missing."""
    name = config.tokenizer
    if looks_like_path(name) and not os.path.isdir(os.path.expanduser(name)):
        # Not a hub name either: say so instead of the hub's "Repo id must be in the form".
        raise ConfigError(f"tokenizer: {name!r} is {os.path.abspath(os.path.expanduser(name))}, "
                          "which is not a directory (in a YAML, paths are relative to its "
                          "folder)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # hub errors, missing files, bad configs all surface here
        raise ConfigError(f"tokenizer: cannot load {name!r}: {exc} (give a local tokenizer "
                          "directory, or a hub name reachable from here)") from None
    vocabulary = tokenizer.get_vocab()                  # a new dict at each call: 0.1 s
    missing = [m.token for m in config.modalities.values() if m.token not in vocabulary]
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
        kept = _processor_chat_template(config.tokenizer)
        if kept is not None:
            return kept
        raise ValueError(f"tokenizer {config.tokenizer!r} has no chat template and none is "
                         f"configured (chat_template:), or use mode: caption ({exc})") from None


def _processor_chat_template(name: str) -> str | None:
    """The chat template a processor keeps beside the tokenizer (``chat_template.jinja``, or
    ``chat_template.json``'s ``chat_template``), where the tokenizer has none: llava-hf
    repositories keep theirs there only. A local directory, or a hub name's cached files."""
    import json

    from huggingface_hub import try_to_load_from_cache
    directory = os.path.expanduser(name)
    for file in ("chat_template.jinja", "chat_template.json"):
        path = (os.path.join(directory, file) if os.path.isdir(directory)
                else try_to_load_from_cache(name, file))
        if isinstance(path, str) and os.path.isfile(path):
            with open(path) as handle:
                text = handle.read()
            return text if file.endswith(".jinja") else json.loads(text)["chat_template"]
    return None


@dataclass(frozen=True)
class _Skeleton:
    """A conversation shape rendered with placeholder contents: the text is ``parts[0]``, the
    content of message ``order[0]``, ``parts[1]``, ...; trained spans as (part, offset) pairs."""
    parts: tuple[str, ...]
    order: tuple[int, ...]
    spans: tuple[tuple[tuple[int, int], tuple[int, int]], ...]

    def fill(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The skeleton's text and spans with ``messages``' contents in place."""
        contents = [messages[k]["content"] for k in self.order]
        pieces, starts, position = [self.parts[0]], [0], len(self.parts[0])
        for content, part in zip(contents, self.parts[1:]):
            position += len(content)
            starts.append(position)
            position += len(part)
            pieces += (content, part)
        return "".join(pieces), [(starts[a] + i, starts[b] + j)
                                 for (a, i), (b, j) in self.spans]


class TextEncoder:
    """Renders conversations and tokenizes them, for one config and tokenizer.

    ``cache_tokens``: tokenize through ``SegmentCachedTokenizer`` when it is exact for the
    tokenizer (it checks itself against the tokenizer now and then); False: always the tokenizer.
    """

    def __init__(self, config: PreprocessConfig, tokenizer=None, *, cache_tokens: bool = True):
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config)
        # A private copy of the fast tokenizer in which the markers are atomic added tokens:
        # one encode per sample, identical to encoding the text between markers piece by piece
        # (added tokens split the text before the model's pre-tokenizer runs).
        backend = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
        # A tokenizer.json saved with padding or truncation on keeps it (transformers too):
        # batches would be padded to their longest text and texts cut at its max_length. A
        # conversation is tokenized whole; seq_length and length_policy decide what is kept.
        backend.no_padding()
        backend.no_truncation()
        backend.add_special_tokens([AddedToken(m, special=True, normalized=False)
                                    for m in MARKERS.values()])
        self.backend = (SegmentCachedTokenizer(backend)
                        if cache_tokens and unsupported_reason(backend) is None else backend)
        self._marker_ids = {backend.token_to_id(m): modality for modality, m in MARKERS.items()}
        self.vocab_size = len(self.tokenizer)
        self.modality_token_ids = {name: self.tokenizer.convert_tokens_to_ids(m.token)
                                   for name, m in config.modalities.items()}
        # modality token id -> the ids of the tokens around each item's run of it
        vocabulary = self.tokenizer.get_vocab() if any(
            m.wrap for m in config.modalities.values()) else {}
        self._wraps = {self.modality_token_ids[name]: self._wrap_ids(name, m.wrap, vocabulary)
                       for name, m in config.modalities.items() if m.wrap}
        # ``placeholder_texts`` (Qwen3-VL's timestamps) tokenized alone: in the processor's
        # text each lies between two wrap tokens, which the tokenizer splits off before its
        # pre-tokenizer (added tokens), so it tokenizes there exactly as alone; remembered
        self._run_text_ids: dict[str, list[int]] = {}
        self._plain_backend = backend
        if any(getattr(m, "timestamps", False) for m in config.modalities.values()):
            added = {t.content for t in backend.get_added_tokens_decoder().values()}
            for name, m in config.modalities.items():
                if getattr(m, "timestamps", False) and not set(m.wrap) <= added:
                    raise ConfigError(f"modalities.{name}.timestamps: the wrap tokens "
                                      f"{list(m.wrap)} are not added tokens of the tokenizer "
                                      f"{config.tokenizer!r}, so the timestamp texts between "
                                      "them would not tokenize as the processor's; use the "
                                      "model's own (e.g. <|vision_start|>, <|vision_end|>)")
        # Token id -> 1 for modality tokens (never typed in text), 2 for the atomic markers (a
        # modality token that is its own marker, as LLaVA's <image>, is a marker in text).
        size = backend.get_vocab_size(with_added_tokens=True) + 1
        self._token_kind = np.zeros(size, dtype=np.int8)
        self._token_kind[[int(i) for i in self.modality_token_ids.values()]] = 1
        self._token_kind[[int(i) for i in self._marker_ids if i is not None]] = 2
        self._modality_token = np.zeros(size, dtype=bool)
        self._modality_token[[int(i) for i in self.modality_token_ids.values()]] = True
        self.eot = self.tokenizer.eos_token
        if self.eot is None:
            raise ValueError(f"tokenizer {config.tokenizer!r} has no eos token to end turns with")
        self.pad_token_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                             else self.tokenizer.eos_token_id)
        self.contents_verbatim = True       # caption mode joins the contents as they are
        if config.mode == "chat":
            self.template = _chat_template(config, self.tokenizer)
            self.has_generation_blocks = bool(_GENERATION_BLOCK.search(self.template))
            self.template_kwargs = dict(self.tokenizer.special_tokens_map)
            # transformers' own compiled (cached) template: render_jinja_template's per-call
            # conversion of the messages costs a third of each render; ours are plain dicts.
            self._compiled = _compile_jinja_template(self.template)
            self._skeletons: dict[tuple[str, ...], _Skeleton | None] = {}
            # Proven from the template's syntax: a conversation's text is its skeleton filled
            # with the contents, so jinja runs once per role shape instead of once per sample.
            self.contents_verbatim = (not self.has_generation_blocks and
                                      contents_inserted_verbatim(self._compiled.environment,
                                                                 self.template))
            # A template that renders contents only from typed parts (llava-hf's: a message's
            # images, then its text) gets each content as those parts (``typed_parts``)
            self.typed_contents = self._takes_typed_contents()
            # the BOS a tokenizer puts before every text it encodes (LLaMA's <s>) where the
            # template does not write it: the published processors encode the chat with it
            self.bos_text = _added_bos(self.tokenizer)

    def is_modality_token(self, token_id: int) -> bool:
        return bool(self._modality_token[token_id])

    def _wrap_ids(self, modality: str, wrap: Sequence[str],
                  vocabulary: dict[str, int]) -> tuple[int, int]:
        missing = [token for token in wrap if token not in vocabulary]
        if missing:
            raise ConfigError(f"modalities.{modality}.wrap names {missing}, which the tokenizer "
                              f"{self.config.tokenizer!r} does not have: use the model's own "
                              "tokens (e.g. <|vision_start|>, <|vision_end|>)")
        return vocabulary[wrap[0]], vocabulary[wrap[1]]

    def _expand(self, ids: np.ndarray, trained: np.ndarray | None, marker_at: np.ndarray,
                counts: list[int], modality_tokens: list[int], texts: list[tuple[str, ...]]):
        """Each marker token → its item's run of ``count`` modality tokens, between the
        modality's wrap tokens when it has them (or, with ``texts``, ``_timed_runs``);
        ``(ids, trained, repeats)`` with the markers' runs never trained (``repeats``: tokens
        each input token became)."""
        wraps = [self._wraps.get(token) for token in modality_tokens] if self._wraps else []
        wrapped = np.array([wrap is not None for wrap in wraps], dtype=bool)
        repeats = np.ones(len(ids), dtype=np.int64)
        repeats[marker_at] = counts
        ids[marker_at] = modality_tokens
        timed = {k: self._timed_runs(modality_tokens[k], counts[k], runs)
                 for k, runs in enumerate(texts) if runs}
        if timed:
            at = list(timed)
            wrapped[at] = False
            repeats[marker_at[at]] = [len(run) for run in timed.values()]
        if wrapped.any():
            repeats[marker_at] += 2 * wrapped
        expanded = np.repeat(ids, repeats)
        if wrapped.any():
            ends = np.cumsum(repeats)[marker_at[wrapped]]
            pairs = np.array([wraps[k] for k in np.flatnonzero(wrapped)], dtype=np.int64)
            expanded[ends - repeats[marker_at[wrapped]]] = pairs[:, 0]
            expanded[ends - 1] = pairs[:, 1]
        if timed:
            starts = (np.cumsum(repeats) - repeats)[marker_at[list(timed)]].tolist()
            for start, run in zip(starts, timed.values()):
                expanded[start:start + len(run)] = run
        if trained is not None:
            trained[marker_at] = False
            trained = np.repeat(trained, repeats)
        return expanded, trained, repeats

    def _timed_runs(self, token: int, count: int, texts: tuple[str, ...]) -> np.ndarray:
        """``start, (text, start, count / len(texts) x token, end) per text, end``: a
        Qwen3-VL video as its processor writes it (the template's wrap around the clip, a
        timestamp and a wrap per temporal patch)."""
        start, end = self._wraps[token]
        if count % len(texts):
            raise ValueError(f"{count} placeholders do not split into {len(texts)} equal runs")
        run = [start, *[token] * (count // len(texts)), end]
        ids = [start]
        for text in texts:
            if text not in self._run_text_ids:
                self._run_text_ids[text] = self._plain_backend.encode(
                    text, add_special_tokens=False).ids
            ids += self._run_text_ids[text] + run
        ids.append(end)
        return np.array(ids, dtype=np.int64)

    # -- rendering ---------------------------------------------------------------------------

    def _takes_typed_contents(self) -> bool:
        """Whether the template drops a plain string content but writes a typed text part."""
        probe = "\ue002probe\ue003"

        def writes(content) -> bool:
            try:
                return probe in self._compiled.render(
                    messages=[{"role": "user", "content": content}], tools=None,
                    documents=None, add_generation_prompt=False, **self.template_kwargs)
            except Exception:  # a template that refuses the probe: no evidence either way
                return False
        return not writes(probe) and writes([{"type": "text", "text": probe}])

    def _for_template(self, messages):
        if not self.typed_contents:
            return messages
        return [{"role": m["role"], "content": typed_parts(m["content"])} for m in messages]

    def _render(self, messages, generation_prompt=False):
        messages = self._for_template(messages)
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=generation_prompt,
                                         **self.template_kwargs)
        except Exception as exc:  # the template's own raise_exception(), jinja errors
            raise TextError("template_error", f"the chat template failed: {exc}") from None

    def _render_with_generation_spans(self, messages):
        try:
            rendered, spans = render_jinja_template(
                [self._for_template(messages)], chat_template=self.template,
                return_assistant_tokens_mask=True,
                **self.template_kwargs)
        except Exception as exc:
            raise TextError("template_error", f"the chat template failed: {exc}") from None
        return rendered[0], spans[0]

    def render(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The text and its trained character spans (each ending with the end-of-turn token)."""
        if self.config.mode == "caption":
            return self._render_caption(messages)
        if self.has_generation_blocks:
            text, spans = self._render_with_generation_spans(messages)
        else:
            skeleton = self._skeleton(tuple(message["role"] for message in messages))
            filled = skeleton.fill(messages) if skeleton is not None else None
            if filled is not None and self.contents_verbatim:
                text, spans = filled
            else:
                text = self._render(messages)
                if filled is not None and filled[0] == text:
                    spans = filled[1]
                else:
                    spans = self._incremental_spans(messages, text)
        spans = [self._through_eot(text, start, end) for start, end in spans]
        bos = self._bos(text)
        return bos + text, [(start + len(bos), end + len(bos)) for start, end in spans]

    def _bos(self, text: str) -> str:
        return "" if text.startswith(self.bos_text) else self.bos_text

    def _incremental_spans(self, messages, text):
        """Per assistant turn, the characters it adds to ``text`` (the conversation's render)
        after the generation prompt; TextError if the template re-renders earlier turns."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], generation_prompt=True)
            after = text if i == len(messages) - 1 else self._render(messages[:i + 1])
            if not (after.startswith(before) and text.startswith(after)):
                raise TextError("template_mismatch", f"the chat template does not render "
                                f"turn {i} as an extension of the turns before it, so the "
                                "assistant span cannot be located; give a chat_template with "
                                "{% generation %} blocks")
            spans.append((len(before), len(after)))
        return spans

    def _skeleton(self, roles: tuple[str, ...]) -> _Skeleton | None:
        """The skeleton of conversations with these roles (None: the template does not insert
        each content once, or fails on placeholders: every sample renders incrementally)."""
        if roles in self._skeletons:
            return self._skeletons[roles]
        if len(self._skeletons) >= _MAX_SKELETONS:
            self._skeletons.clear()
        self._skeletons[roles] = skeleton = self._build_skeleton(roles)
        return skeleton

    def _build_skeleton(self, roles: tuple[str, ...]) -> _Skeleton | None:
        messages = [{"role": role, "content": _SLOT.format(k)} for k, role in enumerate(roles)]
        try:
            text = self._render(messages)
            spans = self._incremental_spans(messages, text)
        except TextError:
            return None
        pieces = _SLOT_PATTERN.split(text)
        parts, order = tuple(pieces[0::2]), tuple(int(k) for k in pieces[1::2])
        if sorted(order) != list(range(len(roles))):
            return None
        slots = [len(_SLOT.format(k)) for k in order]
        ends = [_part_offset(position, parts, slots) for span in spans for position in span]
        if None in ends:
            return None
        return _Skeleton(parts, order, tuple(zip(ends[0::2], ends[1::2])))

    def _through_eot(self, text: str, start: int, end: int) -> tuple[int, int]:
        # Train up to and including the end-of-turn token; what the template adds after it
        # (a newline before the next turn) is not something the model must generate.
        stop = text.rfind(self.eot, start, end)
        if stop != -1:
            return start, stop + len(self.eot)
        if not self.has_generation_blocks:
            raise TextError("template_mismatch", f"an assistant turn does not end with the "
                            f"end-of-turn token {self.eot!r}: {text[start:end][-60:]!r}")
        # A {% generation %} block holding the assistant's text only: that text, without the
        # template's whitespace around it, and the end-of-turn token right after it if the
        # template writes one there (llava-hf's Qwen template); LLaVA-1.5's writes none (its
        # turns end with a space)
        inner = text[start:end]
        start += len(inner) - len(inner.lstrip())
        end = start + len(inner.strip())
        if text.startswith(self.eot, end):
            end += len(self.eot)
        return start, end

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

    def encode(self, messages: Sequence[Mapping[str, Any]],
               item_tokens: Sequence[ItemTokens]) -> Encoded:
        """Tokens of the conversation with marker i expanded to ``item_tokens[i]``'s ``tokens``
        copies of its modality's token (between its ``wrap`` tokens if it has them, in runs
        after its ``texts`` if it has them); TextError if they cannot be built."""
        encoded = self.encode_batch([(messages, item_tokens)])[0]
        if isinstance(encoded, TextError):
            raise encoded
        return encoded

    def encode_prompt(self, messages: Sequence[Mapping[str, Any]],
                      item_tokens: Sequence[ItemTokens]) -> np.ndarray:
        """Token ids of a conversation for the model to continue (generation): rendered with
        the template's generation prompt (``caption`` mode: the turns joined by newlines, then
        the newline an answer follows), marker i expanded to ``item_tokens[i]`` copies of its
        modality's token as ``encode`` does; TextError if they cannot be built."""
        if self.config.mode == "caption":
            text = self._render_caption(messages)[0] + "\n"
        else:
            text = self._render(messages, generation_prompt=True)
            text = self._bos(text) + text
        tokens = encode_texts(self.backend, [text])
        failed: dict[int, TextError] = {}
        marker_at, counts, modality_tokens, texts = self._markers(tokens, [item_tokens], failed)
        if failed:
            raise failed[0]
        return self._expand(tokens.ids.copy(), None, marker_at, counts, modality_tokens,
                            texts)[0]

    def encode_batch(self, conversations: Sequence[tuple[Sequence[Mapping[str, Any]],
                                                         Sequence[ItemTokens]]]
                     ) -> list[Encoded | TextError]:
        """``encode`` of each (messages, item_tokens), or the TextError of that conversation.

        The texts are tokenized in one call and their markers, masks and expansions computed
        on the concatenated tokens: per-sample numpy calls on a few hundred tokens cost more
        than the work itself."""
        results: list[Encoded | TextError | None] = [None] * len(conversations)
        texts: list[str] = []
        which: list[int] = []
        starts, spans = [0], _Spans()
        for i, (messages, _) in enumerate(conversations):
            try:
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
        marker_at, counts, modality_tokens, run_texts = self._markers(
            tokens, [conversations[i][1] for i in which], failed)
        trained = spans.inside(tokens.offsets, "".join(texts), starts, failed)
        ids, bounds = tokens.ids, tokens.bounds
        if len(marker_at):
            ids, trained, repeats = self._expand(ids, trained, marker_at, counts,
                                                 modality_tokens, run_texts)
            bounds = np.concatenate(([0], np.cumsum(repeats)))[bounds]
        for j, i in enumerate(which):
            a, b = bounds[j], bounds[j + 1]
            results[i] = failed[j] if j in failed else Encoded(ids[a:b], trained[a:b])
        return cast(list[Encoded | TextError], results)   # every slot is filled above

    def _markers(self, tokens: TokenBatch, item_tokens: list[Sequence[ItemTokens]],
                 failed: dict[int, TextError]
                 ) -> tuple[np.ndarray, list[int], list[int], list[tuple[str, ...]]]:
        """Positions of the marker (and modality) tokens, each one's item token count,
        modality token and run texts; texts with a literal modality token or markers that are
        not their items' go to ``failed`` (their markers then keep count 1)."""
        marker_at = np.flatnonzero(self._token_kind[tokens.ids])
        found = tokens.ids[marker_at].tolist()
        cuts = np.searchsorted(marker_at, tokens.bounds).tolist()
        counts, modality_tokens = [1] * len(found), list(found)
        texts: list[tuple[str, ...]] = [()] * len(found)
        for j, items in enumerate(item_tokens):
            a, b = cuts[j], cuts[j + 1]
            if a == b and not items:
                continue
            markers = [self._marker_ids.get(token) for token in found[a:b]]
            expected = [item.modality for item in items]
            if None in markers:
                failed[j] = TextError("literal_special_token", "the text contains a modality "
                                      "token typed literally; remove it from the source text")
            elif markers != expected:
                failed[j] = TextError("template_mismatch", f"the rendered text has markers "
                                      f"{markers}, the sample's media are {expected}")
            else:
                counts[a:b] = [item.tokens for item in items]
                texts[a:b] = [item.texts for item in items]
                modality_tokens[a:b] = [self.modality_token_ids[m] for m in markers]
        return marker_at, counts, modality_tokens, texts


def _added_bos(tokenizer) -> str:
    """The BOS token's text if the tokenizer puts it before every text it encodes, else ""."""
    if tokenizer.bos_token is None:
        return ""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    added = tokenizer("a", add_special_tokens=True)["input_ids"]
    return tokenizer.bos_token if added == [tokenizer.bos_token_id, *plain] else ""


_MARKER_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS.values()) + ")")
_MODALITY_OF = {marker: modality for modality, marker in MARKERS.items()}


def typed_parts(content: str) -> list[dict]:
    """A content as typed parts, in its order: ``{"type": modality}`` per marker and
    ``{"type": "text", "text": ...}`` for the text between markers, stripped of the whitespace
    around it (an image marker, a newline and a question: an image, then the question)."""
    parts: list[dict] = []
    for piece in _MARKER_SPLIT.split(content):
        if piece in _MODALITY_OF:
            parts.append({"type": _MODALITY_OF[piece]})
        elif piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts


def _part_offset(position: int, parts: tuple[str, ...], slots: list[int]):
    """(part, offset) of a skeleton character position; None inside a placeholder."""
    start = 0
    for part, text in enumerate(parts):
        if start <= position <= start + len(text):
            return part, position - start
        start += len(text) + (slots[part] if part < len(slots) else 0)
    return None


class _Spans:
    """The trained character spans of several texts, in the concatenation of the texts."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.texts: list[int] = []

    def add(self, text: int, offset: int, spans: list[tuple[int, int]]) -> None:
        for start, end in spans:
            self.starts.append(offset + start)
            self.ends.append(offset + end)
            self.texts.append(text)

    def inside(self, offsets: np.ndarray, text: str, text_starts: list[int],
               failed: dict[int, TextError]) -> np.ndarray:
        """Per token (character ``offsets`` [N, 2] into ``text``, in text order): inside one of
        the sorted, disjoint spans? Empty tokens never are.

        A token reaching into a span from before it is left untrained when what it covers of
        the span is whitespace (an answer starting with a newline merges with the header's
        newline), and trained when what it covers before the span is whitespace (the answer's
        first word with the space after LLaVA-1.5's ``ASSISTANT:``: the token the model
        predicts there); any other partial overlap makes the mask ambiguous: a TextError in
        ``failed`` for that span's text (``text_starts``: where each text starts).
        """
        if not self.starts or not len(offsets):
            return np.zeros(len(offsets), dtype=bool)
        token_start, token_end = offsets[:, 0], offsets[:, 1]
        starts, ends = np.array(self.starts), np.array(self.ends)
        firsts = np.searchsorted(token_end, starts, side="right")
        stops = np.searchsorted(token_start, ends, side="left")
        last = len(offsets) - 1
        entering = (firsts < stops) & (token_start[np.minimum(firsts, last)] < starts)
        for k in np.flatnonzero(entering).tolist():
            start, end, reach = self.starts[k], self.ends[k], int(token_end[firsts[k]])
            entry = int(token_start[firsts[k]])
            if reach <= end and text[start:reach].isspace():
                firsts[k] += 1
            elif not text[entry:start].isspace():
                self._crossing(k, entry, reach, text, text_starts, failed)
        leaving = (firsts < stops) & (token_end[np.maximum(stops - 1, 0)] > ends)
        for k in np.flatnonzero(leaving).tolist():
            self._crossing(k, int(token_start[stops[k] - 1]), int(token_end[stops[k] - 1]),
                           text, text_starts, failed)
        kept = firsts < stops
        edges = (np.bincount(firsts[kept], minlength=len(offsets) + 1) -
                 np.bincount(stops[kept], minlength=len(offsets) + 1))
        return (np.cumsum(edges[:-1]) > 0) & (token_start < token_end)

    def _crossing(self, k: int, a: int, b: int, text: str, text_starts: list[int],
                  failed: dict[int, TextError]) -> None:
        owner = self.texts[k]
        origin = text_starts[owner]
        failed.setdefault(owner, TextError(
            "template_mismatch", f"token {text[a:b]!r} at characters {a - origin}-{b - origin} "
            f"crosses the edge of a trained span ({self.starts[k] - origin}-"
            f"{self.ends[k] - origin}); the loss mask would be ambiguous"))
