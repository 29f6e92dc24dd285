"""The language models' rotary embedding as one fused formula a tensor, forward and backward.

Without TransformerEngine megatron-core applies the rotary embedding unfused
(``rope_utils._apply_rotary_pos_emb_bshd``): for the queries, then again for the keys, of
every layer, a slice, the cosine and the sine of the whole table, two scalings and two
casts, the half rotation's chunk, negation and concatenation, two products, a sum and a last
concatenation: about 14 operators a tensor forward, ~19 kernels with the backward pass's. The
2026-11-30 H200 profile of Qwen2-VL-2B in packed 8k spent 45% of its GPU time idle with the
host dispatching ~29k operators a step (docs/benchmarks.md), ~2,100 of its kernels these
(queries and keys of 28 layers, two micro-batches; the next run counted 1,904 fewer). Here they
are one autograd function whose forward and backward are pure formulas, compiled on a GPU by
``runtime.compile`` (inductor: one kernel each; queries and keys two graphs of the forward, a
contiguous tensor and a strided view of the QKV output), run as written elsewhere, where the
rows and gradients are megatron-core's bit for bit (tests/test_fusions.py). On a GPU the
compiled formulas round once where megatron-core rounds after each product and the sum,
forward and backward: a bf16 unit in the last place on some elements. It keeps the table
alone for the backward pass (megatron-core: its cosine and sine in the tensor's dtype).

``install`` puts ``apply_rotary_pos_emb`` where megatron-core's attention takes it; the cases
it does not fuse (TransformerEngine's fusion asked for, a packed THD batch, interleaved
rotaries) go to megatron-core's own. Neither TransformerEngine's fused rotary (not in mimo's
lock) nor torch has this kernel, hence this module.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings import rope_utils

from mimo_train.runtime.compile import Compiler

COMPILER = Compiler()


def _tables(freqs: torch.Tensor, mscale: float, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float) -> torch.Tensor:
    """megatron-core's ``_apply_rotary_pos_emb_bshd`` (not interleaved): ``t``
    ``[s, b, heads, d]``, ``freqs`` ``[s, b or 1, 1, rotated d]``."""
    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)


def rope_backward(grad: torch.Tensor, freqs: torch.Tensor, mscale: float) -> torch.Tensor:
    """``rope``'s gradient with respect to ``t``, as autograd makes it (the half rotation's
    transpose is its negation)."""
    rotated = freqs.shape[-1]
    part, rest = grad[..., :rotated], grad[..., rotated:]
    cos, sin = _tables(freqs, mscale, grad.dtype)
    return torch.cat((part * cos - rope_utils._rotate_half(part * sin, False), rest), dim=-1)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, mscale):
        ctx.save_for_backward(freqs)
        ctx.mscale = mscale
        return COMPILER(rope, t, freqs, mscale)

    @staticmethod
    def backward(ctx, grad):
        freqs, = ctx.saved_tensors
        return COMPILER(rope_backward, grad, freqs, ctx.mscale), None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """``rope`` with its fused backward; the table gets no gradient (megatron-core's never
    needs one: it comes from positions)."""
    return _RopeFunction.apply(t, freqs.detach(), float(mscale))


def install() -> bool:
    """Route megatron-core's attention's rotary (``attention.apply_rotary_pos_emb``) through
    ``fused_rope`` where it applies; True when it did (once a process)."""
    from megatron.core.transformer import attention
    unfused = rope_utils.apply_rotary_pos_emb
    if attention.apply_rotary_pos_emb is not unfused:
        return False

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False):
        if (cu_seqlens is None and not config.apply_rope_fusion and not
                config.rotary_interleaved and not mla_rotary_interleaved and
                not config.multi_latent_attention and freqs.dim() == t.dim()):
            return fused_rope(t, freqs, mscale)
        return unfused(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                       cp_group=cp_group, mla_rotary_interleaved=mla_rotary_interleaved)

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True
