"""megatron-core's local attention for packed batches (``data.packing``).

A packed micro-batch is megatron-core's THD format: the samples back to back in one row,
``PackedSeqParams.cu_seqlens_q`` at their boundaries (``mimo_data/loading/packing.py``).
megatron-core's rotary embedding restarts positions at every sample in that format, but its
local ``DotProductAttention`` refuses it (only TransformerEngine's attention takes THD, and
TransformerEngine needs CUDA). This subclass cuts the row into the packing plan's sequences
(next-fit at ``seq_length`` finds them again) and runs the local attention on each with an
exact block-diagonal causal mask: a token attends to earlier tokens of its own sample only.
The probabilities of masked scores are exactly zero, so a packed batch gives the losses and
gradients of the same samples unpacked. Unpacked batches go to the local attention unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from mimo_data.loading.packing import next_fit
from mimo_train.mcore import DotProductAttention


def block_diagonal_causal_mask(lengths, device: torch.device) -> torch.Tensor:
    """``[1, 1, T, T]`` bool, True where attention is masked: across samples of ``lengths``
    (back to back) and to later tokens."""
    segment = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)).to(device)
    position = torch.arange(len(segment), device=device)
    masked = (segment[:, None] != segment[None, :]) | (position[None, :] > position[:, None])
    return masked[None, None]


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also takes THD batches (``packed_seq_params``);
    ``capacity``: the packed sequences' length (``seq_length``)."""

    def __init__(self, *args, capacity: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.capacity = capacity

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias)
        # THD: [tokens, heads, head dim]; each sequence goes as a batch of one, [s, 1, h, d]
        lengths = np.diff(packed_seq_params.cu_seqlens_q.tolist())
        outputs, start, first = [], 0, 0
        for count in next_fit(lengths, self.capacity):
            sizes = lengths[first:first + count]
            end = start + int(sizes.sum())
            mask = block_diagonal_causal_mask(sizes, query.device)
            outputs.append(super().forward(query[start:end, None], key[start:end, None],
                                           value[start:end, None], mask, attn_mask_type,
                                           attention_bias))
            start, first = end, first + count
        return torch.cat(outputs)
