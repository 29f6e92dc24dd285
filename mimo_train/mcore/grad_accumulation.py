"""megatron-core's gradient buffers fed the small gradients in multi-tensor additions, once a
backward pass.

megatron-core's DDP adds each parameter's gradient into its buffer (``main_grad``) from a hook
on the parameter's gradient accumulator: one ``add_`` a tensor and micro-batch. For Qwen2-VL-2B
that is 1,178 a step (589 tensors, 2 micro-batches), 690 of them for the 345 biases and norms'
weights of a few thousand values, where launching the kernel, not moving its bytes, is the cost
(the host's dispatch bounds mimo's step on an H200: docs/benchmarks.md). Here the hook keeps
each gradient of at most ``SMALL`` values and the end of the backward pass (autograd's final
callback, after its streams are joined) adds all it kept with torch's multi-tensor kernels: the
bf16 gradients cast into one fp32 staging buffer (``_foreach_copy_``, whose kernels take two
dtypes; ``_foreach_add_``'s fall back to a loop of one kernel a tensor when the dtypes differ),
then added (``_foreach_add_``): the same fp32 sums as megatron-core's ``add_``, bit for bit.
The larger gradients are added at once, as before (keeping them would hold their memory to the
end of the pass). With ``overlap_grad_reduce`` megatron-core's hook also marks the bucket
ready, which must follow the addition, so that setting keeps its hook as it is. megatron-core's
own remedy, ``gradient_accumulation_fusion`` (mimo gives it torch's ``addmm``:
``mcore.wgrad_fusion``), covers only its linear layers' weights, not the biases and norms,
hence this module.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.transformer.cuda_graphs import is_graph_capturing

SMALL = 1 << 18                  # values: up to here a kernel's launch outweighs its bytes
MEGATRON_HOOK = DistributedDataParallel._make_backward_post_hook

# the (buffer, gradient) pairs kept, by autograd's graph task (a reentrant recompute's inner
# backward pass is a task of its own); the hooks may run on autograd's device threads
_kept: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
_lock = threading.Lock()


def add_kept(task: int) -> None:
    """Add the gradients kept during graph task ``task`` into their buffers."""
    with _lock:
        pairs = _kept.pop(task, [])
    groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for buffer, grad in pairs:
        groups[buffer.dtype, grad.dtype, buffer.device].append((buffer, grad))
    for (dtype, grad_dtype, device), group in groups.items():
        buffers, grads = [b for b, _ in group], [g for _, g in group]
        if grad_dtype != dtype:
            staging = torch.empty(sum(g.numel() for g in grads), dtype=dtype, device=device)
            cast = [part.view(g.shape) for part, g in
                    zip(staging.split([g.numel() for g in grads]), grads)]
            torch._foreach_copy_(cast, grads)
            grads = cast
        torch._foreach_add_(buffers, grads)


def _batched_hook(ddp: DistributedDataParallel, param: torch.nn.Parameter) -> Callable:
    """megatron-core's hook for ``param``, keeping its gradient for ``add_kept`` when it is
    small and megatron-core's would only add it."""
    megatron = MEGATRON_HOOK(ddp, param)
    if ddp.ddp_config.overlap_grad_reduce or param.numel() > SMALL:
        return megatron

    def hook(*unused) -> None:
        task = torch._C._current_graph_task_id()     # -1 outside a backward pass
        if (task < 0 or param.grad is None or param not in ddp.param_to_bucket_group
                or is_graph_capturing() or (getattr(param, "grad_added_to_main_grad", False)
                                            and not getattr(param, "zero_out_wgrad", False))):
            megatron()
            return
        grad, param.grad = param.grad.data, None
        with _lock:
            kept = _kept.setdefault(task, [])
            kept.append((param.main_grad, grad))
            first = len(kept) == 1
        if first:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: add_kept(task))
    return hook


def install() -> None:
    """megatron-core's DDP makes its gradient hooks with ``_batched_hook`` from now on."""
    DistributedDataParallel._make_backward_post_hook = _batched_hook
