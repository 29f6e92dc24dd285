"""megatron-core's local attention for packed batches (``data.packing``).

A packed micro-batch is megatron-core's THD format: the samples back to back in one row,
``PackedSeqParams.cu_seqlens_q`` at their boundaries (``mimo_data/loading/packing.py``).
megatron-core's rotary embedding restarts positions at every sample in that format, but its
local ``DotProductAttention`` refuses it (only TransformerEngine's attention takes THD, and
TransformerEngine needs CUDA). This subclass computes the packed row's block-diagonal causal
attention block by block: each sample runs through the local attention with its causal mask,
and the blocks between samples, which the block-diagonal mask hides entirely, are never
computed. So a token attends to earlier tokens of its own sample only, exactly as in its
unpacked row, and the cost is the sum of the samples' squared lengths, never more than the
padded batch's. Unpacked batches go to the local attention unchanged.
"""

from __future__ import annotations

import torch

from mimo_train.mcore import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also takes THD batches (``packed_seq_params``)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias)
        # THD: [tokens, heads, head dim]; each sample goes as a batch of one, [s, 1, h, d],
        # under the causal mask the local attention makes for it
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        return torch.cat([super(PackedDotProductAttention, self).forward(
            query[start:end, None], key[start:end, None], value[start:end, None], None,
            attn_mask_type, attention_bias) for start, end in zip(bounds, bounds[1:])])
