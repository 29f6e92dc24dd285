"""cuDNN's attention over packed items (``cudnn_varlen``): the towers' attention under
``model.tower_attention: cudnn``.

torch's ``varlen_attn`` (mimo's towers' kernel by default) runs flash kernels, which exist
for head widths of 32, 64, 96, ...: the Qwen2-VL towers' width of 80 runs as 96, and the
tower's flash backward was the packed 8k step's largest kernel on the H200
(docs/benchmarks.md, 2026-12-04). cuDNN's fused attention takes widths in steps of 8, and
torch has it for packed items (its operators ``_cudnn_attention_forward`` and ``_backward``
with the items' bounds, as for nested tensors), but torch 2.11's ``varlen_attn`` never takes
it, and its call of the backward passes the bounds where the operator's schema has the
random seeds: the operators are called here by their schemas' names. No installed library
offers this (transformer-engine is not in mimo's lock), hence this module.

Experimental: checked on the CPU against SDPA per item with the operators replaced by
stand-ins of their schemas (tests/test_tower_attention.py); on a GPU the GPU check's
``tower_attention`` probe compares the kernel with fp32 SDPA and times it against flash.
"""

from __future__ import annotations

import torch


class _CudnnVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        found = torch.ops.aten._cudnn_attention_forward(
            query=q, key=k, value=v, attn_bias=None, cum_seq_q=cu_q, cum_seq_k=cu_k,
            max_q=max_q, max_k=max_k, compute_log_sumexp=True, dropout_p=0.0,
            is_causal=causal, return_debug_mask=False, scale=scale)
        out, lse, seed, offset = found[0], found[1], found[6], found[7]
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.max_q, ctx.max_k, ctx.scale, ctx.causal = max_q, max_k, scale, causal
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad_out=grad.contiguous(), query=q, key=k, value=v, out=out, logsumexp=lse,
            philox_seed=seed, philox_offset=offset, attn_bias=None, cum_seq_q=cu_q,
            cum_seq_k=cu_k, max_q=ctx.max_q, max_k=ctx.max_k, dropout_p=0.0,
            is_causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None, None


def cudnn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int, scale: float | None = None,
                 causal: bool = False) -> torch.Tensor:
    """``varlen_attn``'s contract on cuDNN: ``q``, ``k``, ``v`` ``[tokens, heads, width]`` (the
    items one after another), ``cu_*`` their int32 bounds, ``max_*`` the longest item ->
    ``[tokens, heads, width]``; a CUDA kernel."""
    return _CudnnVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)
