"""Shard sample → training sample: ``input_ids``, ``labels``, ``loss_mask``, ``position_ids``,
per-item modality token counts and (in full mode) encoder inputs.

Token counts come from metadata alone (image size, audio frames), so the metadata-only mode used
on ranks without an encoder builds the same text tensors without reading any media. Full mode
decodes the media and checks that the encoder inputs produce exactly those counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from mimo_data.modalities import MODALITIES, MediaError
from mimo_data.modalities.base import item_name
from mimo_data.preprocess.answer_parts import empty_answer
from mimo_data.preprocess.chat_tokens import Encoded, ItemTokens, TextEncoder, TextError
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.preprocess.positions import mrope_positions, sequential_positions
from mimo_data.preprocess.record_kinds import Rendered, kind_of, trained_wraps
from mimo_data.preprocess.segment_tokenizer import SegmentCacheError
from mimo_data.modalities import MediaItem
from mimo_data.modalities.image import DEFAULT_MAX_IMAGE_PIXELS
from mimo_data.shards.format import ROLES, Message, in_loss
from mimo_data.shards.records import marker_order
from mimo_data.tally import CountedError

# A shard record as read (ShardRecord when valid); malformed ones become counted drops.
Record = Mapping[str, Any]

IGNORE_INDEX = -100
TEXT_BATCH = 256    # records whose text is tokenized and masked together (text_batch)


class SampleDropped(CountedError):
    """A sample that cannot be trained on; ``reason`` is its drop category (counted, not lost)."""


@dataclass
class TextSample:
    """What metadata alone decides of a sample: its tokens and which of them are trained."""
    key: str
    ids: np.ndarray                  # [L + 1] int64, markers expanded (a view: see sample())
    loss_mask: np.ndarray            # [L] bool, for the targets ids[1:]
    token_counts: dict[str, list[int]]            # modality -> tokens per item, in item order
    items: list[MediaItem]           # the media items of the kept turns
    removed_turns: int = 0
    kind: str = "conversation"       # the record's kind (shards/format.py)


@dataclass
class Sample:
    """One training sample (unpadded, length L = tokens - 1 <= seq_length)."""
    key: str
    input_ids: torch.Tensor          # [L] int64
    labels: torch.Tensor             # [L] int64, next-token targets, -100 where not trained
    loss_mask: torch.Tensor          # [L] float32, 1 exactly where labels are trained
    position_ids: torch.Tensor       # [L] int64; M-RoPE: [3, L] (time, height, width)
    token_counts: dict[str, list[int]]            # modality -> tokens per item, in item order
    encoder_inputs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    removed_turns: int = 0           # trailing turns cut by length_policy truncate_turns


@dataclass
class Prompt:
    """A conversation for the model to continue, as ``Preprocessor.prompt`` builds it."""
    input_ids: torch.Tensor          # [L] int64, ending with the generation prompt
    token_counts: dict[str, list[int]]            # modality -> tokens per item, in item order
    encoder_inputs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def media_item(modality: str, data: bytes, index: int) -> MediaItem:
    """The metadata of the ``index``-th ``modality`` item of a sample from its encoded bytes,
    as ``mimo-shard build`` records it (MediaError if it cannot be used)."""
    meta = MODALITIES[modality].probe(data, "decode", DEFAULT_MAX_IMAGE_PIXELS)
    return cast(MediaItem, {"modality": modality, "bytes": len(data),
                            "member": MODALITIES[modality].member(index, meta["format"]),
                            **meta})


class Preprocessor:
    """Turns shard records (+ their media bytes in full mode) into Samples.

    ``with_media``: True decodes every configured modality into encoder inputs, False none
    (metadata-only), or the modalities to decode (an encoder rank decodes only its own).
    Records go through ``text_batch`` many at a time (the text of a batch is tokenized and
    masked in one pass), then ``sample`` one at a time; ``preprocessor(record, media)`` does
    both for one record. Pickles as its config and modalities (a spawned DataLoader worker
    rebuilds the rest).
    """

    def __init__(self, config: PreprocessConfig, *, with_media=True,
                 text: TextEncoder | None = None):
        self.config = config
        self.media_modalities = (frozenset(config.modalities) if with_media is True else
                                 frozenset(with_media or ()))
        unknown = self.media_modalities - set(config.modalities)
        if unknown:
            raise ValueError(f"with_media names {sorted(unknown)}, not configured modalities")
        self.with_media = bool(self.media_modalities)
        self.text = text or TextEncoder(config)
        for name in config.modalities:          # before any worker is forked: shared
            MODALITIES[name].load_libraries()
        tokenizer = self.text.tokenizer
        self._wrap_ids = [tokenizer.convert_tokens_to_ids(token)
                          for m in config.modalities.values() for token in m.wrap]

    def __getstate__(self) -> dict:
        return {"config": self.config, "with_media": self.media_modalities}

    def __setstate__(self, state: dict) -> None:
        Preprocessor.__init__(self, state["config"], with_media=state["with_media"])

    def __call__(self, record: Record, media: dict[str, bytes] | None = None) -> Sample:
        """The Sample of one record (SampleDropped if it cannot be trained on)."""
        text = self.text_batch([record])[0]
        if isinstance(text, SampleDropped):
            raise text
        return self.sample(text, media)

    def text_batch(self, records: Sequence[Record]) -> list[TextSample | SampleDropped]:
        """Per record, its TextSample or why it is dropped; no media are read."""
        results: list = [None] * len(records)
        pending = []
        for i, record in enumerate(records):
            try:
                _check_record(record)
                pending.append((i, [self._item_tokens(item) for item in record["media"]],
                                self.text.kinds.encodable(record)))
            except SampleDropped as exc:
                results[i] = exc.with_traceback(None)     # no frame (and cycle) kept alive
            except _MALFORMED as exc:
                results[i] = _malformed(exc)
        try:
            encoded = self.text.encode_batch([(encodable, counts)
                                              for _, counts, encodable in pending])
        except SegmentCacheError as exc:
            raise _naming_sample(exc, records, pending[exc.index][0]) from None
        for (i, counts, encodable), text in zip(pending, encoded):
            try:
                results[i] = self._text_sample(records[i], counts, text, encodable)
            except SampleDropped as exc:
                results[i] = exc.with_traceback(None)     # no frame (and cycle) kept alive
            except _MALFORMED as exc:
                results[i] = _malformed(exc)
            except SegmentCacheError as exc:    # from a truncate_turns re-encode
                raise _naming_sample(exc, records, i) from None
        return results

    def prompt(self, messages: list[Message], media: Sequence[tuple[MediaItem, bytes]],
               template_options: Mapping[str, Any] | None = None) -> Prompt:
        """A conversation to generate from: its tokens through the generation prompt (rendered
        with ``template_options``, e.g. ``enable_thinking``) with each marker expanded to its
        item's token count, and the encoder inputs of ``media`` (items in marker order, each
        with its bytes), as training builds them; SampleDropped if an item cannot be used,
        TextError if the text cannot be tokenized."""
        counts = [self._item_tokens(item) for item, _ in media]
        ids = self.text.encode_prompt(messages, counts, template_options)
        token_counts = {name: [n for modality, n, _ in counts if modality == name]
                        for name in self.config.modalities}
        inputs = {}
        if media:
            inputs = self._encoder_inputs("prompt", [item for item, _ in media],
                                          {item["member"]: data for item, data in media},
                                          token_counts)
        return Prompt(torch.from_numpy(ids), token_counts, inputs)

    def _text_sample(self, record: Record, counts, encoded: Encoded | TextError,
                     encodable) -> TextSample:
        items, kind = record["media"], kind_of(record)
        # a conversation's (or a chat caption's) messages; a rendered text is never cut
        messages = [] if isinstance(encodable, Rendered) else encodable
        encoded, kept_messages = self._fit(messages, counts, encoded, kind)
        if kind == "document" and self.config.documents.train_media_wraps:
            trained_wraps(encoded.ids, encoded.loss_mask, self._wrap_ids)
        ids, trained = encoded.ids, encoded.loss_mask[1:]
        if self.text.is_modality_token(ids[-1]):
            raise SampleDropped("ends_with_media", "the conversation ends with a media item, "
                                "whose last placeholder the next-token shift would cut; end "
                                "it with an assistant turn")
        removed_turns = len(messages) - len(kept_messages)
        kept_items = items[:len(marker_order(kept_messages))] if removed_turns else items
        if not trained.any():
            raise SampleDropped("no_trained_tokens", "no assistant token to train on"
                                + (f" after removing {removed_turns} turns" if removed_turns
                                   else ""))
        answers = [turn for turn, m in enumerate(kept_messages) if in_loss(m)]
        # what of each the template writes (an answer that is reasoning alone may be nothing)
        written = self.text.answer_parts.written(kept_messages)
        if answers and all(empty_answer(kept_messages[turn], written, turn)
                           for turn in answers):
            # the template's end of turn would be all it trains: to answer with nothing
            everyone = sum(m["role"] == "assistant" for m in kept_messages)
            raise SampleDropped("empty_answers", f"every trained answer ({len(answers)} of "
                                f"{everyone}) is empty"
                                + (" or reasoning the chat template leaves out" if written
                                   else "")
                                + (f" after removing {removed_turns} turns" if removed_turns
                                   else "") + ": write the answers or leave the record out")
        token_counts = {name: [n for (modality, n, _), _ in zip(counts, kept_items)
                               if modality == name] for name in self.config.modalities}
        return TextSample(record["key"], ids, trained, token_counts, kept_items, removed_turns,
                          kind)

    def sample(self, text: TextSample, media: dict[str, bytes] | None = None) -> Sample:
        """The tensors of a TextSample, with its encoder inputs decoded from ``media`` (the
        sample's member bytes) in full mode; SampleDropped if a media item cannot be used."""
        ids, trained = text.ids, text.loss_mask
        # numpy until here: a torch op on a short tensor costs more than the numpy one. Every
        # tensor is the sample's own (ids are a view into the text batch's array): a Sample
        # pickled or kept alone holds no other sample's tokens.
        sample = Sample(key=text.key, input_ids=torch.from_numpy(ids[:-1].copy()),
                        labels=torch.from_numpy(np.where(trained, ids[1:], IGNORE_INDEX)),
                        loss_mask=torch.from_numpy(trained.astype(np.float32)),
                        position_ids=torch.from_numpy(self._positions(ids[:-1], text)),
                        token_counts=text.token_counts, removed_turns=text.removed_turns)
        decoded = [item for item in text.items if item["modality"] in self.media_modalities]
        if decoded:
            if media is None:
                raise ValueError("full-mode preprocessing needs the sample's media bytes")
            sample.encoder_inputs = self._encoder_inputs(text.key, decoded, media,
                                                         text.token_counts)
        return sample

    def _positions(self, ids: np.ndarray, text: TextSample) -> np.ndarray:
        """``[L]`` sequential or ``[3, L]`` M-RoPE position ids of the input ``ids``."""
        if self.config.positions == "sequential":
            return sequential_positions(len(ids))
        seen = dict.fromkeys(text.token_counts, 0)
        items: list[tuple[int, int, tuple[int, int, int] | None, float]] = []
        for item in text.items:
            name = item["modality"]
            modality, config = MODALITIES[name], self.config.modalities[name]
            token, count = self.text.modality_token_ids[name], text.token_counts[name][seen[name]]
            grid = modality.token_grid(item, config)
            runs = len(modality.placeholder_texts(item, config))
            if runs and grid is not None:      # each time slice on its own, as an image
                t, h, w = grid
                items += [(token, h * w, (1, h, w), 1.0)] * t
            else:
                items.append((token, count, grid, modality.time_interval(item, config)))
            seen[name] += 1
        return mrope_positions(ids, items)

    def _item_tokens(self, item: MediaItem) -> ItemTokens:
        """Tokens of one media item from its metadata alone (SampleDropped if unusable)."""
        modality = item["modality"]
        config = self.config.modalities.get(modality)
        if config is None:
            raise SampleDropped("unconfigured_modality", f"the sample has {modality} but the "
                                f"config has no modalities.{modality}")
        kind = MODALITIES[modality]
        try:
            return ItemTokens(modality, kind.item_tokens(item, config),
                              kind.placeholder_texts(item, config))
        except MediaError as exc:
            raise SampleDropped(exc.reason, exc.detail) from None

    def _fit(self, messages: list[Message], counts, encoded: Encoded | TextError, kind: str
             ) -> tuple[Encoded, list[Message]]:
        """The conversation's tokens (``encoded``) within seq_length (+1 for the shifted
        target), removing trailing turns if the length policy allows; never cuts inside a turn
        or a media span. A plain caption or a document (no ``messages``) is never cut: a
        document is kept whole or dropped as ``too_long``."""
        limit = self.config.seq_length + 1
        encoded = _dropped_if_error(encoded)
        if len(encoded.ids) <= limit:
            return encoded, messages
        shortest = len(encoded.ids) - 1     # the shortest prefix tried, ending on an answer
        if self.config.length_policy == "truncate_turns" and messages:
            for end in range(len(messages) - 1, 0, -1):
                if not in_loss(messages[end - 1]):      # a kept prefix ends on a trained answer
                    continue
                kept = messages[:end]
                shorter = _dropped_if_error(self.text.encode_batch(
                    [(kept, counts[:len(marker_order(kept))])])[0])
                if len(shorter.ids) <= limit:
                    return shorter, kept
                shortest = len(shorter.ids) - 1
        # a video's share: its placeholders, wraps and (Qwen3-VL) timestamps; the images'
        clips = [item for item in counts if item.modality == "video"]
        videos = sum(self.text.span(item) for item in clips)
        placeholders = sum(item.tokens for item in clips)
        images = sum(self.text.span(item) for item in counts if item.modality == "image")
        raise SampleDropped("too_long", f"{len(encoded.ids) - 1} tokens, above seq_length "
                            f"{self.config.seq_length}" +
                            (" (a document is never cut: split it, or raise seq_length)"
                             if kind == "document" else
                             f" even with only its first turns ({shortest} tokens up to its "
                             "first trained answer)" if messages and
                             self.config.length_policy == "truncate_turns" else "") +
                            (f"; {videos} of them its videos': "
                             f"{self._video_advice(videos - placeholders, placeholders)}, or "
                             "raise seq_length" if 2 * videos > self.config.seq_length else "") +
                            (f"; {images} of them its images': {self._image_advice()}, or raise "
                             "seq_length" if 2 * images > self.config.seq_length else ""))

    def _image_advice(self) -> str:
        """What lowers an image's tokens, with the config's values: its pixel budget where
        images keep their own size (dynamic), else fewer images a sample."""
        image = self.config.modalities["image"]
        if image.policy == "dynamic":
            return (f"lower modalities.image max_pixels ({image.max_pixels}; min_pixels "
                    f"{image.min_pixels} is each image's floor) for fewer tokens an image")
        return "give fewer images a sample (each is its fixed count of tokens)"

    def _video_advice(self, texts: int, placeholders: int) -> str:
        """What lowers a clip's tokens, with the config's values: its frames (fps, max_frames)
        and each frame's (max_pixels, floored by min_pixels), or a cap on them all. Where the
        clips' ``texts`` (Qwen3-VL's timestamps and wraps, a run per temporal patch) outweigh
        their ``placeholders``, fewer frames alone lowers them: said first, pixels not."""
        video = self.config.modalities["video"]
        frames = (f"lower modalities.video fps ({video.fps:g}: a clip recorded at fewer frames "
                  f"a second keeps its own) or max_frames ({video.max_frames}) for fewer frames")
        if texts > placeholders:
            return (f"{placeholders} placeholders and {texts} timestamp and wrap tokens (a run "
                    f"of them every {video.temporal_patch_size} "
                    f"frames, whatever a frame's pixels): {frames}")
        return (f"{frames}, max_pixels ({video.max_pixels}) and min_pixels ({video.min_pixels}, "
                "the floor of each frame) for fewer tokens a frame, or cap the clip "
                "(cap_pixels_per_frame with max_video_tokens)")

    def _encoder_inputs(self, key, items, media, token_counts) -> dict:
        decoded: dict[str, list] = {}
        for item in items:
            name = item["modality"]
            try:
                value = MODALITIES[name].decode(media[item["member"]], item,
                                                self.config.modalities[name])
            except MediaError as exc:
                raise SampleDropped(exc.reason, f"{item_name(item)}: {exc.detail}") from None
            except Exception as exc:  # decoder errors of any kind: count the sample, go on
                raise SampleDropped("corrupt_media", f"{item_name(item)}: {exc}") from None
            decoded.setdefault(name, []).append(value)
        inputs = {}
        for name, values in decoded.items():
            modality, config = MODALITIES[name], self.config.modalities[name]
            inputs[name] = modality.encoder_inputs(values, config)
            rows = modality.rows_to_tokens(inputs[name], config)
            if rows != token_counts[name]:
                raise RuntimeError(f"sample {key}: the {name} encoder inputs give {rows} "
                                   f"tokens per item but the text has {token_counts[name]} "
                                   "placeholders; this is a bug in mimo, please report it")
        return inputs



# What a record with a missing or mistyped field raises past _check_record's checks.
_MALFORMED = (KeyError, TypeError, AttributeError, IndexError)


def _malformed(exc: Exception) -> SampleDropped:
    return SampleDropped("malformed_record", f"{type(exc).__name__}: {exc}")


def _naming_sample(exc: SegmentCacheError, records: Sequence[Record], i: int
                   ) -> SegmentCacheError:
    return SegmentCacheError(i, f"sample {records[i]['key']}: {exc}")


def _dropped_if_error(encoded: Encoded | TextError) -> Encoded:
    if isinstance(encoded, TextError):
        raise SampleDropped(encoded.reason, encoded.detail)
    return encoded


def _check_record(record) -> None:
    """SampleDropped("malformed_record") unless ``record`` has the shard JSON's fields (a record
    written by another tool or edited by hand must not crash a worker)."""
    try:
        problems = [] if isinstance(record["key"], str) else ["key is not a string"]
        kind = kind_of(record)
        if kind != "conversation" and not isinstance(record["text"], str):
            problems.append(f"the {kind}'s text is not a string")
        if kind == "caption" and len(record["media"]) != 1:
            problems.append(f"a caption has exactly one media item, this one "
                            f"{len(record['media'])}")
        for message in record["messages"] if kind == "conversation" else ():
            if not (isinstance(message["content"], str) and
                    message["role"] in ROLES):
                problems.append(f"bad message {str(message)[:60]}")
            elif "weight" in message and (message["weight"] != 0 or
                                          isinstance(message["weight"], bool)):
                problems.append(f"a message's weight {message['weight']!r}: a shard "
                                "message's weight is 0 where it has one (out of the loss)")
            elif "tools" in message and message is not record["messages"][0]:
                problems.append("tools on a message other than the first (a shard holds a "
                                "conversation's tools on its first message)")
            elif "tool_calls" in message and not all(
                    isinstance(call, dict) and isinstance(call.get("function"), dict)
                    and isinstance(call["function"].get("name"), str)
                    and isinstance(call["function"].get("arguments"), dict)
                    for call in message["tool_calls"] or ()):
                problems.append("a tool call that is not {\"type\": \"function\", "
                                "\"function\": {\"name\": ..., \"arguments\": {...}}}")
        for item in record["media"]:
            missing = [f for f in MODALITIES[item["modality"]].item_fields if f not in item]
            if missing:
                problems.append(f"media item {item.get('member')} lacks {missing}")
    except (KeyError, TypeError) as exc:
        problems = [f"missing or mistyped field {exc}"]
    except ValueError as exc:       # an unknown kind
        problems = [str(exc)]
    if problems:
        raise SampleDropped("malformed_record", "; ".join(problems))


def preprocess_dataset(reader, preprocessor: Preprocessor, tally, positions=None):
    """Samples of a ShardReader in order (or at ``positions``); drops are counted in ``tally``
    (a report.Tally) by reason with the sample key, never lost silently."""
    positions = list(range(len(reader)) if positions is None else positions)
    for chunk in range(0, len(positions), TEXT_BATCH):
        batch = positions[chunk:chunk + TEXT_BATCH]
        records = [reader.record(position) for position in batch]
        for position, record, text in zip(batch, records, preprocessor.text_batch(records)):
            try:
                if isinstance(text, SampleDropped):
                    raise text
                sample = preprocessor.sample(text, reader.media(
                    position, record, preprocessor.media_modalities)
                    if preprocessor.with_media else None)
            except SampleDropped as exc:
                tally.skip(exc.reason, record["key"], exc.detail)
                continue
            tally.keep()
            yield sample
