"""The towers' fused elementwise regions: the Qwen-family vision rotary, QuickGELU, and
Qwen2.5-VL's RMSNorm and gated SiLU; and the Qwen-family patch embedding as a matmul
(``PatchMatmul``).

transformers writes each as a chain of small operations, every one a pass over a tower-sized
tensor on a GPU: the vision rotary (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) casts queries and
keys to fp32 and rotates them in seven more, and the gradients of the queries, keys and values
split from the fused projection's output are stacked and copied back to its layout, two
passes more; QuickGELU (Qwen2-VL's and CLIP's MLP) is three kernels keeping their input and
the sigmoid; Qwen2.5-VL's eager RMSNorm six, keeping an fp32 copy of its input, and its gated
MLP's SiLU and product two more (docs/benchmarks.md: the H200 profile these come from).

Here each is an autograd function whose forward and backward are pure formulas, compiled by
``COMPILER`` for CUDA tensors (inductor: one kernel for each pointwise formula; the RMSNorm's
backward reduces over the width and, for its weight, over the tokens), as megatron-core
compiles its own fused SwiGLU; elsewhere run as written, transformers' operations in its
order, so the CPU gives transformers' rows. No installed library does it: transformer-engine's
and flash-attn's fused rotary are not in mimo's lock, transformers has no kernel hook for the
vision rotary, and torch's fused ``rms_norm`` rounds once after the weight where transformers
rounds before it.

Tolerance on a GPU: the forward passes compute in fp32 and round once (the rotary and the norm
as transformers does, but for the compiler's fused multiply-adds and reduction order: a bf16
unit in the last place on rare elements; QuickGELU and the gated SiLU where transformers rounds
after each operation: within two units); the backward passes compute the same derivatives in
fp32. QuickGELU, the norm and the gated SiLU keep their inputs alone for the backward pass
(``planning.dims`` counts them as megatron-core's layers), the rotary its tables (the
attention's values a contiguous copy, not a view keeping the whole projection's output).
tests/test_tower_fusions.py checks rows, gradients, what is kept and the compilations; the GPU
check's ``fusions`` probe each compiled kernel against its formula as written.
"""

from __future__ import annotations

import torch

from mimo_data.errors import listed
from mimo_train.errors import EncoderBuildError
from mimo_train.runtime.compile import Compiler

QUICK_GELU_SCALE = 1.702

# transformers' Qwen-family vision attention classes (module, name), whose forward
# ``FusedRotaryAttention`` repeats (the same in each, transformers 5.17 to 5.24)
VISION_ATTENTION = frozenset(
    (f"transformers.models.{family}.modeling_{family}", name) for family, name in (
        ("qwen2_vl", "VisionAttention"), ("qwen2_5_vl", "Qwen2_5_VLVisionAttention"),
        ("qwen3_vl", "Qwen3VLVisionAttention"), ("qwen3_vl_moe", "Qwen3VLMoeVisionAttention"),
        ("qwen3_5", "Qwen3_5VisionAttention"), ("qwen3_5_moe", "Qwen3_5MoeVisionAttention")))


# transformers' Qwen-family vision patch embeddings (module, name), whose forward
# ``PatchMatmul`` repeats (the same in each, transformers 5.17 to 5.24)
VISION_PATCH_EMBED = frozenset(
    (f"transformers.models.{family}.modeling_{family}", name) for family, name in (
        ("qwen2_vl", "PatchEmbed"), ("qwen2_5_vl", "Qwen2_5_VisionPatchEmbed"),
        ("qwen3_vl", "Qwen3VLVisionPatchEmbed"), ("qwen3_vl_moe", "Qwen3VLMoeVisionPatchEmbed"),
        ("qwen3_5", "Qwen3_5VisionPatchEmbed"), ("qwen3_5_moe", "Qwen3_5MoeVisionPatchEmbed")))


COMPILER = Compiler()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half`` (its module is not imported here: ``mimo-train`` starts
    without transformers until a model is built)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb_vision``, operation for operation."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q32, k32 = q.float(), k.float()
    return ((q32 * cos + rotate_half(q32) * sin).to(q.dtype),
            (k32 * cos + rotate_half(k32) * sin).to(k.dtype))


def rotary_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary``'s gradients with respect to ``q`` and ``k``, as autograd makes them (fp32;
    the half rotation's transpose is its negation)."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    gq, gk = grad_q.float(), grad_k.float()
    return ((gq * cos - rotate_half(gq * sin)).to(grad_q.dtype),
            (gk * cos - rotate_half(gk * sin)).to(grad_k.dtype))


def split_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers' split of the fused projection's output ``qkv`` ``[tokens, 3, heads,
    dim]`` into queries, keys and values, ``rotary`` on the first two; the values a contiguous
    copy (what the varlen kernel takes: one pass with the rotary's on a GPU; a copy also of a
    single token's, so no output is a view of ``qkv``)."""
    q, k, v = qkv.unbind(1)
    return *rotary(q, k, cos, sin), v.clone(memory_format=torch.contiguous_format)


def split_rotary_backward(grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``split_rotary``'s gradient with respect to ``qkv``, written once in its layout:
    autograd would stack the three gradients on a new first dimension (transformers' permute)
    and copy that back to the projection's layout, two more passes over it."""
    return torch.stack((*rotary_backward(grad_q, grad_k, cos, sin), grad_v), dim=1)


class _SplitRotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin):
        ctx.save_for_backward(cos, sin)
        return COMPILER(split_rotary, qkv, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        cos, sin = ctx.saved_tensors
        return COMPILER(split_rotary_backward, grad_q, grad_k, grad_v, cos, sin), None, None


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
        return COMPILER(quick_gelu, x)

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return COMPILER(quick_gelu_backward, x, grad)


class QuickGELU(torch.nn.Module):
    """transformers' ``QuickGELUActivation``, fused, keeping its input alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _QuickGELUFunction.apply(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen2_5_VLRMSNorm``, operation for operation."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _normalized(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in fp32 over its root mean square, and the reciprocal of that root."""
    x32 = x.float()
    reciprocal = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * reciprocal, reciprocal


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float
                      ) -> torch.Tensor:
    """``rms_norm``'s gradient with respect to ``x``, in fp32: with n the normalized x and r
    the reciprocal root, d = grad · weight, dx = r · (d − n · mean(d · n))."""
    normed, reciprocal = _normalized(x, eps)
    d = grad.float() * weight.float()
    return (reciprocal * (d - normed * (d * normed).mean(-1, keepdim=True))).to(x.dtype)


def rms_norm_weight_backward(x: torch.Tensor, grad: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm``'s gradient with respect to its weight: grad · n (rounded as the forward
    rounds it) summed over the tokens in fp32."""
    normed, _ = _normalized(x, eps)
    return (grad.float() * normed.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return COMPILER(rms_norm, x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_weight = COMPILER(rms_norm_weight_backward, x, grad, ctx.eps).to(weight.dtype) \
            if ctx.needs_input_grad[1] else None
        return COMPILER(rms_norm_backward, x, weight, grad, ctx.eps), grad_weight, None


class RMSNorm(torch.nn.Module):
    """transformers' ``Qwen2_5_VLRMSNorm`` (its ``weight``), fused, keeping its input alone
    (transformers' keeps an fp32 copy and the normalized output too)."""

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
        return COMPILER(silu_gate, gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return COMPILER(silu_gate_backward, gate, up, grad)


class GatedMLP(torch.nn.Module):
    """transformers' ``Qwen2_5_VLMLP`` (its three projections) with the SiLU and the product
    fused, keeping the two projections' outputs (transformers' keeps the SiLU's output and
    the product too), as megatron-core's fused SwiGLU does."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SiLUGateFunction.apply(self.gate_proj(x), self.up_proj(x)))


class PatchMatmul(torch.nn.Module):
    """transformers' Qwen-family patch embedding (its ``proj``, so the weight keeps its name)
    as the matmul it is, on ``devices``: its Conv3d's stride is its kernel, so each patch's
    ``C·T·P·P`` values meet the kernel once, a ``[patches, C·T·P·P] x [C·T·P·P, width]``
    product. cuDNN's 3-D convolutions of that shape have been reported 10-18x slower than
    the product on a Hopper GPU and up to 50,000x in bf16 on Blackwell ones, and PyTorch 2.9
    fell back to a slow kernel for them (docs/training.md); transformers' own remedy (its
    ``fusion_config``) renames the weight. Elsewhere transformers' Conv3d, so the CPU gives
    its rows bit for bit; the product sums in another order (fp32: to 1e-5)."""

    devices: tuple[str, ...] = ("cuda",)

    def __init__(self, embed: torch.nn.Module):
        super().__init__()
        self.proj = embed.proj
        self.in_channels, self.embed_dim = embed.in_channels, embed.embed_dim
        self.temporal_patch_size, self.patch_size = embed.temporal_patch_size, embed.patch_size

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if hidden_states.device.type in self.devices:
            return torch.nn.functional.linear(
                hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype),
                weight.flatten(1), self.proj.bias)
        hidden_states = hidden_states.view(-1, self.in_channels, self.temporal_patch_size,
                                           self.patch_size, self.patch_size)
        return self.proj(hidden_states.to(dtype=weight.dtype)).view(-1, self.embed_dim)


def _patchwise(conv: torch.nn.Module) -> bool:
    """Whether ``conv`` is a Conv3d projecting each patch alone (stride its kernel)."""
    return isinstance(conv, torch.nn.Conv3d) and conv.stride == conv.kernel_size and \
        conv.padding == (0, 0, 0) and conv.dilation == (1, 1, 1) and conv.groups == 1


class FusedRotaryAttention(torch.nn.Module):
    """transformers' Qwen-family vision attention (its ``qkv`` and ``proj`` layers, so the
    weights' names stay) with the queries, keys and values split from the projection's output
    and rotated in one fused formula (``split_rotary``), attending by transformers' attention
    function ``implementation``. The forward is transformers' (``VISION_ATTENTION``): one call
    with the items' boundaries for an implementation whose name says "flash"
    (``model.tower_attention``'s varlen among them), else one call per item."""

    def __init__(self, attention: torch.nn.Module, implementation: str):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.utils.generic import is_flash_attention_requested
        super().__init__()
        if implementation not in ALL_ATTENTION_FUNCTIONS:
            raise EncoderBuildError(f"the tower's attention {implementation!r} is not one of "
                                    f"transformers' attention functions "
                                    f"{listed(sorted(ALL_ATTENTION_FUNCTIONS))}")
        self.attend = ALL_ATTENTION_FUNCTIONS[implementation]
        self.by_boundaries = is_flash_attention_requested(
            requested_attention_implementation=implementation)
        self.qkv, self.proj = attention.qkv, attention.proj
        self.num_heads, self.scaling = attention.num_heads, attention.scaling
        # what transformers' attention functions read of the module
        self.config, self.is_causal = attention.config, attention.is_causal
        self.num_key_value_groups = attention.num_key_value_groups

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor],
                max_seqlen: int | None = None, **kwargs) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        q, k, v = _SplitRotaryFunction.apply(
            self.qkv(hidden_states).reshape(tokens, 3, self.num_heads, -1),
            *position_embeddings)
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
            out = torch.cat([self.attend(self, *item, None, scaling=self.scaling,
                                         dropout=0.0, is_causal=False, **kwargs)[0]
                             for item in zip(*(t.split(lengths, dim=2) for t in (q, k, v)))],
                            dim=1)
        return self.proj(out.reshape(tokens, -1).contiguous())


def _fused(module: torch.nn.Module, implementation: str) -> torch.nn.Module | None:
    """The fused counterpart of a transformers ``module``, if mimo has one."""
    from transformers.activations import QuickGELUActivation, SiLUActivation
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VLMLP,
                                                                    Qwen2_5_VLRMSNorm)
    kind = (type(module).__module__, type(module).__qualname__)
    if kind in VISION_ATTENTION:
        return FusedRotaryAttention(module, implementation)
    if kind in VISION_PATCH_EMBED and _patchwise(module.proj):
        return PatchMatmul(module)
    if type(module) is QuickGELUActivation:
        return QuickGELU()
    if type(module) is Qwen2_5_VLRMSNorm:
        return RMSNorm(module)
    if type(module) is Qwen2_5_VLMLP:
        if type(module.act_fn) not in (SiLUActivation, torch.nn.SiLU):
            raise EncoderBuildError(f"a Qwen2.5-VL tower MLP with {type(module.act_fn).__name__}"
                                    ": mimo fuses its gated SiLU (the published hidden_act "
                                    "silu) only; set vision_config.hidden_act: silu")
        return GatedMLP(module)
    return None


def fuse(tower: torch.nn.Module, implementation: str) -> None:
    """Put the fused regions in a transformers ``tower`` served by the attention function
    ``implementation`` (what ``tower_attention.set_attention`` set): in place of every
    Qwen-family vision attention and patch embedding, QuickGELU, and Qwen2.5-VL RMSNorm and
    gated MLP."""
    for module in list(tower.modules()):
        for name, child in list(module.named_children()):
            fused = _fused(child, implementation)
            if fused is not None:
                setattr(module, name, fused)
