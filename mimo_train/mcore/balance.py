"""The mixture of experts' load-balancing loss over the global batch
(``model.language.moe_aux_loss``), the same under every layout.

transformers' (Switch Transformer's) loss on a batch: every MoE layer's router rows of the
batch's real tokens together, ``E · Σ_e f_e · P_e`` with ``f_e`` the share of those rows that
picked expert ``e`` among their top k and ``P_e`` the mean router probability of ``e``.
megatron-core computes its balancing losses from each micro-batch's counts (at most reduced
over the data-parallel ranks), so the gradient changes with the micro-batch size, the DP size
and the order of samples; that is what this module replaces. A step with the loss on runs its
micro-batches twice:

1. ``count``: forward only, no gradient; each router adds its real rows' expert picks and
   probabilities; the sums are reduced over the ranks holding other rows (DP x CP, pipeline
   stages, and the TP ranks under sequence parallelism): the global batch's ``f`` and the
   loss's value;
2. ``apply``: the training pass; each router attaches ``coefficient · E · Σ_e f_e · Σ_t p_te /
   R`` (``R``: all layers' real rows) to its output, with a gradient scaled by the step's
   trained tokens, which the finalized gradients are divided by: summed over micro-batches,
   stages and ranks, the gradient of ``coefficient`` times transformers' loss on the whole
   global batch.

Real rows are the micro-batch's non-padding tokens (``attention_mask``; a packed batch has no
padding but what context parallelism adds), set by the forward step before each micro-batch
(``tokens``, the whole sequence's: each rank keeps its context- and sequence-parallel part).
The counting pass costs one more forward pass per step: the price of a loss that does not
depend on the layout. Its sums, the loss's value and the step's trained tokens stay on the
device (on a GPU a read waits for all queued work); the trainer reads the value with the
step's record.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router import TopKRouter


class _Attach(torch.autograd.Function):
    """``output`` unchanged; in the backward pass ``loss`` gets the gradient ``scale`` (a
    device scalar: the step's trained tokens, never read on the host)."""

    @staticmethod
    def forward(ctx, output, loss, scale):
        ctx.save_for_backward(scale)
        ctx.loss_dtype = loss.dtype
        return output

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad, scale.to(ctx.loss_dtype), None


class GlobalBalance:
    """Hooks on the routers of ``language`` (megatron-core's GPT model, unwrapped) adding the
    global-batch balancing loss with ``coefficient``; ``groups``: the language module's
    process groups; ``sequence_parallel``: whether TP ranks hold parts of the sequence."""

    def __init__(self, language: torch.nn.Module, coefficient: float, groups,
                 sequence_parallel: bool):
        self.coefficient = coefficient
        self.routers = [m for m in language.modules() if isinstance(m, TopKRouter)]
        self.experts = self.routers[0].config.num_moe_experts if self.routers else 0
        self.groups = [groups.dp_cp, groups.pp] + ([groups.tp] if sequence_parallel else [])
        # the groups that cut the sequence, in the order they cut it: CP, then TP under SP
        self.cuts = [groups.cp] + ([groups.tp] if sequence_parallel else [])
        self.mode: str | None = None
        # the micro-batch's real-token mask [b, s], on the routers' device (the step puts it
        # there without a wait)
        self.tokens: torch.Tensor | None = None
        # the step's values, device scalars (reading one would wait for the device's queue)
        self.frequency: torch.Tensor | None = None  # f_e over the global batch
        self.rows: torch.Tensor | None = None       # R: every layer's real rows (float32)
        self.scale: torch.Tensor | None = None      # the step's trained tokens
        self.value: torch.Tensor | None = None      # the loss (without the coefficient)
        self._sums: torch.Tensor | None = None
        for router in self.routers:
            router.register_forward_hook(self._hook)

    @contextmanager
    def counting(self, device: torch.device):
        """The count pass: afterwards ``frequency``, ``rows`` and ``value`` hold the global
        batch's, on the device (collective over the module's ranks)."""
        self.mode = "count"
        self._sums = torch.zeros(2 * self.experts + 1, dtype=torch.float64, device=device)
        try:
            yield
        finally:
            self.mode = None
        sums = self._sums
        for group in self.groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sums, group=group)
        picks, probabilities, rows = sums[:self.experts], sums[self.experts:-1], sums[-1]
        rows = rows.clamp(min=1)
        self.frequency = (picks / rows).float()
        # a count of rows: float32 holds it exactly below 2**24 (as the float it was divided
        # by when this was a host value)
        self.rows = rows.float()
        self.value = self.experts * (self.frequency.double() * probabilities / rows).sum()

    @contextmanager
    def applying(self, trained_tokens: torch.Tensor):
        """The training pass: each router's output carries its part of the loss, its gradient
        scaled by ``trained_tokens`` (the step's, which every gradient is divided by; a device
        scalar)."""
        self.mode, self.scale = "apply", trained_tokens
        try:
            yield
        finally:
            self.mode = None

    def _real_rows(self, router_input: torch.Tensor) -> torch.Tensor:
        """1.0 for each of the router's rows ([s, b] order) that is a real token, else 0."""
        seq, batch = router_input.shape[:2]
        if self.tokens is None:
            return router_input.new_ones(seq * batch, dtype=torch.float32)
        mask = self.tokens.t().float()        # [S, b]
        for group in self.cuts:      # this CP rank's part, then its TP rank's (SP) of that
            size = mask.shape[0] // group.size()
            rank = dist.get_rank(group)
            mask = mask[rank * size:(rank + 1) * size]
        assert mask.shape[0] == seq, (mask.shape, seq)
        return mask.reshape(-1)

    def _hook(self, router, args, output):
        if self.mode is None or (self.mode == "apply" and not torch.is_grad_enabled()):
            return output
        router_input = args[0]
        probs, routing_map = output
        real = self._real_rows(router_input)
        scores = torch.softmax(router.gating(router_input).view(-1, self.experts).float(), -1)
        if self.mode == "count":
            assert self._sums is not None
            with torch.no_grad():
                self._sums[:self.experts] += (routing_map.float() * real[:, None]).sum(0).double()
                self._sums[self.experts:-1] += (scores * real[:, None]).sum(0).double()
                self._sums[-1] += real.sum().double()
            return output
        assert self.frequency is not None and self.rows is not None and self.scale is not None
        share = (scores * real[:, None]).sum(0) @ self.frequency.to(scores.device)
        loss = self.coefficient * self.experts * share / self.rows
        return _Attach.apply(probs, loss, self.scale), routing_map
