"""A mixture of experts' local experts as two grouped GEMMs (``GroupedExperts``).

megatron-core's local spec runs a rank's experts in ``SequentialMLP``: a Python loop over
them, each its own pair of GEMMs on its tokens, after reading the token counts on the host;
megatron-core groups them only through Transformer Engine (``TEGroupedMLP``), which mimo does
not use. ``GroupedExperts`` keeps ``SequentialMLP``'s parameters, names and checkpoints
(``local_experts.<e>.linear_fc1`` / ``linear_fc2``) and computes the same SwiGLU experts with
torch's ``grouped_mm`` (CPU and GPU): all experts' ``linear_fc1`` in one call, the gated
activation and router weights over all tokens, all ``linear_fc2`` in one. The stacked weights
are made in the forward pass and again in the backward (``_GroupedSwiGLU``) rather than kept
for it: a rank's experts are most of its weights.

It falls back to ``SequentialMLP``'s loop where the experts are not plain SwiGLU linears (LoRA
adapters on them, biases, another activation, quantized inputs), with one local expert
(already one GEMM each), and where ``grouped_mm`` does not run on the device in the weights'
dtype (``_runs``). Each expert is drawn from its own seed, so an expert-parallel rank's experts
start as one rank's would (megatron-core's loop draws every rank's alike).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP


def grouped_swiglu(tokens: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor,
                   fc1: list[torch.Tensor], fc2: list[torch.Tensor]) -> torch.Tensor:
    """Each expert ``e``'s ``fc2[e] (silu(gate) * up * probs)`` with ``[gate; up] = fc1[e]
    x`` on its rows of ``tokens`` (``counts[e]`` rows each, in order): megatron-core's
    unfused SwiGLU expert."""
    offsets = counts.to(device=tokens.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return _GroupedSwiGLU.apply(tokens, probs, offsets, len(fc1), *fc1, *fc2)


def _swiglu(hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    gate, up = hidden.chunk(2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(hidden.dtype)


class _GroupedSwiGLU(torch.autograd.Function):
    """``grouped_swiglu``'s forward and backward, saving the tokens, router weights and
    ``fc1``'s outputs (as the loop saves them), not the stacked weights."""

    @staticmethod
    def forward(ctx, tokens, probs, offsets, experts, *weights):
        fc1 = torch.stack(weights[:experts])                  # [E, 2f, h]
        hidden = F.grouped_mm(tokens, fc1.transpose(1, 2), offs=offsets)          # [T, 2f]
        fc2 = torch.stack(weights[experts:])                  # [E, h, f]
        ctx.save_for_backward(tokens, probs, offsets, hidden, *weights)
        ctx.experts = experts
        return F.grouped_mm(_swiglu(hidden, probs), fc2.transpose(1, 2), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        tokens, probs, offsets, hidden, *weights = ctx.saved_tensors
        experts = ctx.experts
        fc1, fc2 = torch.stack(weights[:experts]), torch.stack(weights[experts:])
        with torch.enable_grad():             # the activation's own backward, by autograd
            hidden_ = hidden.detach().requires_grad_()
            probs_ = probs.detach().requires_grad_(probs.requires_grad)
            activated = _swiglu(hidden_, probs_)
        grad = grad.contiguous()
        train = any(ctx.needs_input_grad[4:])     # frozen experts (LoRA elsewhere): no grads
        grad_activated = F.grouped_mm(grad, fc2, offs=offsets)                     # [T, f]
        inputs = [hidden_] + ([probs_] if probs.requires_grad else [])
        found = torch.autograd.grad(activated, inputs, grad_activated)
        grad_hidden = found[0]
        grad_probs = found[1] if probs.requires_grad else None
        grad_tokens = F.grouped_mm(grad_hidden, fc1, offs=offsets)                 # [T, h]
        if not train:
            return (grad_tokens, grad_probs, None, None, *[None] * len(weights))
        grad_fc1 = F.grouped_mm(grad_hidden.t(), tokens, offs=offsets)             # [E, 2f, h]
        grad_fc2 = F.grouped_mm(grad.t(), activated.detach(), offs=offsets)        # [E, h, f]
        return (grad_tokens, grad_probs, None, None,
                *grad_fc1.unbind(0), *grad_fc2.unbind(0))


_RUNS: dict[tuple[str, torch.dtype], bool] = {}


def _runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs forward and backward on ``device`` in ``dtype`` (tried
    once per process on a tiny problem: CUDA's kernels take some dtypes and GPUs only)."""
    key = (str(device), dtype)
    if key not in _RUNS:
        try:
            weights = [torch.randn(16, 8, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(2)]
            weights += [torch.randn(8, 8, device=device, dtype=dtype, requires_grad=True)
                        for _ in range(2)]
            tokens = torch.randn(16, 8, device=device, dtype=dtype, requires_grad=True)
            out = grouped_swiglu(tokens, torch.ones(16, device=device), torch.tensor([8, 8]),
                                 weights[:2], weights[2:])
            out.float().sum().backward()
            _RUNS[key] = bool(torch.isfinite(tokens.grad).all())
        except (RuntimeError, NotImplementedError, TypeError):
            _RUNS[key] = False
    return _RUNS[key]


class GroupedExperts(SequentialMLP):
    """``SequentialMLP`` (same parameters and checkpoints) whose SwiGLU experts run as grouped
    GEMMs (``grouped_swiglu``), each expert drawn from its own seed."""

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None,
                 name: str | None = None):
        # megatron-core's loop, each expert seeded from the RNG's state here (the same on
        # every expert-parallel rank: the layer's seed, then its attention's and router's
        # draws) and its global number: SequentialMLP draws each rank's experts on from that
        # state alike, so under ep2 expert 2 started as a copy of expert 0
        base = int(torch.randint(2 ** 40, ()))
        super().__init__(0, config, submodules, pg_collection, name)
        self.num_local_experts = num_local_experts
        first = self.ep_group.rank() * num_local_experts if self.ep_group is not None else 0
        for index in range(num_local_experts):
            torch.manual_seed(base + first + index)
            self.local_experts.append(MLP(
                self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size,
                is_expert=True, tp_group=pg_collection.expt_tp,
                name=f"{name}.local_experts.{index}" if name is not None else None))
        torch.manual_seed(base - 1)     # what the layer draws next (its shared expert) alike

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if not self._groups():
            return super().forward(permuted_local_hidden_states, tokens_per_expert,
                                   permuted_probs)
        experts = self.local_experts
        output = grouped_swiglu(
            permuted_local_hidden_states, permuted_probs, torch.as_tensor(tokens_per_expert),
            [e.linear_fc1.weight for e in experts], [e.linear_fc2.weight for e in experts])
        return output, None

    def _groups(self) -> bool:
        config = self.config
        if not (self.num_local_experts > 1 and config.gated_linear_unit
                and config.activation_func is F.silu and not config.add_bias_linear
                and not (config.fp8 or config.fp4 or config.moe_apply_probs_on_input)
                and config.activation_func_clamp_value is None
                and config.glu_linear_offset == 0
                and all(type(e.linear_fc1) is ColumnParallelLinear
                        and type(e.linear_fc2) is RowParallelLinear
                        for e in self.local_experts)):
            return False
        weight = self.local_experts[0].linear_fc1.weight
        return _runs(weight.device, weight.dtype)
