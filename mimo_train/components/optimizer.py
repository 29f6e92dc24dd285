"""The optimizer and its learning-rate schedules: megatron-core's ``MimoOptimizer`` (one Adam per
module on that module's process groups), and one warmup +
cosine ``OptimizerParamScheduler`` per trained module, from that module's settings
(``optimizer.modules.<module>``: learning rate, minimum, warmup, weight decay).

The step (``mcore.optimizer_step.step_on_device``): megatron-core's clipping and update with
nothing read on the host; a step whose world gradient norm (or loss) is not finite moves no
weight, optimizer state or learning rate, alike on every rank (the norm is the world's), and
the trainer counts it as skipped (``anomalies``) when it reads the step's outcome.

A resumed run's schedules follow its config, not the checkpoint's (megatron-core's
``override_opt_param_scheduler``): a longer ``train.steps`` stretches the decay, a new ``lr``,
``min_lr``, ``warmup_steps`` or ``weight_decay`` (per module too) applies from the resumed step
on; the step count is the checkpoint's. ``schedule_notes`` says what changed at start-up.
"""

from __future__ import annotations

import dataclasses

import torch

from collections.abc import Mapping

from mimo_train.config import OptimizerConfig
from mimo_train.mcore import (MegatronOptimizerConfig, MimoModel, MimoOptimizer,
                              ModuleOptimizerInfo, OptimizerParamScheduler,
                              get_megatron_optimizer)
from mimo_train.mcore.distributed_optimizer import (start_adam_states, tolerate_partial_states,
                                                    without_empty_parts)
from mimo_train.mcore.fused_adam import use_fused_adam
from mimo_train.mcore.grids import optimizer_groups
from mimo_train.model.parts import module_of
from mimo_train.plan import ModulePlan


def build_optimizer(opt: OptimizerConfig, modules: Mapping[str, ModulePlan], precision: str,
                    model) -> MimoOptimizer:
    """The optimizer of this rank's modules of ``model`` (``MimoModel``; collective):
    ``opt`` the run's settings, ``modules`` each module's own (``RunPlan.modules``)."""
    bf16 = precision == "bf16"
    config = MegatronOptimizerConfig(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, clip_grad=opt.clip_grad,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    optimizer = MimoOptimizer(module_optimizers(model, config, modules), config)
    # megatron-core's schedulers take each parameter group's own rates over theirs: the
    # module's (the optimizers are built with the optimizer's)
    for name, info in optimizer.module_infos.items():
        own = modules[name].optimizer
        for group in info.optimizer.param_groups if info.optimizer is not None else ():
            group["max_lr"], group["min_lr"] = own.lr, own.min_lr
    return optimizer


def module_optimizers(model: MimoModel, config: MegatronOptimizerConfig,
                      modules: Mapping[str, ModulePlan]) -> dict[str, ModuleOptimizerInfo]:
    """megatron-core's ``get_mimo_optimizer`` with each module's own
    ``optimizer.distributed`` (its DDP was built with the same: ``model.build.ddp_config``):
    module name -> ``ModuleOptimizerInfo`` (no optimizer where this rank holds no part of
    the module)."""
    infos = {}
    for name, grid in model.mimo_config.module_to_grid_map.items():
        active = grid.is_current_rank_in_grid()
        optimizer, pgs = None, None
        if active and module_of(model, name) is not None:
            pgs = optimizer_groups(grid)
            own = dataclasses.replace(
                config, use_distributed_optimizer=modules[name].optimizer.distributed)
            optimizer = without_empty_parts(
                get_megatron_optimizer(config=own, model_chunks=[module_of(model, name)],
                                       pg_collection=pgs, use_gloo_process_groups=False),
                module_of(model, name))
            # saved before its first step, resumed from any checkpoint: mcore.distributed_optimizer
            start_adam_states(optimizer)
            tolerate_partial_states(optimizer)
            use_fused_adam(optimizer)             # one kernel a step: mcore.fused_adam
        infos[name] = ModuleOptimizerInfo(optimizer=optimizer, grid=grid, pg_collection=pgs,
                                          is_active=active)
    return infos


def trained_optimizers(optimizer: MimoOptimizer, freeze) -> dict:
    """This rank's module optimizers, frozen modules left out (they have no state)."""
    return {name: info.optimizer for name, info in optimizer.module_infos.items()
            if info.is_active and info.optimizer is not None and name not in freeze}


def build_schedulers(modules: Mapping[str, ModulePlan], steps: int, trained: dict) -> dict:
    """module name -> the warmup + cosine LR (constant weight decay) of its optimizer in
    ``trained``, from the module's settings (``RunPlan.modules``); the decay spans ``steps``
    (``train.steps``). megatron-core's scheduler as its training runs it: the warmup starts at
    0 (step 1 moves Adam's moments, not the weights), stepped after each optimizer step."""
    schedulers = {}
    for name, optimizer in trained.items():
        opt, warmup = modules[name].optimizer, modules[name].warmup_steps
        # a resumed run: this config's settings, the checkpoint's step count
        schedulers[name] = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=steps, lr_decay_style="cosine", start_wd=opt.weight_decay,
            end_wd=opt.weight_decay, wd_incr_steps=steps, wd_incr_style="constant",
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)
    return schedulers


# OptimizerParamScheduler.state_dict() keys -> the settings they come from
_SCHEDULE = {"lr_decay_steps": "train.steps", "max_lr": "lr", "min_lr": "min_lr",
             "lr_warmup_steps": "warmup_steps", "start_wd": "weight_decay"}


def schedule_changes(saved: dict, scheduler: OptimizerParamScheduler) -> dict:
    """What ``scheduler``'s settings (this run's config) change from ``saved``, its state in
    the checkpoint: setting -> (was, now)."""
    now = scheduler.state_dict()
    return {setting: (saved[key], now[key]) for key, setting in _SCHEDULE.items()
            if saved[key] != now[key]}


def schedule_notes(step: int, changes: list[dict]) -> list[str]:
    """The start-up lines of a resumed run's schedule changes, one per changed setting
    (``changes``: module -> ``schedule_changes`` of each rank), modules with the same change
    in one line."""
    modules: dict[tuple, list[str]] = {}
    for ranks in changes:
        for module, changed in ranks.items():
            for setting, (was, now) in changed.items():
                named = modules.setdefault((setting, was, now), [])
                if module not in named:
                    named.append(module)
    notes = []
    for (setting, was, now), named in modules.items():
        if setting == "train.steps":
            notes.append(f"resumed from step {step} of a schedule of {was} steps: LR decay now "
                         f"spans train.steps {now} (was {was})")
        else:
            notes.append(f"resumed from step {step}: {', '.join(named)} {setting} now {now:g} "
                         f"(was {was:g})")
    return notes
