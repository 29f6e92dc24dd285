"""megatron-core's gradient norm and clipping without TransformerEngine or apex, on torch's
foreach kernels.

Without either package megatron-core falls back to ``local_multi_tensor_l2_norm``, which
turns every gradient's norm into a host float (``torch.tensor`` of a list of device scalars):
one device synchronization per parameter tensor, ~600 a step for a Qwen2-VL-2B-shaped model on
an H200 (the GPU check's profile), each stalling the queue of kernels. ``foreach_l2_norm``
computes the same norm with ``torch._foreach_norm`` and one ``vector_norm`` on the device (the
optimizer then reads the one total, as before; on the CPU each tensor's norm in float64: torch's
float32 CPU norm, the fallbacks' too, drifts with a tensor's size); ``foreach_scale`` clips with
``torch._foreach_mul`` (and the optimizer copies its main weights into the model's with
``torch._foreach_copy_``) instead of a Python loop of a multiplication and a copy per tensor.
Both keep the fallbacks' signatures (``(chunk_size, noop_flag, tensor_lists, ...)``, as
``amp_C``'s). In bf16 megatron-core's mixed-precision optimizer does not take that path for
the copy (it has no overflow buffer for bf16, and without one
``_multi_tensor_copy_this_to_that`` loops: a copy kernel per parameter tensor, 589 a step for
Qwen2-VL-2B, a third of its optimizer step's operators that are not views): ``foreach_copy``
does it with ``torch._foreach_copy_``. torch has the kernels, megatron-core only the
fallbacks' loops, hence these three functions.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import optimizer as megatron_optimizer

MEGATRON_COPY = megatron_optimizer._multi_tensor_copy_this_to_that    # before ``install``


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor,
                    tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
                    *args) -> tuple[torch.Tensor, None]:
    """The L2 norm of all tensors of ``tensor_lists[0]`` together, ``[1]`` fp32 on their
    device; no host read."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float), None
    # float64 on the CPU: torch's CPU norm adds a float32 tensor's squares in float32 along
    # long runs, off by ~1e-4 of a tensor of millions (a 151936 x 64 embedding's gradient
    # 2.3e-4 low); then each layout's norm, which splits that tensor differently (TP, the
    # distributed optimizer's shards), was off by its own amount, and so was the clipping
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64 if tensors[0].device.type
                                == "cpu" else None)
    # one stack (it promotes bf16 norms to fp32 exactly), not a cast a tensor
    total = torch.linalg.vector_norm(torch.stack(norms).float())
    return total.reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor,
                  tensor_lists: list[list[torch.Tensor]], scale: float) -> None:
    """``dst = src * scale`` for each pair of ``tensor_lists[0]`` (src), ``[1]`` (dst)."""
    sources, targets = tensor_lists[0], tensor_lists[1]
    if not sources:
        return
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    elif scale == 1.0:           # the main weights copied into the model's (bf16) ones
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def foreach_copy(this: list[torch.Tensor], that: list[torch.Tensor],
                 overflow_buf: torch.Tensor | None = None) -> None:
    """``that[i].copy_(this[i])`` for every pair (megatron-core's
    ``_multi_tensor_copy_this_to_that``'s signature), in torch's multi-tensor kernels."""
    if this:
        torch._foreach_copy_(that, this)


def install() -> bool:
    """``foreach_copy`` where megatron-core loops (without an overflow buffer, whatever is
    installed), and the norm and the clipping where megatron-core took its fallbacks (neither
    TransformerEngine nor apex installed): ``clip_grads`` and ``optimizer``; True when it
    replaced the fallbacks."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    optimizer._multi_tensor_copy_this_to_that = foreach_copy
    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return False
    clip_grads.l2_norm_impl = foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = foreach_scale
    optimizer.multi_tensor_scale_impl = foreach_scale
    return True
