"""Interleaved M-RoPE (Qwen3-VL): the rotary frequencies of a head take their angle from the
time, height or width position in turn (frequency i: height where i % 3 == 1 and
i < 3 · sections[1], width where i % 3 == 2 and i < 3 · sections[2], time elsewhere), where
Qwen2-VL's M-RoPE gives each a contiguous section. transformers' ``Qwen3VLTextRotaryEmbedding``
(``recomposition_frequencies``) is the reference; megatron-core 0.19.2's
``MultimodalRotaryEmbedding`` has the contiguous layout only, hence this subclass."""

from __future__ import annotations

import torch

from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding)


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """``MultimodalRotaryEmbedding`` with the t/h/w frequencies interleaved (above)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int],
                cp_group=None) -> torch.Tensor:
        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        freqs = seq[..., None] * self.inv_freq         # [3, B, S, dim / 2]
        index = torch.arange(freqs.size(-1), device=freqs.device)
        axis = torch.zeros_like(index)                 # 0: time
        for dim in (1, 2):
            axis[(index % 3 == dim) & (index < 3 * mrope_section[dim])] = dim
        chosen = freqs.gather(0, axis.expand_as(freqs[:1]))[0]      # [B, S, dim / 2]
        emb = torch.cat((chosen, chosen), dim=-1)[..., None, :].transpose(0, 1).contiguous()
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb                                     # [S, B, 1, dim]
