"""megatron-core's ``MimoOptimizer.step`` with no value read on the host: ``step_on_device``.

megatron-core's step reads the world's gradient norm on the host (without TransformerEngine or
apex its ``get_grad_norm_fp32`` ends in ``.item()``, once per module optimizer, then once more
for the modules' sum) and clips with that float; it also makes every rank agree, each time with
a device tensor made from a host value and read back, on whether any rank found an inf (only a
loss scaler finds one) and whether every update succeeded (only a loss scaler fails one). Each
read waits for the GPU to run everything queued before it, so the GPU then idles while the host
dispatches what follows. mimo trains without a loss scaler (bf16 and fp32), so neither
agreement can disagree, and the norm need not reach the host for the step: ``step_on_device``
does megatron-core's work in its order with every value on the device:

- each module optimizer's norm squared: its own gradients for the norm and statistics group
  (``get_grads_for_grad_norm``, ``get_grad_stats_parallel_group``), megatron-core's
  multi-tensor norm (``clip_grads.l2_norm_impl``), squared and summed over that group as
  ``get_grad_norm_fp32`` does; the modules' squares, MAX over the ranks (a rank holding none of
  a module gives 0) and summed, the world norm their square root in fp32, as
  ``MimoOptimizer.get_grad_norm``;
- a non-finite flag beside the squares (1 infinite, 2 NaN), since the ranks' MAX does not carry
  a NaN (gloo's MAX(0, NaN) is 0, NCCL's is not defined): a NaN on the language ranks alone,
  under a tower frozen on ranks of its own, would otherwise step as a norm of 0; a sum past
  float32's range sets it too;
- the clipping coefficient ``clip_grad / (norm + 1e-6)`` computed in float64 as megatron-core's
  host float, at most 1, multiplied into the gradients megatron-core clips (``_foreach_mul_``;
  megatron-core's tensor path for this needs TransformerEngine or apex);
- the update skipped on the device where the flag is set: torch's fused AdamW (every torch
  Adam under mimo's optimizers: ``fused_adam``) takes the flag as ``found_inf``, as under
  torch's GradScaler: no weight, moment or step count moves; the model's weights are copied
  from unchanged main weights.

The norm and the flag come back as a device tensor ``[flag, norm]``: the trainer reads it one
step later (``training.trainer``), when the device has run it, and only then steps the
learning rates (not on a skipped step, as megatron-core's training loop). Bit for bit
megatron-core's norm, clipped gradients and weights (tests/test_train_cpu_compat.py).
"""

from __future__ import annotations

import torch
from megatron.core.models.mimo.optimizer import MimoOptimizer
from megatron.core.optimizer import clip_grads

from mimo_train.mcore.fused_adam import torch_adams

INFINITE, NAN = 1.0, 2.0          # the flag's values (0: finite)


@torch.no_grad()
def step_on_device(optimizer: MimoOptimizer) -> torch.Tensor:
    """Clip and update ``optimizer``'s modules (collective); the world's ``[non-finite flag,
    gradient norm]`` as a float32 device tensor, not read (flag set: nothing updated)."""
    if optimizer.config.fp16 or optimizer.config.loss_scale:
        raise ValueError("mimo's optimizer step has no loss scaler (bf16 and fp32 training); "
                         "this optimizer was built with one (fp16 or loss_scale)")
    optimizer.prepare_grads()         # without a loss scaler: main gradients, no inf looked for
    flag, norm = world_grad_norm(optimizer)
    skip = (flag > 0).float()
    for module in optimizer._active_optimizers:
        if getattr(module, "is_stub_optimizer", False):
            continue
        grads = _clipped_grads(module) if module.config.clip_grad > 0.0 else []
        if grads:
            coefficient = module.config.clip_grad / (norm.double() + 1.0e-6)
            torch._foreach_mul_(grads, torch.clamp(coefficient, max=1.0).float())
        for adam in _fused_adams(module):
            # torch's fused update reads it (as its GradScaler sets it)
            adam.found_inf = skip
    optimizer.step_with_ready_grads()
    return torch.stack([flag, norm])


def world_grad_norm(optimizer: MimoOptimizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(non-finite flag, the world's gradient norm) as float32 device scalars (collective)."""
    names = sorted(optimizer.module_infos)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    squares = torch.zeros(len(names), device=device, dtype=torch.float32)
    for i, name in enumerate(names):
        info = optimizer.module_infos[name]
        if info.is_active and info.optimizer:
            squares[i] = _norm_squared(info.optimizer, device)
    flags = torch.where(squares.isnan(), NAN, torch.where(squares.isinf(), INFINITE, 0.0))
    reduced = torch.cat([torch.where(flags > 0, 0.0, squares), flags.amax().reshape(1)])
    torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
    total = reduced[:-1].sum().sqrt()
    flag = torch.where((reduced[-1] == 0) & ~total.isfinite(), INFINITE, reduced[-1])
    norm = torch.where(flag == NAN, torch.nan, torch.where(flag == INFINITE, torch.inf, total))
    return flag, norm


def _norm_squared(optimizer, device: torch.device) -> torch.Tensor:
    """megatron-core's ``get_grad_norm`` of one module optimizer (chained or not), squared as
    ``MimoOptimizer.get_grad_norm`` squares it, on the device: ``get_grad_norm_fp32`` without
    its read. Parts that share a statistics group: their gradients together; parts that do not
    (a mixture of experts' dense and expert parts without the distributed optimizer): each
    part's norm, then ``ChainedOptimizer``'s root of their squares' sum, in float64 as its
    host floats."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(parts) == 1 or optimizer.grads_states_parallel_group_is_shared():
        grads = [grad for part in parts for grad in part.get_grads_for_grad_norm()]
        return _reduced_square(grads, parts[0].get_grad_stats_parallel_group(), device)
    norms = torch.stack([_reduced_square(part.get_grads_for_grad_norm(),
                                         part.get_grad_stats_parallel_group(),
                                         device).double().sqrt() for part in parts])
    return norms.pow(2).sum().sqrt().pow(2).float()


def _reduced_square(grads: list[torch.Tensor], group, device: torch.device) -> torch.Tensor:
    """The L2 norm of ``grads`` squared, summed over ``group``: a float32 device scalar."""
    square = torch.zeros(1, device=device, dtype=torch.float32)
    if grads:
        overflow = torch.zeros(1, dtype=torch.int, device=device)
        norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads],
                                                  False)
        square = norm ** 2
    torch.distributed.all_reduce(square, op=torch.distributed.ReduceOp.SUM, group=group)
    return square[0]


def _fused_adams(module) -> list[torch.optim.Optimizer]:
    """The torch Adams of ``module`` (a module optimizer), each with torch's fused update, the
    one that skips on ``found_inf``: an error where a part has another (TransformerEngine's or
    apex's ``FusedAdam``, or torch's unfused one), which would step a non-finite update."""
    parts = [part for part in getattr(module, "chained_optimizers", [module])
             if not getattr(part, "is_stub_optimizer", False)]
    adams = [adam for _, adam in torch_adams(module)]
    if len(adams) != len(parts) or not all(group.get("fused") for adam in adams
                                           for group in adam.param_groups):
        kinds = sorted({type(getattr(part, "optimizer", part)).__name__ for part in parts})
        raise RuntimeError(
            f"mimo's optimizer step skips a non-finite step on the device with torch's fused "
            f"AdamW (found_inf); this module's optimizer runs {kinds}, unfused or another "
            "Adam (TransformerEngine's or apex's are not supported here)")
    return adams


def _clipped_grads(module) -> list[torch.Tensor]:
    """The gradients megatron-core's clipping scales (``clip_grad_by_total_norm_fp32``):
    each parameter's ``decoupled_grad`` with the precision-aware optimizer, else its
    ``grad``."""
    decoupled = module.config.use_precision_aware_optimizer
    grads = []
    for param in module.get_parameters():
        grad = getattr(param, "decoupled_grad", None) if decoupled else param.grad
        if grad is not None:
            grads.append(grad.detach())
    return grads
