"""The modalities' rows spliced into the language model's word embeddings without reading the
device on the host.

megatron-core's ``MimoModel`` embeds the text tokens alone, their positions found with
``nonzero`` (a host read of the device), and checks each modality's placeholder count against
its rows with ``.item()`` (one read a modality) before ``masked_scatter_``: three waits for the
GPU a micro-batch of images and text (6 of the 21.5 a step the H200 profile named, each
draining the queue of kernels the host had run ahead with). ``SplicingMimoModel`` embeds every
token and puts each modality's rows in place of its placeholders' (so a placeholder's word
embedding gets no gradient: the word embeddings' gradient is megatron-core's), and counts the
placeholders in the micro-batch's token ids on the host (``forward``'s ``host_input_ids``,
which ``training.step.model_inputs`` passes), with megatron-core's error where a count differs
from the rows; placeholders of a modality that has no rows are that error too (megatron-core
left their positions zero). Called without them it counts on the device, as megatron-core
does. Its other reads of the ids (whether a micro-batch has an encoder's tokens, the samples'
counts a bridge cuts at) take the host's too.
"""

from __future__ import annotations

import numpy
import torch
from megatron.core.utils import unwrap_model

from mimo_train.mcore import MimoModel


class SplicingMimoModel(MimoModel):
    """``MimoModel`` that splices without host reads (see the module docstring)."""

    _host_ids: torch.Tensor | None = None

    def forward(self, *args, host_input_ids: torch.Tensor | None = None, **kwargs):
        """megatron-core's forward; ``host_input_ids``: ``input_ids`` on the host."""
        self._host_ids = host_input_ids
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._host_ids = None

    def get_text_embeddings(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                            special_token_ids: dict[str, int]) -> torch.Tensor:
        """Every token's word embedding, ``[S, B, H]`` (megatron-core's: the text tokens')."""
        embedding = unwrap_model(self.language_model).embedding
        if (self.partition_adapter is not None and self.partition_adapter.cfg.seq_parallel
                and getattr(embedding, "scatter_to_sequence_parallel", False)):
            return super().get_text_embeddings(input_ids, position_ids, special_token_ids)
        if position_ids is not None and position_ids.dim() == 3:   # M-RoPE's [3, B, S]
            position_ids = position_ids[0]
        return embedding(input_ids=input_ids, position_ids=position_ids)

    def align_embeddings_by_token_positions(self, modality_embeddings: dict[str, torch.Tensor],
                                            input_ids: torch.Tensor,
                                            special_token_ids: dict[str, int]) -> torch.Tensor:
        """The word embeddings with each modality's rows at its placeholders, ``[S, B, H]``."""
        text = modality_embeddings.get("text")
        if text is None or text.dim() != 3:
            return super().align_embeddings_by_token_positions(
                modality_embeddings, input_ids, special_token_ids)
        for name in modality_embeddings:
            if name != "text" and name not in special_token_ids:
                raise ValueError(f"No special token ID defined for modality {name}")
        combined = text.transpose(0, 1)              # [B, S, H]: the rows' token order
        for name, token_id in special_token_ids.items():
            rows = modality_embeddings.get(name)
            found = self._placeholders(input_ids, token_id)
            if rows is None and found:
                raise ValueError(f"{found} {name} tokens but no {name} embeddings: the "
                                 f"micro-batch's {name} inputs did not reach its encoder")
            if rows is None:
                continue
            if found != rows.size(0):
                raise ValueError(f"Number of {name} tokens ({found}) does not match number "
                                 f"of {name} embeddings ({rows.size(0)})")
            combined = combined.masked_scatter((input_ids == token_id).unsqueeze(-1), rows)
        return combined.transpose(0, 1).contiguous()

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

    def _placeholders(self, input_ids: torch.Tensor, token_id: int) -> int:
        """How many of ``input_ids`` are ``token_id``: counted on the host (numpy, no torch
        operator) where ``forward`` got the ids there."""
        if self._host_ids is None:
            return int((input_ids == token_id).sum())
        return int(numpy.count_nonzero(self._host_ids.numpy() == token_id))
