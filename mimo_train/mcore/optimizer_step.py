"""megatron-core's ``MimoOptimizer.step`` without its two agreements that cannot disagree.

megatron-core's step makes every rank agree, each with a device tensor made from a host value,
an all-reduce and a read back (two waits for the GPU each), on whether any rank found an inf or
a NaN in its gradients, and, after the update, on whether every rank's update succeeded. Only a
loss scaler (fp16, or a set ``loss_scale``) finds one or fails an update: without one (bf16 and
fp32, the only precisions mimo trains in) megatron-core's optimizers return False and True as
constants, so both agreements say what every rank knows. The second one also held the host
until the GPU had run the optimizer's update (its read waits for the whole queue) before the
next step could be dispatched. ``step`` is megatron-core's step without them where the config
makes no loss scaler; with one it is megatron-core's. The world's gradient norm (its one read),
the clipping, the zero count and the update are megatron-core's calls, in its order.
"""

from __future__ import annotations

import torch
from megatron.core.models.mimo.optimizer import MimoOptimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from mimo_train.mcore.cpu_compat import rescope_optimizer_method

MEGATRON_STEP = MimoOptimizer.step


@torch.no_grad()
def step(self: MimoOptimizer) -> tuple[bool, float | None, int | None]:
    """(success, the world's gradient norm, zeros or None), as megatron-core's step."""
    # a loss scaler: megatron-core makes one for fp16 or a set loss_scale (the run's config,
    # the same on every rank)
    if self.config.fp16 or self.config.loss_scale:
        return MEGATRON_STEP(self)
    self.prepare_grads()              # without a loss scaler: no inf looked for, False
    grad_norm = self.get_grad_norm()
    for opt in self._active_optimizers:
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer)
    num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
    return self.step_with_ready_grads(), grad_norm, num_zeros


def install() -> None:
    """``MimoOptimizer.step`` is ``step`` from now on (on the CPU under ``cpu_compat``'s
    device scope, as megatron-core's optimizer methods run there)."""
    MimoOptimizer.step = step
    rescope_optimizer_method(MimoOptimizer, "step")
