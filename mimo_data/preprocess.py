"""Shard sample → training sample: ``input_ids``, ``labels``, ``loss_mask``, ``position_ids``,
per-item modality token counts and (in full mode) encoder inputs.

Token counts come from metadata alone (image size, audio frames), so the metadata-only mode used
on ranks without an encoder builds the same text tensors without reading any media. Full mode
decodes the media and checks that the encoder inputs produce exactly those counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mimo_data.audio_inputs import (MIN_AUDIO_SAMPLES, audio_encoder_inputs, audio_rows_to_tokens,
                                    decode_audio)
from mimo_data.chat_tokens import Encoded, TextEncoder, TextError
from mimo_data.image_inputs import decode_image, image_encoder_inputs, image_rows_to_tokens
from mimo_data.media import MediaError
from mimo_data.preprocess_config import PreprocessConfig
from mimo_data.records import marker_order
from mimo_data.report import CountedError
from mimo_data.segment_tokenizer import SegmentCacheError
from mimo_data.token_counts import audio_too_long, audio_tokens, image_tokens, resampled_length

IGNORE_INDEX = -100
WARM_CHUNK = 256    # records whose new text pieces are tokenized in one batch (warm)


class SampleDropped(CountedError):
    """A sample that cannot be trained on; ``reason`` is its drop category (counted, not lost)."""


@dataclass
class Sample:
    """One training sample (unpadded, length L = tokens - 1 <= seq_length)."""
    key: str
    input_ids: torch.Tensor          # [L] int64
    labels: torch.Tensor             # [L] int64, next-token targets, -100 where not trained
    loss_mask: torch.Tensor          # [L] float32, 1 exactly where labels are trained
    position_ids: torch.Tensor       # [L] int64
    token_counts: dict[str, list[int]]            # modality -> tokens per item, in item order
    encoder_inputs: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    removed_turns: int = 0           # trailing turns cut by length_policy truncate_turns


class Preprocessor:
    """Callable turning a shard record (+ its media bytes in full mode) into a Sample.

    ``with_media``: True decodes every configured modality into encoder inputs, False none
    (metadata-only), or the modalities to decode (an encoder rank decodes only its own).
    Pickles as its config and modalities (a spawned DataLoader worker rebuilds the rest).
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

    def __getstate__(self) -> dict:
        return {"config": self.config, "with_media": self.media_modalities}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["config"], with_media=state["with_media"])

    def __call__(self, record: dict, media: dict[str, bytes] | None = None) -> Sample:
        _check_record(record)
        items = record["media"]
        counts = [(item["modality"], self._item_tokens(item)) for item in items]
        try:
            encoded, kept_messages = self._fit(record["messages"], counts)
        except SegmentCacheError as exc:
            raise SegmentCacheError(f"sample {record['key']}: {exc}") from None
        ids, trained = encoded.ids, encoded.trained[1:]
        if self.text.is_modality_token(ids[-1]):
            raise SampleDropped("ends_with_media", "the conversation ends with a media item, "
                                "whose last placeholder the next-token shift would cut; end "
                                "it with an assistant turn")
        removed_turns = len(record["messages"]) - len(kept_messages)
        kept_items = items[:len(marker_order(kept_messages))] if removed_turns else items
        if not trained.any():
            raise SampleDropped("no_trained_tokens", "no assistant token to train on"
                                + (f" after removing {removed_turns} turns" if removed_turns
                                   else ""))
        token_counts = {name: [n for (modality, n), _ in zip(counts, kept_items)
                               if modality == name] for name in self.config.modalities}
        # numpy until here: a torch op on a short tensor costs more than the numpy one.
        sample = Sample(key=record["key"], input_ids=torch.from_numpy(ids[:-1]),
                        labels=torch.from_numpy(np.where(trained, ids[1:], IGNORE_INDEX)),
                        loss_mask=torch.from_numpy(trained.astype(np.float32)),
                        position_ids=torch.from_numpy(np.arange(len(ids) - 1)),
                        token_counts=token_counts, removed_turns=removed_turns)
        decoded = [item for item in kept_items if item["modality"] in self.media_modalities]
        if decoded:
            if media is None:
                raise ValueError("full-mode preprocessing needs the sample's media bytes")
            sample.encoder_inputs = self._encoder_inputs(record["key"], decoded, media,
                                                         token_counts)
        return sample

    def warm(self, records) -> None:
        """Tokenize the new text pieces of these records in one batch ahead of their calls
        (``TextEncoder.warm``); malformed records are left for the calls to report."""
        self.text.warm(record["messages"] for record in records
                       if isinstance(record, dict) and isinstance(record.get("messages"), list))

    def _item_tokens(self, item: dict) -> int:
        """Tokens of one media item from its metadata alone (SampleDropped if unusable)."""
        modality = item["modality"]
        config = self.config.modalities.get(modality)
        if config is None:
            raise SampleDropped("unconfigured_modality", f"the sample has {modality} but the "
                                f"config has no modalities.{modality}")
        if modality == "image":
            try:
                return image_tokens(item["width"], item["height"], config)
            except ValueError as exc:   # an aspect ratio the resize rule cannot handle
                raise SampleDropped("bad_image_shape", f"{item['member']}: {exc}") from None
        if audio_too_long(item["frames"], item["sample_rate"], config):
            raise SampleDropped("audio_too_long", f"{item['member']} lasts {item['duration']} s, "
                                f"above max_duration {config.max_duration} s")
        if resampled_length(item["frames"], item["sample_rate"],
                            config.sample_rate) < MIN_AUDIO_SAMPLES:
            raise SampleDropped("audio_too_short", f"{item['member']} has {item['frames']} "
                                f"frames, fewer than the {MIN_AUDIO_SAMPLES} samples at "
                                f"{config.sample_rate} Hz log-mel features need")
        return audio_tokens(item["frames"], item["sample_rate"], config)

    def _encode(self, messages, counts) -> Encoded:
        try:
            return self.text.encode(messages, counts)
        except TextError as exc:
            raise SampleDropped(exc.reason, exc.detail) from None

    def _fit(self, messages: list[dict], counts) -> tuple[Encoded, list[dict]]:
        """Tokens of the conversation within seq_length (+1 for the shifted target), removing
        trailing turns if the length policy allows; never cuts inside a turn or a media span."""
        limit = self.config.seq_length + 1
        encoded = self._encode(messages, counts)
        if len(encoded.ids) <= limit:
            return encoded, messages
        if self.config.length_policy == "truncate_turns":
            for end in range(len(messages) - 1, 0, -1):
                if messages[end - 1]["role"] != "assistant":
                    continue
                kept = messages[:end]
                shorter = self._encode(kept, counts[:len(marker_order(kept))])
                if len(shorter.ids) <= limit:
                    return shorter, kept
        raise SampleDropped("too_long", f"{len(encoded.ids) - 1} tokens, above seq_length "
                            f"{self.config.seq_length}" +
                            (" even with only its first turns" if
                             self.config.length_policy == "truncate_turns" else ""))

    def _encoder_inputs(self, key, items, media, token_counts) -> dict:
        decoded: dict[str, list] = {}
        for item in items:
            config = self.config.modalities[item["modality"]]
            try:
                if item["modality"] == "image":
                    value = decode_image(media[item["member"]], item["orientation"], config)
                    if value.size != (item["width"], item["height"]):
                        raise ValueError(f"decodes to {value.size[0]}x{value.size[1]}, the "
                                         f"metadata says {item['width']}x{item['height']}")
                else:
                    value = decode_audio(media[item["member"]], config)
            except MediaError as exc:
                raise SampleDropped(exc.reason, f"{item['member']}: {exc.detail}") from None
            except Exception as exc:  # decoder errors of any kind: count the sample, go on
                raise SampleDropped("corrupt_media", f"{item['member']}: {exc}") from None
            decoded.setdefault(item["modality"], []).append(value)
        inputs = {}
        for modality, values in decoded.items():
            config = self.config.modalities[modality]
            if modality == "image":
                inputs[modality] = image_encoder_inputs(values, config)
                rows = image_rows_to_tokens(inputs[modality], config)
            else:
                inputs[modality] = audio_encoder_inputs(values, config)
                rows = audio_rows_to_tokens(inputs[modality], config)
            if rows != token_counts[modality]:
                raise RuntimeError(f"sample {key}: the {modality} encoder inputs give {rows} "
                                   f"tokens per item but the text has {token_counts[modality]} "
                                   "placeholders; this is a bug in mimo, please report it")
        return inputs


_ITEM_FIELDS = {"image": ("member", "width", "height", "orientation"),
                "audio": ("member", "frames", "sample_rate", "duration")}


def _check_record(record) -> None:
    """SampleDropped("malformed_record") unless ``record`` has the shard JSON's fields (a record
    written by another tool or edited by hand must not crash a worker)."""
    try:
        problems = [] if isinstance(record["key"], str) else ["key is not a string"]
        for message in record["messages"]:
            if not (isinstance(message["content"], str) and
                    message["role"] in ("system", "user", "assistant")):
                problems.append(f"bad message {str(message)[:60]}")
        for item in record["media"]:
            missing = [f for f in _ITEM_FIELDS[item["modality"]] if f not in item]
            if missing:
                problems.append(f"media item {item.get('member')} lacks {missing}")
    except (KeyError, TypeError) as exc:
        problems = [f"missing or mistyped field {exc}"]
    if problems:
        raise SampleDropped("malformed_record", "; ".join(problems))


def preprocess_dataset(reader, preprocessor: Preprocessor, tally, positions=None):
    """Samples of a ShardReader in order (or at ``positions``); drops are counted in ``tally``
    (a report.Tally) by reason with the sample key, never lost silently."""
    positions = list(range(len(reader)) if positions is None else positions)
    for chunk in range(0, len(positions), WARM_CHUNK):
        batch = positions[chunk:chunk + WARM_CHUNK]
        records = [reader.record(position) for position in batch]
        preprocessor.warm(records)
        for position, record in zip(batch, records):
            media = (reader.media(position, record, preprocessor.media_modalities)
                     if preprocessor.with_media else None)
            try:
                sample = preprocessor(record, media)
            except SampleDropped as exc:
                tally.skip(exc.reason, record["key"], exc.detail)
                continue
            tally.keep()
            yield sample
