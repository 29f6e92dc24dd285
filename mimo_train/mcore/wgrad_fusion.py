"""megatron-core's gradient-accumulation fusion without apex: a linear layer's weight gradient
made straight into its fp32 buffer (``main_grad``) by the GEMM that computes it.

Without it (``gradient_accumulation_fusion=False``, all megatron-core allows without apex's
``fused_weight_gradient_mlp_cuda``) each of the language model's linear weights gets its
gradient in the run's dtype, a ``[out, in]`` bf16 tensor rounded from the GEMM's fp32 sums,
which DDP's hook then adds into ``main_grad`` with one ``add_``: per weight and micro-batch a
second kernel, the bf16 gradient written by the GEMM and read by the ``add_`` (4 bytes a
weight value; the fp32 buffer is read and written either way), and the bf16 rounding of every
micro-batch's gradient before it is summed. With it megatron-core's linear backward hands
``(input, grad_output, main_grad)`` to ``accumulate``, which computes
``main_grad += grad_output^T input`` in one GEMM whose accumulator and output are fp32 (torch's
``addmm`` with ``out_dtype`` on CUDA; on the CPU, which has no such kernel, the same products
of bf16 values summed in fp32 after casting them), and DDP's hook adds nothing for those
weights. For Qwen2-VL-2B's language model (1.31B linear weight values, the tied embedding's
output layer apart) that is ~5 GB of memory traffic and 112 kernels a micro-batch fewer.
TransformerEngine's fusion does the same with its own GEMM; neither it nor apex is in mimo's
lock, hence this module.

``install`` gives megatron-core's linear layers this module in apex's place; ``supported``
says whether the device runs it (on CUDA a small call checked against its fp32 product, once a
process: torch's ``addmm`` takes an fp32 addend with bf16 factors only in recent versions),
and ``model.build`` sets ``gradient_accumulation_fusion`` from it. The encoders' layers are
transformers' ``torch.nn.Linear`` (Qwen2-VL-2B's tower: 130 weights, 0.66B values, its 32
blocks' four and its merger's two), which megatron-core's fusion does not reach:
``fuse_linears`` makes them ``WgradLinear``, whose backward pass does the same as
megatron-core's (the buffer filled by ``accumulate``, a placeholder handed to autograd so that
DDP's hook runs and adds nothing: unfilled, zeros under ``zero_out_wgrad``); a weight another
module also holds stays unfused.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel import layers


def accumulate(total_input: torch.Tensor, grad_output: torch.Tensor,
               main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T total_input`` (``[tokens, out]``, ``[tokens, in]``, both
    in the run's dtype, into ``[out, in]``), accumulated and added in ``main_grad``'s dtype."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype,
                    out=main_grad)
    else:           # the CPU has no mixed-dtype GEMM: bf16 values are exact in fp32
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


class _Kernels:
    """What megatron-core calls on apex's ``fused_weight_gradient_mlp_cuda`` (its
    ``_fp32``/``_fp16`` name the buffer's dtype; the same call serves both)."""

    wgrad_gemm_accum_fp32 = staticmethod(accumulate)
    wgrad_gemm_accum_fp16 = staticmethod(accumulate)


class _WgradLinearFunction(torch.autograd.Function):
    """``torch.nn.functional.linear`` whose weight gradient goes into ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        # the parameter itself: a saved tensor may come back as another object (transformers'
        # gradient checkpointing hands back a detached copy), without its buffer
        ctx.parameter = weight
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        parameter = ctx.parameter
        rows = grad_output.reshape(-1, grad_output.size(-1))
        accumulate(input.reshape(-1, input.size(-1)), rows, parameter.main_grad)
        parameter.grad_added_to_main_grad = True
        # what autograd accumulates and DDP's hook then drops (megatron-core's linear layers
        # hand back the same): an unfilled tensor, zeros where the hook adds it anyway
        placeholder = (torch.zeros_like if getattr(parameter, "zero_out_wgrad", False)
                       else torch.empty_like)(weight)
        # the input's and bias's only where asked for (a frozen tower's projection: no input
        # gradient), as torch.nn.Linear's backward does
        return (grad_output.matmul(weight) if ctx.needs_input_grad[0] else None, placeholder,
                rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None)


class WgradLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` whose trained weight, once megatron-core's DDP gave it its
    buffer, gets its gradient made into it (``accumulate``); else ``torch.nn.Linear``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if torch.is_grad_enabled() and weight.requires_grad and hasattr(weight, "main_grad"):
            return _WgradLinearFunction.apply(input, weight, self.bias)
        return super().forward(input)


def fuse_linears(module: torch.nn.Module) -> int:
    """Make every ``torch.nn.Linear`` (that exact class) under ``module`` a ``WgradLinear``
    whose weight no other module holds; how many. A weight's gradient made into its buffer
    must be all of it: DDP's hook drops whatever else autograd gathered for that weight in the
    step (the flag stays set until the buffers are zeroed), so a shared weight (tied, or a
    module's weight held by another) keeps ``torch.nn.Linear``. The towers read their linear
    layers' weights through the layers alone."""
    holders: dict[int, int] = {}
    for _, parameter in module.named_parameters(remove_duplicate=False):
        holders[id(parameter)] = holders.get(id(parameter), 0) + 1
    linears = [m for m in module.modules()
               if type(m) is torch.nn.Linear and holders[id(m.weight)] == 1]
    for linear in linears:
        linear.__class__ = WgradLinear
    return len(linears)


@functools.cache
def _runs_on(device: str) -> bool:
    # 1 + 2^-7 and the like: bf16 values whose products need twice their 8 bits, exact in
    # fp32, so a kernel that rounded them to bf16 would not give the expected sums
    factors = (1 + torch.arange(1, 7, device=device).view(3, 2) / 128).to(torch.bfloat16)
    buffer = torch.ones(2, 2, dtype=torch.float32, device=device)
    try:
        accumulate(factors, factors, buffer)
    except (RuntimeError, TypeError):
        return False
    expected = 1 + factors.float().t() @ factors.float()
    return bool(torch.equal(buffer, expected))


def supported(device: torch.device | str) -> bool:
    """Whether ``accumulate`` runs on ``device`` with bf16 factors and an fp32 buffer, summing
    unrounded (always on the CPU)."""
    device = torch.device(device)
    return device.type == "cpu" or _runs_on(str(device))


def install() -> None:
    """megatron-core's linear layers take ``gradient_accumulation_fusion`` with this module's
    kernels from now on."""
    layers.fused_weight_gradient_mlp_cuda = _Kernels
    layers._grad_accum_fusion_available = True
