"""torch's fused AdamW under megatron-core's optimizers, on every device.

Without TransformerEngine or apex (none is installed on CPU, nor on the GPU machines this
project checks on) megatron-core 0.19.2 builds torch's ``AdamW`` with torch's defaults
(``optimizer/__init__.py``: ``adam_cls(**kwargs)``, no ``fused``), which pick the foreach
implementation on a GPU and a loop over the parameters on the CPU: on a GPU about ten
multi-tensor kernels a step, each reading and writing every fp32 main weight or moment, and a
transient copy of all second moments (``_foreach_sqrt``: as many bytes as the module's main
weights, 6 GB for Qwen2-VL-2B's language model) at the peak of the step. megatron-core's usual
path (TransformerEngine's or apex's ``FusedAdam``) and the GPU check's peer
(``torch.optim.AdamW(fused=True)``) make the whole update one kernel with no copy.
``use_fused_adam`` turns on torch's ``fused`` for every torch Adam under a megatron-core
optimizer, so the CPU runs the same kernel family the GPU does (torch has one for each) and the
CPU tests check the update a GPU run makes. torch's fused update keeps each step count on its
parameter's device (torch's note "special device hosting for step"): the steps go there.

A checkpoint's param groups carry the saving run's options, and torch's ``load_state_dict``
takes them over the loading optimizer's: ``components.checkpoint`` calls ``use_fused_adam``
again after a load (a checkpoint saved before this was on resumes fused).
"""

from __future__ import annotations

import torch


def torch_adams(optimizer) -> list[tuple[object, torch.optim.Optimizer]]:
    """(megatron-core optimizer, its torch Adam) for each part of ``optimizer`` (chained or
    not: distributed, mixed-precision or fp32) that runs torch's Adam."""
    found = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if isinstance(adam, (torch.optim.Adam, torch.optim.AdamW)):
            found.append((inner, adam))
    return found


def use_fused_adam(optimizer) -> None:
    """Every torch Adam under ``optimizer`` (megatron-core's) takes torch's fused update from
    its next step on, its step counts on their parameters' devices."""
    for _, adam in torch_adams(optimizer):
        for group in adam.param_groups:
            group["fused"], group["foreach"] = True, False
        for param, state in adam.state.items():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.to(device=param.device, dtype=torch.float32)
