"""The modalities' rows spliced into the language model's word embeddings without waiting for
the device.

megatron-core's ``MimoModel`` finds the text tokens with ``nonzero`` (the host waits for the
GPU), checks each modality's placeholder count against its rows with ``.item()`` (a wait a
modality) and places text and rows with ``masked_scatter_``, whose backward pass selects by
the mask (``masked_select``: a wait a part): five waits a micro-batch of images and text, each
draining the queue of kernels the host had run ahead with. ``SplicingMimoModel`` reads the
same positions from the micro-batch's token ids on the host (``forward``'s
``host_input_ids``, which ``training.step.model_inputs`` passes): the text tokens' and each
modality's placeholders', flat in ``[B, S]``'s row-major order, copied to the device once.
It embeds the text tokens megatron-core embeds, in its order (the word embeddings' backward
gets megatron-core's indices, so the same gradient on any device), and places the text and
the rows with ``index_copy_`` (whose backward pass is ``index_select``): the same embeddings
and gradients, bit for bit, and no wait. Placeholder counts that differ from the rows are
megatron-core's error, counted on the host; placeholders of a modality that has no rows are
an error too (megatron-core left their positions zero). ``place`` puts other rows at a
modality's placeholders the same way (``mcore.deepstack``'s). Called without the host's ids it
is megatron-core's splice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch
from megatron.core.utils import unwrap_model

from mimo_data.modalities.base import to_device
from mimo_train.mcore import MimoModel


@dataclass(frozen=True)
class Places:
    """A micro-batch's positions, flat in ``[B, S]`` on the device: ``every`` holds the text
    tokens' then each modality's placeholders' (``special_token_ids``' order); ``text`` and
    ``modalities`` are its slices; ``counts`` the placeholders, from the host."""
    every: torch.Tensor
    text: torch.Tensor
    modalities: dict[str, torch.Tensor]
    counts: dict[str, int]

    @classmethod
    def of(cls, host_ids: torch.Tensor, special_token_ids: dict[str, int],
           device: torch.device) -> Places:
        flat = host_ids.reshape(-1).numpy()
        tokens = list(special_token_ids.values())
        parts = [numpy.flatnonzero(~numpy.isin(flat, tokens))] + [
            numpy.flatnonzero(flat == token) for token in tokens]
        every = to_device(torch.from_numpy(numpy.concatenate(parts)), device)
        text, *modalities = every.split([len(p) for p in parts])
        return cls(every, text, dict(zip(special_token_ids, modalities)),
                   {name: len(p) for name, p in zip(special_token_ids, parts[1:])})


class SplicingMimoModel(MimoModel):
    """``MimoModel`` that splices without waiting for the device (see the module
    docstring)."""

    _host_ids: torch.Tensor | None = None
    _places: Places | None = None

    def forward(self, *args, host_input_ids: torch.Tensor | None = None, **kwargs):
        """megatron-core's forward; ``host_input_ids``: ``input_ids`` on the host."""
        self._host_ids, self._places = host_input_ids, None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._host_ids = self._places = None

    def places(self, input_ids: torch.Tensor) -> Places | None:
        """This forward pass's ``Places`` (None without the host's ids)."""
        if self._host_ids is None:
            return None
        if self._places is None:
            self._places = Places.of(self._host_ids, self.special_token_ids, input_ids.device)
        return self._places

    def get_text_embeddings(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                            special_token_ids: dict[str, int]) -> torch.Tensor:
        """megatron-core's: the text tokens' word embeddings ``[N, H]``, in token order."""
        places = self.places(input_ids)
        embedding = unwrap_model(self.language_model).embedding
        if places is None or special_token_ids != self.special_token_ids or (
                self.partition_adapter is not None and self.partition_adapter.cfg.seq_parallel
                and getattr(embedding, "scatter_to_sequence_parallel", False)):
            return super().get_text_embeddings(input_ids, position_ids, special_token_ids)
        ids = input_ids.reshape(-1).index_select(0, places.text).unsqueeze(0)
        if position_ids is not None:
            if position_ids.dim() == 3:                         # M-RoPE's [3, B, S]
                position_ids = position_ids[0]
            position_ids = position_ids.reshape(-1).index_select(0, places.text).unsqueeze(0)
        return embedding(input_ids=ids, position_ids=position_ids).squeeze(1)

    def align_embeddings_by_token_positions(self, modality_embeddings: dict[str, torch.Tensor],
                                            input_ids: torch.Tensor,
                                            special_token_ids: dict[str, int]) -> torch.Tensor:
        """The text's and each modality's rows at their positions, ``[S, B, H]``."""
        places = self.places(input_ids)
        text = modality_embeddings.get("text")
        if places is None or text is None or special_token_ids != self.special_token_ids:
            return super().align_embeddings_by_token_positions(
                modality_embeddings, input_ids, special_token_ids)
        for name in modality_embeddings:
            if name != "text" and name not in special_token_ids:
                raise ValueError(f"No special token ID defined for modality {name}")
        parts = [text]
        for name in special_token_ids:
            rows, found = modality_embeddings.get(name), places.counts[name]
            if rows is None and found:
                raise ValueError(f"{found} {name} tokens but no {name} embeddings: the "
                                 f"micro-batch's {name} inputs did not reach its encoder")
            if rows is not None and found != rows.size(0):
                raise ValueError(f"Number of {name} tokens ({found}) does not match number "
                                 f"of {name} embeddings ({rows.size(0)})")
            if rows is not None:
                parts.append(rows)
        # a modality without rows has no placeholders: ``every`` is the parts' positions
        return self._at(places.every, torch.cat(parts), input_ids.shape)

    def place(self, rows: torch.Tensor, input_ids: torch.Tensor, name: str) -> torch.Tensor:
        """``rows`` ``[tokens, h]`` at modality ``name``'s placeholders of a zero
        ``[S, B, h]``."""
        places = self.places(input_ids)
        if places is None:
            mask = (input_ids == self.special_token_ids[name]).unsqueeze(-1)
            return rows.new_zeros(*input_ids.shape, rows.size(-1)).masked_scatter(
                mask, rows).transpose(0, 1)
        return self._at(places.modalities[name], rows, input_ids.shape)

    @staticmethod
    def _at(positions: torch.Tensor, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        batch, length = shape
        placed = rows.new_zeros(batch * length, rows.size(-1)).index_copy_(0, positions, rows)
        return placed.view(batch, length, -1).transpose(0, 1).contiguous()

    def _has_encoder_tokens(self, input_ids: torch.Tensor | None, encoder_name: str) -> bool:
        if input_ids is None or self._host_ids is None:
            return super()._has_encoder_tokens(input_ids, encoder_name)
        return super()._has_encoder_tokens(self._host_ids, encoder_name)

    def _attach_modality_split_sizes(self, output: torch.Tensor,
                                     input_ids: torch.Tensor | None, encoder_name: str) -> None:
        """megatron-core's, counting the samples' placeholders on the host."""
        host = self._host_ids if input_ids is not None else None
        super()._attach_modality_split_sizes(
            output, host if host is not None else input_ids, encoder_name)
