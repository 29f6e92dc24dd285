"""megatron-core's ``DistributedOptimizer`` over torch's Adam, without TransformerEngine or apex.

megatron-core 0.19.2 keeps Adam's step in each parameter's torch state on that path, and three
of its steps assume states it does not give (each function below, tested in
tests/test_train_cpu_compat.py):

- ``start_adam_states``: ``state_dict`` reads the step from every parameter's state
  (``distrib_optimizer.py:837``, ``assert len(steps) == 1``), which torch's Adam makes only at
  its first step: saving before it, or resuming (loading needs the state dict), fails;
- ``tolerate_partial_states``: loading copies every entry of each parameter's state from the
  checkpoint's, which never holds ``step`` (KeyError);
- ``unshare_steps``: loading gives every parameter one and the same step tensor, which torch's
  Adam then increments once per parameter at each step.

Each takes the module optimizer ``get_megatron_optimizer`` returns (chained or not) and acts on
its distributed optimizers over torch's Adam only.
"""

from __future__ import annotations

import torch

from mimo_train.mcore import DistributedOptimizer
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
