"""The optimizers' saved state across the forms megatron-core gives it, so that a checkpoint
resumes under any layout and optimizer setting (``components.checkpoint`` saves and loads it):

- ``OPTIMIZER_METADATA``: how megatron-core's optimizers write their state;
- ``main_weights_from``: the fp32 main weights read from wherever the saving run's optimizer
  kept them (with or without the distributed optimizer);
- ``common_as``: the unsharded state (param groups, step) in the loading optimizer's form:
  distributed or plain, one optimizer or the chain a mixture of experts' experts get;
- ``settings_as``: the saved param groups given this run's LR bounds and Adam betas.
"""

from __future__ import annotations

import torch

from mimo_train.errors import CheckpointError
from mimo_train.mcore import param_group_identifier_keys

# megatron-core's distributed optimizer (``optimizer.distributed``) saves its state as a plain
# optimizer's, one tensor per parameter, gathered on its DP rank 0 ("fully_reshardable"): it
# loads under any layout and with or without the distributed optimizer. Its default format
# ("fully_sharded_model_space", deprecated) writes flattened ranges, which megatron-core 0.19's
# distributed checkpoints refuse ("ShardedTensor.flattened_range is not supported").
# The other optimizers ignore it.
# A mixture of experts' optimizer is a chain (the dense parameters', the experts') where its
# experts have groups of their own (expert parallelism, or expert TP other than TP), one
# optimizer otherwise: its tensors keep their names either way ("chained_optim_avoid_prefix"),
# and ``common_as`` moves the param groups between the two forms.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                      "chained_optim_avoid_prefix": True}


# Where the optimizers keep their fp32 main weights: megatron-core's distributed optimizer
# ("fully_reshardable") as optimizer.state.param.KEY, its mixed-precision optimizer as
# optimizer.state.fp32_param.KEY, the fp32 optimizer in the model weights (KEY) themselves.
_MAIN_WEIGHTS = ("optimizer.state.param.", "optimizer.state.fp32_param.")


def main_weights_from(optimizers: dict, saved) -> list[str]:
    """Let this run's optimizers read their main weights from where the saving run's kept
    them (``_MAIN_WEIGHTS``), so a checkpoint resumes with or without the distributed
    optimizer (``optimizer.distributed``): a main weight the checkpoint lacks under its own
    key is read from the other optimizer's key; without one (the saving run's optimizer kept
    them in the weights: fp32), it is left out and the optimizer takes the loaded weights
    (``reload_model_params``). Returns the names of the modules whose optimizers must."""
    reload = []
    for name, optimizer in optimizers.items():
        for node in _dicts(optimizer):
            for field, tensor in list(node.items()):
                key = getattr(tensor, "key", None)
                prefix = next((p for p in _MAIN_WEIGHTS if key and key.startswith(p)), None)
                if key is None or prefix is None or key in saved:
                    continue
                weight = key[len(prefix):]
                other = next((f"{p}{weight}" for p in _MAIN_WEIGHTS if f"{p}{weight}" in saved),
                             None)
                if other is not None:
                    tensor.key = other
                    continue
                del node[field]
                if name not in reload:
                    reload.append(name)
    return reload


def common_as(saved: dict, own: dict) -> dict:
    """An optimizer's unsharded state (param groups, step) as saved, in the form of this run's
    (``own``: the loading optimizer's own unsharded state). Either may be megatron-core's chain
    (``{index: state}``, ``OPTIMIZER_METADATA``) or one optimizer; where the forms or the
    groups differ, each of this run's param groups takes the saved settings (and step) of the
    group with its identifiers, or of the one that differs only in being the experts' (their
    groups come and go with expert parallelism)."""
    saved_parts, own_parts = _chain(saved), _chain(own)
    if len(saved_parts) == len(own_parts) and all(
            len(_param_groups(a)) == len(_param_groups(b))
            for a, b in zip(saved_parts, own_parts)):
        parts = [_one_common_as(s, o) for s, o in zip(saved_parts, own_parts)]
    else:
        groups = [group for part in saved_parts for group in _param_groups(part)]
        parts = [_one_common_as(_regrouped(saved_parts[0], groups, _param_groups(o)), o)
                 for o in own_parts]
    return dict(enumerate(parts)) if _is_chain(own) else parts[0]


def _is_chain(common: dict) -> bool:
    return bool(common) and all(isinstance(key, int) for key in common)


def _chain(common: dict) -> list[dict]:
    return [common[key] for key in sorted(common)] if _is_chain(common) else [common]


def _param_groups(common: dict) -> list[dict]:
    """The param groups of one optimizer's unsharded state, whichever its format."""
    return common.get("optimizer", common)["param_groups"]


def _regrouped(saved: dict, groups: list[dict], own: list[dict]) -> dict:
    """``saved`` (one optimizer's unsharded state) with ``own``'s param groups, each with the
    settings of its match among the saved ``groups``."""
    def identity(group: dict, expert: bool = True) -> tuple:
        return tuple(group.get(key) for key in param_group_identifier_keys
                     if expert or key != "is_expert_parallel")

    regrouped = []
    for mine in own:
        match = next((g for g in groups if identity(g) == identity(mine)), None) or next(
            (g for g in groups if identity(g, False) == identity(mine, False)), None)
        if match is None:
            raise CheckpointError("the checkpoint's optimizer has no param group with the "
                                  f"settings of this run's {identity(mine)}")
        regrouped.append({**match, "is_expert_parallel": mine.get("is_expert_parallel"),
                          **({"params": mine["params"]} if "params" in mine else {})})
    copy = dict(saved)
    if "optimizer" in copy:
        copy["optimizer"] = {**copy["optimizer"], "param_groups": regrouped}
    else:
        copy["param_groups"] = regrouped
    return copy


def _one_common_as(common: dict, own: dict) -> dict:
    """One optimizer's unsharded state ``common`` in the format of ``own``'s: megatron-core's
    distributed optimizer keeps torch's param groups under ``optimizer`` with the step in each
    group and names its format; the fp32 optimizer keeps them at the top with the step in
    ``state.common_step``, the mixed-precision one the same under ``optimizer``."""
    saved_distributed = "param_state_sharding_type" in common
    if saved_distributed == ("param_state_sharding_type" in own):
        return common
    if not saved_distributed:                       # plain -> distributed
        torch_state = common.get("optimizer", common)
        step = (torch_state.get("state") or {}).get("common_step", 0)
        groups = [{**group, "step": int(step)} for group in torch_state["param_groups"]]
        return {"optimizer": {"param_groups": groups},
                "param_state_sharding_type": OPTIMIZER_METADATA["distrib_optim_sharding_type"]}
    groups = [dict(group) for group in common["optimizer"]["param_groups"]]   # -> plain
    steps = {group.pop("step") for group in groups if "step" in group}
    torch_state = {"param_groups": groups,
                   "state": {"common_step": torch.tensor(float(steps.pop()))} if steps else {}}
    return {"optimizer": torch_state} if "optimizer" in own else torch_state


def settings_as(saved: dict, optimizer) -> dict:
    """Give the param groups in ``saved`` (a module optimizer's loaded state) ``optimizer``'s
    settings, this run's config (``optimizer.build_optimizer``): its module's LR bounds
    (``lr``, ``min_lr``: megatron-core finds each group's saved state by the group's settings,
    bounds included, so a run resumed with other bounds would find none) and Adam betas
    (``adam_beta1``, ``adam_beta2``: torch's ``load_state_dict`` would put the saved ones back,
    silently). Returns how the betas changed, setting -> (was, now), for the start-up notes
    (the schedulers say the LR's)."""
    (bounds,) = {(group["max_lr"], group["min_lr"]) for group in optimizer.param_groups}
    (betas,) = {tuple(group["betas"]) for group in optimizer.param_groups}
    changes = {}
    for node in _dicts(saved):
        for group in node.get("param_groups") or ():
            group["max_lr"], group["min_lr"] = bounds
            if "betas" in group:
                changes.update({setting: (was, now) for setting, was, now in zip(
                    ("adam_beta1", "adam_beta2"), group["betas"], betas) if was != now})
                group["betas"] = betas
    return changes


def _dicts(node):
    """``node`` and every dict nested in it (through dicts and lists)."""
    if isinstance(node, dict):
        yield node
        children = node.values()
    elif isinstance(node, (list, tuple)):
        children = node
    else:
        return
    for child in children:
        yield from _dicts(child)
