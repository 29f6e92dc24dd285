"""Samples → one batch in exactly the form megatron-core's ``MimoModel.forward`` takes.

``batch``: ``input_ids``, ``labels``, ``loss_mask``, ``position_ids``, ``attention_mask``
(all ``[B, seq_length]``; M-RoPE position ids ``[3, B, seq_length]``),
``modality_inputs = {modality: {encoder: {kwarg: tensor}}}`` with the encoder inputs
concatenated sample by sample, item by item (matching placeholder order), and
``packing_kwargs``. Everything else (keys, per-item token counts) goes in a separate metadata
dict. Every batch is checked: placeholders per sample == token counts == encoder-input rows.

Packed (``data.packing``, ``loading/packing.py``): the samples back to back in one row
(``[1, tokens]``, megatron-core's THD format, no padding), each sample's own position ids
(``preprocess/positions.py``: restarting at every sample), and ``packing_kwargs`` =
``cu_seqlens_q/kv`` (sample boundaries) and ``max_seqlen_q/kv``, from which ``MimoModel``
builds ``PackedSeqParams``.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

import numpy as np
import torch

from mimo_data.modalities import MODALITIES
from mimo_data.preprocess.preprocessor import IGNORE_INDEX, Preprocessor, Sample


# Unpacked batches are cut to their longest sample rounded up to this many tokens before the
# model (mimo_train/training/step.py); mimo-inspect plan reports what that costs.
LENGTH_MULTIPLE = 64


class TextTensors(TypedDict):
    """A batch's token tensors ([B, seq_length]; packed: [1, tokens])."""
    input_ids: torch.Tensor
    labels: torch.Tensor                # next-token targets, -100 where not trained
    loss_mask: torch.Tensor             # float, 1 exactly where labels are trained
    position_ids: torch.Tensor          # the sample's own; M-RoPE: [3, B, seq_length]
    attention_mask: torch.Tensor        # bool, True on real tokens
    packing_kwargs: dict | None         # packed: cu_seqlens_q/kv, max_seqlen_q/kv


class Batch(TextTensors):
    """Exactly ``MimoModel.forward``'s keyword arguments."""
    modality_inputs: dict[str, dict[str, dict[str, torch.Tensor]]]  # modality -> encoder -> kw


class BatchMetadata(TypedDict):
    """What travels beside a batch, never into ``forward``."""
    keys: list[str]                          # sample keys, row by row
    token_counts: dict[str, list[list[int]]]  # modality -> per row, tokens per item
    removed_turns: list[int]                 # trailing turns cut by truncate_turns, per row
    # added by the loader (loading/loader.py):
    epoch: NotRequired[int]
    step: NotRequired[int]
    micro_batch: NotRequired[int]            # global micro-batch index in the step
    tokens: NotRequired[list[int]]           # real tokens per sample
    trained_tokens: NotRequired[list[int]]   # loss_mask ones per sample
    # modality -> per row, the [t, h, w] grid of each item's placeholders (None: a sequence)
    token_grids: NotRequired[dict[str, list[list[list[int] | None]]]]
    encoder_keys: NotRequired[dict[str, list[str]]]  # modality -> samples of its inputs
    # data.split_media, encoder ranks: modality -> [sample key, item, first, stop] per piece
    # of the rank's part (units first..stop - 1 of the sample's item), in placeholder order
    media_parts: NotRequired[dict[str, list[list]]]
    sequences: NotRequired[list[int]]        # packed: samples per packed sequence


class BatchError(RuntimeError):
    """A batch whose placeholders, token counts and encoder inputs disagree."""


class Collator:
    """Pads samples to ``seq_length`` (or, ``packed``, puts them back to back) and
    concatenates their encoder inputs."""

    def __init__(self, preprocessor: Preprocessor, packed: bool = False):
        self.config = preprocessor.config
        self.pad_token_id = preprocessor.text.pad_token_id
        self.modality_token_ids = preprocessor.text.modality_token_ids
        self.packed = packed
        # M-RoPE ids have a leading (time, height, width) dimension: [3, B, seq_length]
        self._position_rows = (3,) if self.config.positions == "mrope" else ()

    def __call__(self, samples: list[Sample]) -> tuple[Batch, BatchMetadata]:
        text = self._packed_text(samples) if self.packed else self._padded_text(samples)
        modality_inputs = {}
        for modality in self.config.modalities:
            parts = [s.encoder_inputs[modality] for s in samples if modality in s.encoder_inputs]
            if parts:
                modality_inputs[modality] = {modality: {
                    kwarg: torch.cat([part[kwarg] for part in parts]) for kwarg in parts[0]}}
        batch = Batch(**text, modality_inputs=modality_inputs)
        metadata = BatchMetadata(keys=[s.key for s in samples],
                                 token_counts={m: [s.token_counts[m] for s in samples]
                                               for m in self.config.modalities},
                                 removed_turns=[s.removed_turns for s in samples])
        self.check(batch, metadata)
        return batch, metadata

    def _padded_text(self, samples: list[Sample]) -> TextTensors:
        length = self.config.seq_length
        size = len(samples)
        # numpy, then torch.from_numpy: a torch op on these small tensors costs several numpy ones.
        input_ids = np.full((size, length), self.pad_token_id, dtype=np.int64)
        labels = np.full((size, length), IGNORE_INDEX, dtype=np.int64)
        loss_mask = np.zeros((size, length), dtype=np.float32)
        attention_mask = np.zeros((size, length), dtype=bool)
        for row, sample in enumerate(samples):
            n = len(sample.input_ids)
            input_ids[row, :n] = sample.input_ids.numpy()
            labels[row, :n] = sample.labels.numpy()
            loss_mask[row, :n] = sample.loss_mask.numpy()
            attention_mask[row, :n] = True
        # padding's positions continue the row's count: never attended to by real tokens
        position_ids = np.broadcast_to(np.arange(length), (*self._position_rows, size, length)
                                       ).copy()
        for row, sample in enumerate(samples):
            position_ids[..., row, :len(sample.input_ids)] = sample.position_ids.numpy()
        return TextTensors(input_ids=torch.from_numpy(input_ids),
                           labels=torch.from_numpy(labels), loss_mask=torch.from_numpy(loss_mask),
                           position_ids=torch.from_numpy(position_ids),
                           attention_mask=torch.from_numpy(attention_mask), packing_kwargs=None)

    def _packed_text(self, samples: list[Sample]) -> TextTensors:
        lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
        bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = int(bounds[-1])
        position_ids = torch.cat([s.position_ids for s in samples], dim=-1).unsqueeze(-2)
        longest = int(lengths.max())
        return TextTensors(input_ids=torch.cat([s.input_ids for s in samples])[None],
                           labels=torch.cat([s.labels for s in samples])[None],
                           loss_mask=torch.cat([s.loss_mask for s in samples]).float()[None],
                           position_ids=position_ids,
                           attention_mask=torch.ones((1, tokens), dtype=torch.bool),
                           packing_kwargs={"cu_seqlens_q": torch.from_numpy(bounds),
                                           "cu_seqlens_kv": torch.from_numpy(bounds.copy()),
                                           "max_seqlen_q": longest, "max_seqlen_kv": longest})

    def _placeholders(self, batch: Batch, token_id: int) -> list[int]:
        """Placeholders of ``token_id`` per sample (per row, or per packed segment)."""
        hits = (batch["input_ids"].numpy() == token_id)
        packing = batch["packing_kwargs"]
        if packing is None:
            return hits.sum(1).tolist()
        bounds = packing["cu_seqlens_q"].numpy()
        return np.add.reduceat(hits[0].astype(np.int64), bounds[:-1]).tolist()

    def check(self, batch: Batch, metadata: BatchMetadata) -> None:
        """Raise BatchError unless, per modality, placeholders in each sample == its token
        counts == what the batch's encoder inputs produce, item by item."""
        for modality, config in self.config.modalities.items():
            counts = metadata["token_counts"][modality]
            placeholders = self._placeholders(batch, self.modality_token_ids[modality])
            for key, row_count, item_counts in zip(metadata["keys"], placeholders,
                                                   counts):
                if row_count != sum(item_counts):
                    raise BatchError(f"sample {key}: {row_count} {modality} placeholders, token "
                                     f"counts {item_counts} (sum {sum(item_counts)})")
            inputs = batch["modality_inputs"].get(modality, {}).get(modality)
            if inputs is not None:
                rows = MODALITIES[modality].rows_to_tokens(inputs, config)
                flat = [n for item_counts in counts for n in item_counts]
                if rows != flat:
                    raise BatchError(f"batch {metadata['keys']}: {modality} encoder inputs give "
                                     f"{rows} tokens per item, the samples' counts are {flat}")
