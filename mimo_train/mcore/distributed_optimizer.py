"""megatron-core's ``DistributedOptimizer`` over torch's Adam, without TransformerEngine or apex.

megatron-core 0.19.2 keeps Adam's step in each parameter's torch state on that path, and four
of its steps assume states it does not give (each function below, tested in
tests/test_train_cpu_compat.py; the last in a run too, tests/test_qwen3_vl.py's MoE resume):

- ``start_adam_states``: ``state_dict`` reads the step from every parameter's state
  (``distrib_optimizer.py:837``, ``assert len(steps) == 1``), which torch's Adam makes only at
  its first step: saving before it, or resuming (loading needs the state dict), fails;
- ``tolerate_partial_states``: loading copies every entry of each parameter's state from the
  checkpoint's, which never holds ``step`` (KeyError);
- ``unshare_steps``: loading gives every parameter one and the same step tensor, which torch's
  Adam then increments once per parameter at each step;
- ``without_empty_parts``: building an optimizer aligns its parameter groups over the whole
  world (``_get_param_groups``' ``all_gather_object``), one model's way: a module without
  experts whose ranks build their optimizer while others build a mixture-of-experts module's
  (a tower on ranks of its own) gets an expert part holding no parameter, whose
  ``state_dict`` finds no step (the assert above: the first save fails).

Each takes the module optimizer ``get_megatron_optimizer`` returns (chained or not) and acts on
its distributed optimizers over torch's Adam only.
"""

from __future__ import annotations

import torch

from mimo_train.mcore import ChainedOptimizer, DistributedOptimizer
from mimo_train.mcore.fused_adam import torch_adams


def _torch_adams(optimizer):
    """(distributed optimizer, its torch Adam) for each such part of ``optimizer``."""
    return [(inner, adam) for inner, adam in torch_adams(optimizer)
            if isinstance(inner, DistributedOptimizer)]


def start_adam_states(optimizer) -> None:
    """Give every torch Adam under a distributed optimizer the state its first step would
    start from (zero moments, step 0), so that its state dict exists before that step. The
    first update is torch's from a fresh state, unchanged."""
    for _, adam in _torch_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                if not adam.state[param]:
                    adam.state[param].update(
                        step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                        exp_avg_sq=torch.zeros_like(param))


class _Absent(dict):
    """A parameter's loaded state whose absent entries read as None (not a tensor: skipped)."""

    def __missing__(self, key):
        return None


def tolerate_partial_states(optimizer) -> None:
    """Let each distributed optimizer's load skip what the checkpoint does not give: its
    ``_set_main_param_and_optimizer_states`` copies every entry of torch Adam's state from
    the loaded ones, which never hold ``step`` (``load_parameter_state_from_fully_reshardable``
    leaves it out), nor ``param`` when the checkpoint was saved without the distributed
    optimizer (the main weights are then the loaded weights: ``checkpoint.load``). An instance
    patch: other optimizers keep megatron-core's method."""
    for inner, _ in _torch_adams(optimizer):
        set_states = inner._set_main_param_and_optimizer_states

        def set_main_param_and_optimizer_states(model_param, tensors, set_states=set_states):
            return set_states(model_param, _Absent(tensors))
        inner._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states


def unshare_steps(optimizer) -> None:
    """After a load: each parameter's own Adam step. ``load_state_dict`` gives every
    parameter's state one and the same step tensor (``distrib_optimizer.py:1027``), which torch's
    Adam increments in place once per parameter at each step: from the second parameter on,
    the bias correction would use a step far too large."""
    for _, adam in _torch_adams(optimizer):
        for state in adam.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def without_empty_parts(optimizer, module: torch.nn.Module):
    """``optimizer`` (chained) without its parts for a kind of parameter ``module`` has none of
    (expert-parallel or not): decided by the module's own trained parameters, alike on all of
    its ranks."""
    kinds = {not getattr(p, "allreduce", True) for p in module.parameters() if p.requires_grad}
    if not kinds or not isinstance(optimizer, ChainedOptimizer):
        return optimizer
    kept = [part for part in optimizer.chained_optimizers
            if any(group.get("is_expert_parallel", False) in kinds
                   for group in part.param_groups)]
    return optimizer if len(kept) == len(optimizer.chained_optimizers) else \
        ChainedOptimizer(kept)
