"""Per-sample facts for ``mimo-inspect``, computed by the training code path without media.

Each record goes through the metadata-only ``Preprocessor`` (what language ranks run), so a
sample's length, trained tokens, truncation and drop reason are exactly what training gets.
Around that, checks that do not trust the preprocessor:

- markers vs media: the ``<image>``/``<audio>`` markers of the messages, in reading order,
  against the record's media list (a JSON edited by hand or written by another tool may
  disagree; the preprocessor then drops the sample as ``template_mismatch``);
- placeholders vs metadata: the modality tokens actually in ``input_ids`` against the counts
  computed here from each kept item's metadata with ``token_counts`` (what the encoder emits);
- record vs index: the record's media against ``samples.parquet`` (member present in the tar,
  each modality's summary fields: image size, audio duration, video size and duration), the
  table the loader trusts for counts and offsets;
- loss mask vs roles: each kept message's content located in the decoded tokens (not through
  the preprocessor's spans), after the template's text before it (its role header: a
  one-letter answer ``t`` is not the ``t`` of ``<|im_start|>``): an assistant content
  character that is not trained, or a user or system one (or one of an answer weighted 0)
  that is, counts (whitespace aside).
  A template whose ``{% generation %}`` blocks leave out the answers, or wrap user turns,
  fails here. Of an answer with think tags, the parts the template writes (read from a render
  of stand-ins: Qwen3.5's leaves earlier answers' reasoning out, DeepSeek-R1's every answer's)
  are judged apart; reasoning left out where later answers keep theirs is counted apart.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq

from mimo_data.preprocess.answer_parts import (PARTS, REASONING, THINK_END, THINK_START,
                                               UNTAKEN, Written, empty_answer, split_reasoning,
                                               unclosed_think, written_parts)
from mimo_data.preprocess.chat_tokens import TextEncoder, TextError
from mimo_data.preprocess.preprocessor import (Preprocessor, Record, Sample, SampleDropped,
                                               TextSample)
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.modalities import MARKERS, MODALITIES
from mimo_data.shards.index import read_samples
from mimo_data.shards.format import SAMPLES_FILE, in_loss, summary_column

_MARKER = re.compile("|".join(map(re.escape, MARKERS.values())))
_MODALITY_OF = {marker: modality for modality, marker in MARKERS.items()}

# Drop reasons that mean "the chat template could not be rendered / round-tripped".
TEMPLATE_REASONS = ("template_mismatch", "template_error")


@dataclass
class SampleStats:
    """What one sample becomes in training, and what is wrong with it."""
    position: int
    key: str
    dropped: str | None = None            # SampleDropped reason
    detail: str = ""
    length: int = 0                       # tokens in input_ids (0 when dropped)
    trained: int = 0                      # tokens with loss_mask 1
    removed_turns: int = 0
    empty_answers: int = 0                # kept answers without text: their end of turn alone
    reasoning_dropped: int = 0            # answers whose reasoning the template leaves out
    unclosed_think: int = 0               # trained answers with a <think> never closed
    trailing_turns: int = 0               # turns after the last answer (a user's, a tool's)
    kind: str = "conversation"            # the record's kind (shards/format.py)
    placeholders: dict[str, int] = field(default_factory=dict)   # modality tokens in input_ids
    # per kept item, from metadata (None: not computable)
    expected: dict[str, list[int | None]] = field(default_factory=dict)
    counted: dict[str, list[int]] = field(default_factory=dict)   # the preprocessor's counts
    markers: list[str] = field(default_factory=list)    # marker modalities in reading order
    media: list[str] = field(default_factory=list)      # media item modalities in list order
    index_problems: list[str] = field(default_factory=list)
    assistant_chars_not_trained: int = 0  # non-whitespace content characters, kept turns
    other_chars_trained: int = 0          # of user/system contents
    coverage_problems: list[str] = field(default_factory=list)   # one line per turn at fault

    @property
    def marker_mismatch(self) -> bool:
        return self.markers != self.media

    @property
    def placeholder_mismatch(self) -> bool:
        return self.dropped is None and any(
            None in counts or self.placeholders.get(m, 0) != sum(c or 0 for c in counts)
            or self.counted.get(m) != counts for m, counts in self.expected.items())

    @property
    def coverage_failure(self) -> bool:
        return bool(self.assistant_chars_not_trained or self.other_chars_trained)

    @property
    def template_failure(self) -> bool:
        """A template drop that the markers/media disagreement does not explain."""
        return self.dropped in TEMPLATE_REASONS and not self.marker_mismatch

    def describe_markers(self) -> str:
        modalities = sorted(set(self.markers + self.media))

        def count(kinds):
            return ", ".join(f"{kinds.count(m)} {m}" for m in modalities)
        return f"markers in the text: {count(self.markers)}; media items: {count(self.media)}"

    def describe_placeholders(self) -> str:
        return "; ".join(f"{m}: {self.placeholders.get(m, 0)} placeholder tokens in input_ids, "
                         f"the preprocessor counts {self.counted.get(m)}, the metadata gives "
                         f"{counts}" for m, counts in self.expected.items()
                         if None in counts
                         or self.placeholders.get(m, 0) != sum(c or 0 for c in counts)
                         or self.counted.get(m) != counts)


def markers_of(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Modalities of the media markers (``<image>``, ``<video>`` ...) in reading order (as
    ``records.marker_order``, with one regex scan per message)."""
    return [_MODALITY_OF[m] for message in messages if isinstance(message, dict)
            for m in _MARKER.findall(str(message.get("content", "")))]


def expected_item_tokens(item: Mapping[str, Any], config: PreprocessConfig) -> int | None:
    """Tokens the encoder emits for a media item, from its metadata (None: not computable)."""
    try:
        return MODALITIES[item["modality"]].tokens(item, config.modalities[item["modality"]])
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        return None


class IndexTable:
    """The per-sample columns of ``samples.parquet`` the record is checked against: its
    members, and each modality's summary fields (``Modality.summary_fields``: image size,
    audio duration, ...) where the table has them (a dataset built before a modality has
    not). Held as Arrow arrays, read row by row."""

    def __init__(self, directory: str):
        present = set(read_samples(directory, lambda path: pq.read_schema(path).names))
        self.fields = {name: [field for field in modality.summary_fields
                              if summary_column(name, field) in present]
                       for name, modality in MODALITIES.items()}
        table = read_samples(directory, lambda path: pq.ParquetFile(path).read(columns=[
            "members", *(summary_column(name, field) for name, fields in self.fields.items()
                         for field in fields)]))
        # Member names flat with each row's bounds: no object per member or row.
        members = table.column("members").combine_chunks()
        self.names = members.flatten().field("name")
        self.bounds = np.asarray(members.offsets) - members.offsets[0].as_py()
        self.columns = {column: table.column(column).combine_chunks()
                        for column in table.column_names if column != "members"}

    def problems(self, position: int, record: Record) -> list[str]:
        """How the record's media list disagrees with its row of the table."""
        members = set(self.names[self.bounds[position]:self.bounds[position + 1]].to_pylist())
        media = record.get("media") or []
        found = [f"media member {item.get('member')!r} is not in the shard" for item in media
                 if item.get("member") not in members]
        for name, fields in self.fields.items():
            if not fields:
                continue
            items = [item for item in media if item.get("modality") == name]
            recorded = [tuple(item.get(field) for field in fields) for item in items]
            indexed = list(zip(*(self.columns[summary_column(name, field)][position].as_py()
                                 or [] for field in fields)))
            if recorded != indexed:
                found.append(f"{name} {'/'.join(fields)} {recorded} in the record, {indexed} "
                             f"in {SAMPLES_FILE}")
        return found


class SampleInspector:
    """Record → (SampleStats, Sample or None), metadata-only, on the training code path."""

    def __init__(self, config: PreprocessConfig, *, text: TextEncoder | None = None,
                 cache_tokens: bool = True):
        self.config = config
        self.text = text or TextEncoder(config, cache_tokens=cache_tokens)
        self.preprocessor = Preprocessor(config, with_media=False, text=self.text)
        self.token_ids = self.text.modality_token_ids
        # Token id -> 1 + index of its modality in token_ids, 0 for text: one bincount counts
        # every modality's placeholders.
        self._modality_of_token = np.zeros(
            self.text.backend.get_vocab_size(with_added_tokens=True) + 1, dtype=np.int64)
        for number, token_id in enumerate(self.token_ids.values(), 1):
            self._modality_of_token[token_id] = number
        self._item_tokens: dict[tuple, int | None] = {}    # metadata -> tokens, memoized
        self._headers: dict[tuple, tuple[str, ...] | None] = {}   # roles -> headers
        self._decoder = self.text.tokenizer.backend_tokenizer
        # a medium's run in the decoded text, ending at its own wrap token
        self._item = _item([m.wrap[1] for m in config.modalities.values() if m.wrap])
        self._media_run = re.compile(self._item)

    def item_tokens(self, item: Mapping[str, Any]) -> int | None:
        """``expected_item_tokens`` memoized on the metadata it depends on."""
        modality = MODALITIES.get(item.get("modality"))      # type: ignore[arg-type]
        signature = (item.get("modality"), *(item.get(name) for name in modality.item_fields
                                             if name != "member")) if modality else ()
        if signature not in self._item_tokens:
            self._item_tokens[signature] = expected_item_tokens(item, self.config)
        return self._item_tokens[signature]

    def __call__(self, position: int, record: Record,
                 index: IndexTable | None = None) -> tuple[SampleStats, Sample | None]:
        """The stats of one sample, and its Sample unless dropped."""
        text = self.preprocessor.text_batch([record])[0]
        stats = self.stats(position, record, text, index)
        return stats, None if isinstance(text, SampleDropped) else self.preprocessor.sample(text)

    def batch(self, positions: list[int], records: list[Record],
              index: IndexTable | None = None) -> list[SampleStats]:
        """The stats of several samples, their text prepared together (``text_batch``)."""
        return [self.stats(position, record, text, index) for position, record, text in
                zip(positions, records, self.preprocessor.text_batch(records))]

    def stats(self, position: int, record: Record, text: TextSample | SampleDropped,
              index: IndexTable | None = None) -> SampleStats:
        """SampleStats of a record from what the preprocessor made of it."""
        media = record.get("media") or []
        stats = SampleStats(position, record.get("key", f"#{position}"),
                            kind=str(record.get("kind", "conversation")),
                            markers=self._markers(record),
                            media=[item.get("modality") for item in media],
                            index_problems=index.problems(position, record) if index else [])
        if isinstance(text, SampleDropped):
            stats.dropped, stats.detail = text.reason, text.detail
            return stats
        ids = text.ids[:-1]
        stats.length = len(ids)
        stats.trained = int(np.count_nonzero(text.loss_mask))
        stats.removed_turns = text.removed_turns
        placeholders = np.bincount(self._modality_of_token[ids], minlength=len(self.token_ids) + 1)
        stats.placeholders = dict(zip(self.token_ids, placeholders[1:].tolist()))
        stats.expected = {m: [self.item_tokens(item) for item in text.items
                              if item["modality"] == m] for m in self.config.modalities}
        stats.counted = text.token_counts
        messages = self.text.kinds.roles(record)
        kept = messages[:len(messages) - text.removed_turns]
        # a document's pieces are one text, no turns: nothing of a template between them
        document = stats.kind == "document"
        written = None if document else self.text.answer_parts.written(kept)
        stats.empty_answers = sum(in_loss(message) and empty_answer(message, written, turn)
                                  for turn, message in enumerate(kept))
        stats.unclosed_think = 0 if document else sum(
            in_loss(message) and unclosed_think(message) for message in kept)
        roles = [message.get("role") for message in kept]
        stats.trailing_turns = 0 if document or "assistant" not in roles else \
            roles[::-1].index("assistant")
        headers = None if document else self.headers(
            tuple(str(message.get("role")) for message in kept))
        self.coverage(stats, kept, text.ids, np.concatenate(([False], text.loss_mask)),
                      written, headers)
        return stats

    def headers(self, roles: tuple[str, ...]) -> tuple[str, ...] | None:
        """Per message of a conversation with these roles, the template's text before its
        content (the end of the turn before, the role header), stripped; None when a render
        with stand-in contents does not hold each content once, in order. Memoized."""
        if roles not in self._headers:
            if len(self._headers) >= _MAX_SHAPES:
                self._headers.clear()
            stand_ins = [{"role": role, "content": _STAND_IN.format(k)}
                         for k, role in enumerate(roles)]
            try:
                pieces = _STAND_INS.split(self.text.render(stand_ins)[0])
            except TextError:   # a template that refuses them: contents searched from the cursor
                pieces = []
            in_order = pieces[1::2] == [str(k) for k in range(len(roles))]
            self._headers[roles] = (tuple(piece.strip() for piece in pieces[0:-1:2])
                                    if in_order else None)
        return self._headers[roles]

    def _markers(self, record: Record) -> list[str]:
        """The record's markers in reading order: its messages', its document's, or the one a
        caption is rendered with (with any typed in the caption)."""
        kind = record.get("kind", "conversation")
        try:
            if kind == "caption":
                return markers_of(list(self.text.kinds.roles(record)))
            if kind == "document":
                return markers_of([{"content": record.get("text")}])
        except (KeyError, TypeError, ValueError, IndexError):  # malformed: dropped, counted
            return []
        return markers_of(record.get("messages") or [])

    def coverage(self, stats: SampleStats, messages: Sequence[Mapping[str, Any]],
                 ids: np.ndarray, trained: np.ndarray,
                 written: Written | None = None,
                 headers: Sequence[str] | None = None) -> None:
        """Fill the loss-mask-vs-roles facts of ``stats`` from the tokens ``ids`` (all of
        them, the last target included) and which are trained: decode them in runs of one
        class, find each message's content in that text, in order, after its ``headers``
        entry (the template's text before it) where that is found, and count its characters
        in runs of the wrong class (``written``: ``AnswerParts.written(messages)``)."""
        kind = trained.astype(np.int8)
        kind[self._modality_of_token[ids] > 0] = 2          # placeholders: neither
        bounds = [0, *(np.flatnonzero(np.diff(kind)) + 1).tolist(), len(ids)]
        kinds = kind[bounds[:-1]].tolist()
        decoded = iter(self._decoder.decode_batch(
            [ids[a:b].tolist() for a, b, k in zip(bounds, bounds[1:], kinds) if k != 2],
            skip_special_tokens=False))
        pieces = [next(decoded) if k != 2 else _PLACEHOLDER for k in kinds]
        starts = [0]
        for piece in pieces:
            starts.append(starts[-1] + len(piece))
        text, cursor = "".join(pieces), 0
        media = [run.span() for run in self._media_run.finditer(text)]   # with their wraps
        # the first token is no one's target: a document's first word is never trained
        first = len(self._decoder.decode(ids[:1].tolist(), skip_special_tokens=False)
                    ) if kinds and kinds[0] != 2 else 0
        # whether the template writes some answer's reasoning (Qwen3.5's: the last answers')
        # or none (DeepSeek-R1's: the text after the last </think> alone)
        reasons = written is not None and any(REASONING in kept for kept in written.values())
        for turn, message in enumerate(messages):
            role = str(message.get("role"))
            content = _PLACEHOLDERS.sub(_PLACEHOLDER, _MARKER.sub(
                _PLACEHOLDER, str(message.get("content", "")))).strip()
            names = _call_words(message)
            if not content.replace(_PLACEHOLDER, "").strip() and not names:
                continue
            header = _locate(text, headers[turn], cursor, media, self._item) \
                if headers and headers[turn] else None
            kept = written.get(turn) if written else None
            if kept is not None and in_loss(message) and THINK_END in content:
                self._unwritten(stats, turn, content, kept, reasons)
            for piece in written_parts(content, written, turn):
                if not piece.replace(_PLACEHOLDER, "").strip():
                    continue
                found = (header and _locate(text, piece, max(header[1], cursor), media,
                                            self._item)) or \
                    _locate(text, piece, cursor, media, self._item)
                cursor = self._judge(stats, turn, role, in_loss(message), piece, found,
                                     text, pieces, starts, kinds, first) or cursor
            wrong, total = 0, 0      # the calls' words: one count, one problem a turn
            for word in names:
                found = _locate(text, word, cursor, media, self._item)
                total += _visible(word)
                if found is None:
                    wrong += _visible(word)
                    continue
                wrong += _wrong_chars(found, not in_loss(message), text, pieces, starts,
                                      kinds, first)
                cursor = found[1]
            if wrong:
                if in_loss(message):
                    stats.assistant_chars_not_trained += wrong
                else:
                    stats.other_chars_trained += wrong
                stats.coverage_problems.append(
                    f"turn {turn} ({role if in_loss(message) else 'assistant, weight 0'}): "
                    f"{wrong} of {total} characters of its tool calls (names, argument names "
                    "and string values) " + ("not trained" if in_loss(message) else "trained"))

    @staticmethod
    def _unwritten(stats: SampleStats, turn: int, content: str, kept: frozenset[str],
                   reasons: bool) -> None:
        """Count what of a trained answer with think tags the template leaves out: its
        reasoning, where the template writes other answers' (``reasons``; Qwen3.5's, as at
        inference), is reasoning dropped; where it writes no answer's, and text it keeps in no
        piece, are characters not trained."""
        split = split_reasoning(content)
        lost = " ".join(text for part, text in zip(PARTS, split)
                        if part in UNTAKEN and part not in kept)
        if count := _visible(lost.replace(THINK_START, " ")):
            stats.assistant_chars_not_trained += count
            stats.coverage_problems.append(
                f"turn {turn} (assistant): {count} characters before its last <think> or "
                "between its </think> tags are not in the tokens (the chat template writes "
                "neither)")
        reasoning = split[PARTS.index(REASONING)]
        if REASONING in kept or not reasoning:
            return
        if reasons:
            stats.reasoning_dropped += 1
            return
        count = _visible(reasoning)
        stats.assistant_chars_not_trained += count
        stats.coverage_problems.append(
            f"turn {turn} (assistant): its reasoning ({count} characters) is not in the tokens "
            "(the chat template writes no answer's reasoning, only the text after the last "
            "</think>: give a template that writes the reasoning, or data without it)")

    @staticmethod
    def _judge(stats: SampleStats, turn: int, role: str, trained: bool, content: str,
               found: Found | None, text: str, pieces: list[str], starts: list[int],
               kinds: list[int], first: int) -> int | None:
        """Count a content's characters in runs of the wrong class (``found``: where it is in
        ``text``, None where it is not; ``trained``: whether the content is in the loss);
        where it ends in ``text``, or None."""
        wrong = 0 if trained else 1             # the class its characters must not be
        if not trained and role == "assistant":
            role = "assistant, weight 0"
        if found is None:
            if trained:
                count = _visible(content)
                stats.assistant_chars_not_trained += count
                stats.coverage_problems.append(f"turn {turn} (assistant): its content "
                                               f"({count} characters) is not in the tokens")
            return None
        count = _wrong_chars(found, wrong == 1, text, pieces, starts, kinds, first)
        if count:
            if trained:
                stats.assistant_chars_not_trained += count
            else:
                stats.other_chars_trained += count
            stats.coverage_problems.append(
                f"turn {turn} ({role}): {count} of {_visible(content)} content characters "
                + ("not trained" if trained else "trained"))
        return found[1]


# A media item's placeholder tokens in the decoded text, and its marker in a content.
_PLACEHOLDER = "\x00"
_PLACEHOLDERS = re.compile("\x00+")
# Message k's content in a render that finds the template's headers (private-use code points).
_STAND_IN = "\ue000{}\ue001"
_STAND_INS = re.compile("\ue000([0-9]+)\ue001")
_MAX_SHAPES = 256      # conversation shapes (roles) whose headers are kept


def _wrong_chars(found: Found, trained_is_wrong: bool, text: str, pieces: list[str],
                 starts: list[int], kinds: list[int], first: int) -> int:
    """Visible characters of ``text[found]`` in runs of the wrong class (trained ones where
    ``trained_is_wrong``, else untrained ones, the first token no one's target), those of
    its media's runs (``found.media``: the tokens around their placeholders) not counted."""
    inner = sum(_wrong_chars(Found(*span), trained_is_wrong, text, pieces, starts, kinds,
                             first) for span in found.media)
    a, b = found.start, found.end
    wrong, count = int(trained_is_wrong), -inner
    for k in range(bisect.bisect_right(starts, a) - 1, len(pieces)):
        if starts[k] >= b:
            break
        if kinds[k] == wrong:
            count += _visible(text[max(a, starts[k], first if wrong == 0 else 0):
                                   min(b, starts[k + 1])])
    return count


def _call_words(message: Mapping[str, Any]) -> list[str]:
    """What of an answer's calls must be found trained after its content, in order, whatever
    the form the template writes them in (JSON, XML): each function's name, its arguments'
    names and string values, those that no form escapes."""
    words = []
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        words += [function.get("name"), *(
            word for key, value in (arguments.items() if isinstance(arguments, Mapping) else ())
            for word in (key, value))]
    return [word for word in words if isinstance(word, str) and word.strip()
            and not _ESCAPED.search(word)]


# characters JSON writes escaped: a value holding one is not found as it is
_ESCAPED = re.compile(r'["\\\x00-\x1f]')


def _visible(text: str) -> int:
    """Characters that are neither whitespace nor placeholders."""
    return sum(len(word) for word in text.split()) - text.count(_PLACEHOLDER)


class Found(NamedTuple):
    """Where a content is in the decoded text: [start, end), and the spans of its media's
    runs there (their placeholders with the tokens written around them, ``_item``)."""
    start: int
    end: int
    media: tuple[tuple[int, int], ...] = ()


def _locate(text: str, content: str, start: int, media: Sequence[tuple[int, int]],
            item: str) -> Found | None:
    """Where ``content`` is in ``text`` from ``start``; whitespace may differ (tokenizers that
    do not decode it back exactly), and a medium's placeholder may stand between the tokens
    the template writes around it (``item``: ``_item``'s pattern of one); None when absent. A
    match begun inside one of the ``media`` runs (its wrap tokens: a caption "end" in
    <|vision_end|>) is none: the text is searched again after the run."""
    while (found := _find(text, content, start, item)) is not None:
        run = next((end for begin, end in media if begin < found.start < end), None)
        if run is None:
            return found
        start = run
    return None


def _find(text: str, content: str, start: int, item: str) -> Found | None:
    """``_locate``'s first match, wherever it begins."""
    found = text.find(content, start)
    if found >= 0:
        return Found(found, found + len(content))
    match = re.compile(r"\s*".join(
        re.escape(word).replace(re.escape(_PLACEHOLDER), f"({item})")
        for word in content.split())).search(text, start)
    return Found(*match.span(), tuple(match.span(g) for g in range(1, len(match.groups()) + 1))
                 ) if match else None


# A medium's placeholders in the decoded text with the tokens written around them: its wrap
# tokens (<|vision_start|> ... <|vision_end|>, <img> ... </img>), a video's frames each with
# its timestamp (Qwen3-VL's <0.5 seconds>): a content holding a marker is found there too.
# Whole runs only, never given back (possessive, and not begun inside one): a content not in
# the text would otherwise try every split of every video's frames between its markers
_WRAP = r"(?:<[^<>\x00\n]{1,40}>)*+"


def _item(ends: Sequence[str] = ()) -> str:
    """The pattern of a medium's run: its placeholders with the tokens before and between
    them, and after the last one, where the modalities' wrap ``ends`` are known, one of them
    alone (not a template's end of turn written next: <|vision_end|><|im_end|>), else any."""
    after = f"(?:{'|'.join(map(re.escape, ends))})?" if ends else _WRAP
    return rf"(?<![>\x00]){_WRAP}\x00(?:{_WRAP}\x00)*+{after}"
