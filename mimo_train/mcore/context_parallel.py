"""Context parallelism without Transformer Engine: the language model's sequence split over its
``cp`` ranks, attention all-to-all over heads (DeepSpeed-Ulysses).

megatron-core's context parallelism is Transformer Engine's ring attention (its local attention
asserts cp1; its ``MimoModel`` shards packed rows only through Transformer Engine, and cuts
unpacked ones into 2·cp load-balancing chunks for that ring). mimo runs megatron-core's local
layers, hence this module:

- ``SequenceShards`` (the ``MimoModel``'s partition adapter): after the encoders' rows are
  spliced into the whole sequence and the deepstack rows placed (``mcore.deepstack``), each CP
  rank keeps one contiguous 1/cp of it (embeddings, labels, loss mask), then sequence
  parallelism splits that over TP as before. A shard's gradient flows back into its own part
  only (the text embedding's is summed over dp x cp by DDP like any weight's); the encoders'
  rows are ``rows_for_every_shard``: their gradient is summed over the CP group, so every
  encoder (or bridge leader) gets the whole of it.
- Rotary angles are computed from the whole sequence's position ids (M-RoPE built before
  sharding), then cut to this rank's part (``attention.LanguageModel``).
- ``CoreAttention`` (``attention``) wraps its backend in ``ulysses``: an all-to-all turns
  ``[s/cp, b, heads, d]`` into ``[s, b, heads/cp, d]`` (each rank: the whole sequence, its
  share of the heads), the backend attends as at cp1 (any backend; packed rows keep their whole
  ``cu_seqlens``, so sample boundaries need nothing), and the reverse all-to-all gives back
  ``[s/cp, b, heads · d]``. Key/value heads that cp does not divide are repeated first (GQA).
  Attention heads are independent, so this is exact; the all-to-alls move 4 activations of
  ``s/cp · heads · d`` per layer each way (queries, keys, values, output).
- The loss: each rank's tokens' sum and count; the step sums them over the world as it sums
  data-parallel ranks' (``training.step``); the routers of a mixture of experts count their own
  rank's real tokens (``balance``).
- Qwen3.5's gated delta-net layers run megatron-core's own all-to-alls over their heads, in
  mimo's contiguous order (``gated_delta_net``'s patch ``contiguous_cut``).

Ring attention (for heads that cp does not divide) is not built: ``plan.rules`` refuses those
layouts with the numbers. Each attention layer's all-to-alls wait for its projections (no
overlap with compute).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import (all_to_all_hp2sp, all_to_all_sp2hp,
                                                    copy_to_tensor_model_parallel_region,
                                                    scatter_to_sequence_parallel_region)


def span(length: int, group: dist.ProcessGroup) -> slice:
    """This rank's contiguous part of a sequence of ``length`` over ``group``."""
    size = group.size()
    if length % size:
        raise ValueError(f"a sequence of {length} tokens does not split over context-parallel "
                         f"size {size}; the trainer pads batches to a multiple of it "
                         "(training.step.model_inputs): this is a bug in mimo, report it")
    part = length // size
    return slice(group.rank() * part, (group.rank() + 1) * part)


class _Shard(torch.autograd.Function):
    """This rank's part along ``dim``; backward: its gradient in place, zeros elsewhere
    (megatron-core's split, ``scatter_to_sequence_parallel_region``, all-gathers the gradient
    instead: every CP rank would then count the whole sequence's text-embedding gradient)."""

    @staticmethod
    def forward(ctx, tensor, dim, group):
        ctx.shape, ctx.dim, ctx.part = tensor.shape, dim, span(tensor.size(dim), group)
        index = [slice(None)] * tensor.dim()
        index[dim] = ctx.part
        ctx.index = tuple(index)
        return tensor[ctx.index].contiguous()

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.shape)
        full[ctx.index] = grad
        return full, None, None


def shard(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor``'s contiguous part for this rank of ``group`` along ``dim`` (see ``_Shard``)."""
    return _Shard.apply(tensor, dim, group)


def rows_for_every_shard(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``rows`` as they are; their gradient summed over ``group`` (each CP rank's tokens add
    theirs), megatron-core's copy-to-region."""
    return copy_to_tensor_model_parallel_region(rows, group=group)


class SequenceShards:
    """``MimoModel``'s partition adapter under context parallelism: contiguous parts of the
    spliced sequence (module docstring), then sequence parallelism's split over TP. ``cfg``:
    megatron-core's ``PartitionConfig`` (its ``cp_group``, ``tp_group``, ``seq_parallel``)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """An encoder module's rows before the splice (``rows_for_every_shard``)."""
        return rows_for_every_shard(rows, self.cfg.cp_group)

    def shard(self, embeddings, labels, loss_mask, packed_seq_params=None):
        """Embeddings ``[S, B, H]`` → ``[S/cp(/tp), B, H]``; labels and loss mask ``[B, S]`` →
        ``[B, S/cp]``; packed sequence parameters as they are (attention sees the whole
        sequence)."""
        group = self.cfg.cp_group
        if embeddings is not None:
            embeddings = shard(embeddings, 0, group)
            if self.cfg.seq_parallel:
                embeddings = scatter_to_sequence_parallel_region(embeddings,
                                                                 group=self.cfg.tp_group)
        labels, loss_mask = (None if t is None else t[:, span(t.size(1), group)]
                             for t in (labels, loss_mask))
        return embeddings, labels, loss_mask, packed_seq_params


def heads_to_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s/cp, b, h, d]`` (this rank's tokens, every head) → ``[s, b, h/cp, d]`` (every token,
    this rank's heads): megatron-core's sequence-to-head all-to-all over ``group``, on the
    tokens flattened (rank j's tokens come j-th, in sequence order)."""
    s, b, h, d = tensor.shape
    out = all_to_all_sp2hp(tensor.reshape(s * b, h * d), group=group)
    return out.reshape(-1, b, h // group.size(), d)


def sequence_to_heads(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of ``heads_to_sequence``: ``[s, b, h/cp, d]`` → ``[s/cp, b, h, d]``."""
    s, b, h, d = tensor.shape
    out = all_to_all_hp2sp(tensor.reshape(s * b, h * d), group=group)
    return out.reshape(s // group.size(), b, -1, d)


def heads_for(key: torch.Tensor, value: torch.Tensor, heads: int, cp: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value ``[..., groups, d]`` with each group repeated the fewest times that make the
    count a multiple of ``cp`` (and still divide ``heads``), in megatron-core's order: query
    head ``i`` keeps its group."""
    groups = key.size(-2)
    repeat = next(r for r in range(1, heads // groups + 1)
                  if (heads // groups) % r == 0 and (groups * r) % cp == 0)
    if repeat == 1:
        return key, value
    return key.repeat_interleave(repeat, dim=-2), value.repeat_interleave(repeat, dim=-2)
