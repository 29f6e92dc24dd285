"""The towers' fused elementwise regions: the Qwen-family vision rotary, QuickGELU, and
Qwen2.5-VL's RMSNorm and gated SiLU.

transformers' Qwen-family vision attention (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) rotates
queries and keys in fp32 (``apply_rotary_pos_emb_vision``: casts, two products, a half
rotation by slices, a negation and a concatenation, a sum and a cast back, for each);
QuickGELU (Qwen2-VL's and CLIP's MLP: ``x * sigmoid(1.702 x)``) is three kernels keeping
their input, the sigmoid and the product; Qwen2.5-VL's eager RMSNorm six, keeping an fp32
copy of its input, and its gated MLP's SiLU and product two more. On a GPU each kernel is a
pass over a tower-sized tensor: in the H200 profile of the packed 8k case (~52k patches a
micro-batch, 32 layers) fp32 elementwise kernels came right after attention in the top
kernels, and the elementwise share was 26% of the step.

Here each is an autograd function whose forward and backward are pure formulas,
``torch.compile``'d (inductor, dynamic shapes: one kernel each way, whatever the patch count)
for CUDA tensors, as megatron-core compiles its own fused SwiGLU; elsewhere as written, the
same operations as transformers' code in the same order, so the CPU gives transformers' values.
No installed library does it: transformer-engine's and flash-attn's fused rotary are not in
mimo's lock, transformers offers no kernel hook for the vision rotary, and torch's fused
``rms_norm`` rounds once after the weight where transformers rounds before it.

Tolerance on a GPU: the forward passes compute in fp32 and round once (the rotary and the norm
as transformers does, but for the compiler's fused multiply-adds and reduction order: a bf16
unit in the last place on rare elements; QuickGELU and the gated SiLU round once where
transformers rounds after each operation: within two units). The backward passes compute the
same derivatives in fp32. Each fused region keeps its inputs alone (``planning.dims`` counts
them as megatron-core's layers keep theirs). tests/test_tower_fusions.py checks the values,
gradients and what is kept against transformers' own modules; the GPU check's
``tower_varlen`` probe checks the compiled kernels' rows on the GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from mimo_train.errors import EncoderBuildError

QUICK_GELU_SCALE = 1.702


# every shape at once (a new patch count recompiles nothing), in one graph
COMPILE_OPTIONS = {"dynamic": True, "fullgraph": True}


@functools.cache
def _compiled(function: Callable) -> Callable:
    return torch.compile(function, **COMPILE_OPTIONS)


def _on_device(function: Callable, tensor: torch.Tensor) -> Callable:
    """The compiled ``function`` for a CUDA ``tensor``, else ``function`` as written."""
    return _compiled(function) if tensor.is_cuda else function


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def unrotate_half(x: torch.Tensor) -> torch.Tensor:
    """The transpose of ``rotate_half``: what its backward pass does to a gradient."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' vision rotary, operation for operation."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q32, k32 = q.float(), k.float()
    return ((q32 * cos + rotate_half(q32) * sin).to(q.dtype),
            (k32 * cos + rotate_half(k32) * sin).to(k.dtype))


def rotary_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary``'s gradients with respect to ``q`` and ``k``, as autograd makes them (fp32)."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    gq, gk = grad_q.float(), grad_k.float()
    return ((gq * cos + unrotate_half(gq * sin)).to(grad_q.dtype),
            (gk * cos + unrotate_half(gk * sin)).to(grad_k.dtype))


class VisionRotary(torch.autograd.Function):
    """transformers' ``apply_rotary_pos_emb_vision``: ``q``, ``k`` ``[tokens, heads, dim]``,
    ``cos``, ``sin`` ``[tokens, dim]`` (fp32, no gradient) -> the rotated ``q``, ``k`` in
    their dtype. Keeps ``cos`` and ``sin`` (shared by every layer) for the backward pass."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _on_device(rotary, q)(q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        return *_on_device(rotary_backward, grad_q)(grad_q, grad_k, cos, sin), None, None


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``QuickGELUActivation``, operation for operation."""
    return x * torch.sigmoid(QUICK_GELU_SCALE * x)


def quick_gelu_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``quick_gelu``'s gradient, in fp32: σ(a·x) · (1 + a·x · (1 − σ(a·x)))."""
    x32 = x.float()
    gate = torch.sigmoid(QUICK_GELU_SCALE * x32)
    return (grad.float() * gate * (1 + QUICK_GELU_SCALE * x32 * (1 - gate))).to(grad.dtype)


class _QuickGELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _on_device(quick_gelu, x)(x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return _on_device(quick_gelu_backward, grad)(x, grad)


class QuickGELU(torch.nn.Module):
    """transformers' ``QuickGELUActivation``, fused on a GPU, keeping its input alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuickGELUFunction.apply(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen2_5_VLRMSNorm``, operation for operation."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm``'s gradients with respect to ``x`` and ``weight``, in fp32: with n the
    normalized x and r its reciprocal root mean square, dx = r · (d − n · mean(d · n)) for
    d = grad · weight; dweight sums grad · n over the tokens."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    grad32 = grad.float()
    grad_weight = (grad32 * normed.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)
    d = grad32 * weight.float()
    grad_x = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) \
        * (d - normed * (d * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _on_device(rms_norm, x)(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = _on_device(rms_norm_backward, grad)(x, weight, grad, ctx.eps)
        return grad_x, grad_weight if ctx.needs_input_grad[1] else None, None


class RMSNorm(torch.nn.Module):
    """transformers' ``Qwen2_5_VLRMSNorm`` (its ``weight``), fused on a GPU, keeping its
    input alone (transformers' keeps its fp32 copy and its normalized bf16 output too)."""

    def __init__(self, norm: torch.nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.variance_epsilon)


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers' gated MLP's middle, ``act_fn(gate_proj(x)) * up_proj(x)`` with SiLU."""
    return torch.nn.functional.silu(gate) * up


def silu_gate_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu_gate``'s gradients, in fp32: silu'(g) = σ(g) · (1 + g · (1 − σ(g)))."""
    gate32, up32, grad32 = gate.float(), up.float(), grad.float()
    sigmoid = torch.sigmoid(gate32)
    return ((grad32 * up32 * sigmoid * (1 + gate32 * (1 - sigmoid))).to(gate.dtype),
            (grad32 * gate32 * sigmoid).to(up.dtype))


class _SiLUGateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _on_device(silu_gate, gate)(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return _on_device(silu_gate_backward, grad)(gate, up, grad)


class GatedMLP(torch.nn.Module):
    """transformers' ``Qwen2_5_VLMLP`` (its three projections) with the SiLU and the product
    fused on a GPU, keeping the two projections' outputs (transformers' keeps the SiLU's
    output and the product too), as megatron-core's fused SwiGLU does."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SiLUGateFunction.apply(self.gate_proj(x), self.up_proj(x)))


class FusedRotaryAttention(torch.nn.Module):
    """transformers' Qwen-family vision attention (its ``qkv`` and ``proj`` layers, so the
    weights' names stay) with ``VisionRotary``, attending by transformers' attention function
    ``implementation``. The forward is transformers' (identical in the four families,
    transformers 5.17 to 5.24): one call with the items' boundaries for an implementation
    whose name says "flash" (``model.tower_attention``'s varlen among them), else one call
    per item."""

    def __init__(self, attention: torch.nn.Module, implementation: str):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.utils.generic import is_flash_attention_requested
        super().__init__()
        self.attend = ALL_ATTENTION_FUNCTIONS[implementation]
        self.by_boundaries = is_flash_attention_requested(
            requested_attention_implementation=implementation)
        self.qkv, self.proj = attention.qkv, attention.proj
        # what transformers' attention functions read of the module
        for key in ("num_heads", "head_dim", "scaling", "config", "attention_dropout",
                    "is_causal", "num_key_value_groups"):
            setattr(self, key, getattr(attention, key))

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor],
                max_seqlen: int | None = None, **kwargs) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1) \
            .permute(1, 0, 2, 3).unbind(0)
        q, k = VisionRotary.apply(q, k, *position_embeddings)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if self.by_boundaries:
            if max_seqlen is None:
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            out, _ = self.attend(self, q, k, v, None, scaling=self.scaling, dropout=0.0,
                            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                            max_length_q=max_seqlen, max_length_k=max_seqlen,
                            is_causal=False, **kwargs)
        else:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            out = torch.cat([self.attend(self, *item, None, scaling=self.scaling, dropout=0.0,
                                    is_causal=False, **kwargs)[0]
                             for item in zip(*(t.split(lengths, dim=2) for t in (q, k, v)))],
                            dim=1)
        return self.proj(out.reshape(tokens, -1).contiguous())


def _fused(module: torch.nn.Module) -> torch.nn.Module | None:
    """The fused counterpart of a transformers ``module``, if mimo has one."""
    from transformers.activations import QuickGELUActivation, SiLUActivation
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VLMLP,
                                                                    Qwen2_5_VLRMSNorm)
    if type(module) is QuickGELUActivation:
        return QuickGELU()
    if type(module) is Qwen2_5_VLRMSNorm:
        return RMSNorm(module)
    if type(module) is Qwen2_5_VLMLP and type(module.act_fn) in (SiLUActivation,
                                                                  torch.nn.SiLU):
        return GatedMLP(module)
    return None


def fuse(tower: torch.nn.Module, implementation: str, rotary_attention: bool) -> None:
    """Put the fused regions in a transformers ``tower`` served by the attention function
    ``implementation`` (what ``tower_attention.set_attention`` set): every QuickGELU,
    Qwen2.5-VL's RMSNorms and gated MLPs, and with ``rotary_attention``
    (``Encoder.vision_rotary``) each block's ``attn``."""
    for module in list(tower.modules()):
        for name, child in list(module.named_children()):
            fused = _fused(child)
            if fused is not None:
                setattr(module, name, fused)
    if not rotary_attention:
        return
    blocks = getattr(tower, "blocks", None)
    if blocks is None or not all(hasattr(getattr(block, "attn", None), key) for block in blocks
                                 for key in ("qkv", "proj", "num_heads", "scaling")):
        raise EncoderBuildError(f"{type(tower).__name__}'s blocks do not attend by the "
                                "Qwen-family vision attention mimo fuses (blocks[i].attn with "
                                "qkv and proj): a transformers version mimo does not know")
    for block in blocks:
        block.attn = FusedRotaryAttention(block.attn, implementation)
