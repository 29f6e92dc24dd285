"""``memory_remedies(plan, places, gpu)``: what would lower the GPU memory of a rank of the run
``plan`` holding ``places`` (its place in each module), from the run's own settings, for the
message of a rank out of GPU memory in a step (``runtime.console.run_failure``);
``advisor_command(plan, gpu)``: the layout advisor's command for the same run, also named where
the model or its optimizer does not fit at start-up.

Each is a ``key=value`` override with its cost, and only one the run would take: the rules
(``plan.rules``) and the layout's batch check accept it, and it lowers something that rank
holds (a frozen tower keeps no activations, a frozen module no optimizer state, a module under
LoRA its adapters', the loss lives on the language model's last stage). The layout advisor's
command for the same run comes last: it predicts each layout's memory per rank and the
settings with which it fits.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Iterable

from mimo_data.loading.layout import LANGUAGE, LayoutError, ModuleRank
from mimo_train.plan import RunPlan
from mimo_train.plan.parts import ENCODER_PARTS
from mimo_train.plan.rules import refusals
from mimo_train.planning.dims import language_stack
from mimo_train.planning.flops import trains
from mimo_train.planning.gpus import GPUS

# the chunk the loss is offered in (model.language.loss_chunk_tokens), where a micro-batch can
# hold more tokens than that
LOSS_CHUNK = 4096
# the least of a LoRA module's optimizer state the distributed optimizer is offered to split off
# a rank (bytes)
ADAPTERS_SPLIT = 2**30


def memory_remedies(plan: RunPlan, places: Iterable[ModuleRank], gpu: str | None = None
                    ) -> list[str]:
    """The overrides that would lower the memory of a rank holding ``places``, each with its
    cost, then the layout advisor's command (``gpu``: the device's name, for its ``--gpu``)."""
    found: list[str] = []
    for place in places:
        name = place.name
        module, layout = plan.modules[name], plan.layout.module(name)
        if name == LANGUAGE:
            found += _language(plan, place)
        elif plan.trains(name, (None, "encoder")) and module.recompute != "full":
            found.append(f"model.encoders.{name}.recompute=full (its tower's activations "
                         "made again in the backward pass: about a third more of its compute)")
        if module.optimizer.distributed:
            continue
        adapters = _adapters_split(plan, place) \
            if any(a.part.module == name for a in plan.adapted) else []
        if adapters:
            found += adapters
        elif _fully_trained(plan, name) and layout.dp > 1:
            found.append(f"optimizer.modules.{name}.distributed=true (its optimizer state "
                         f"split over its {layout.dp} DP ranks)")
    found.append(_smaller_batches(plan))
    found.append(advisor_command(plan, gpu))
    return found


def _language(plan: RunPlan, place: ModuleRank) -> list[str]:
    found = []
    taken = [r for r in ("full", "selective") if _takes(plan, recompute=r)]
    if plan.language.recompute != "full" and "full" in taken:
        found.append("model.language.recompute=full (its layers' activations made again in "
                     "the backward pass: about a third more of its compute)")
    elif plan.language.recompute == "none" and "selective" in taken and \
            plan.config.model.attention == "local":
        found.append("model.language.recompute=selective (the attention scores made again "
                     "in the backward pass)")
    if place.module.tp > 1 and not plan.language.sequence_parallel and \
            _takes(plan, sequence_parallel=True):
        found.append("model.language.sequence_parallel=true (the activations outside the TP "
                     f"regions split over its {place.module.tp} TP ranks)")
    most = plan.config.train.micro_batch_size * plan.preprocess.seq_length
    if place.last_stage and not plan.language.loss_chunk_tokens and most > LOSS_CHUNK:
        found.append(f"model.language.loss_chunk_tokens={LOSS_CHUNK} (the output layer's "
                     f"logits of {LOSS_CHUNK} trained tokens at a time)")
    return found


def _fully_trained(plan: RunPlan, name: str) -> bool:
    """Whether module ``name`` trains some of its weights whole: a part neither frozen nor
    under LoRA (an encoder's projection beside its adapted tower counts)."""
    fixed = (*plan.frozen, *(a.part for a in plan.adapted))   # a LoRA part's own weights
    parts = [LANGUAGE] if name == LANGUAGE else [f"{name}.{part}" for part in ENCODER_PARTS]
    return any(trains(part, fixed) for part in parts)


def _adapters_split(plan: RunPlan, place: ModuleRank) -> list[str]:
    """The distributed optimizer for a module under LoRA: offered where it splits at least
    ``ADAPTERS_SPLIT`` of its adapters' optimizer state off this rank (``planning.adapters``;
    the routed experts' adapters: several GiB, attention's and dense MLPs': far less)."""
    from mimo_train.planning.adapters import run_adapters
    from mimo_train.planning.memory import Settings, state_bytes
    name, layout = place.name, place.module
    settings = Settings(plan.config.train.precision)
    dense, experts = run_adapters(plan).rank_parameters(
        name, language_stack(plan.language, 1), layout, place.pp_rank)
    shards = [(dense, layout.dp * layout.cp, "DP"), (experts, layout.expert_dp, "expert DP")] \
        if name == LANGUAGE else [(dense, layout.dp, "DP")]
    shards = [(state_bytes(count, settings).optimizer, ranks, what)
              for count, ranks, what in shards if count]
    if sum(state * (1 - 1 / ranks) for state, ranks, _ in shards) < ADAPTERS_SPLIT:
        return []
    total = sum(state for state, _, _ in shards)
    over = " and ".join(f"{ranks} {what}" for _, ranks, what in shards if ranks > 1)
    return [f"optimizer.modules.{name}.distributed=true (the LoRA adapters' optimizer state, "
            f"{total / 2**30:.1f} GiB on this rank, split over its {over} ranks)"]


def _takes(plan: RunPlan, **changed) -> bool:
    """Whether the rules take the run's settings with ``changed``."""
    return not refusals(plan.facts, plan.layout, dataclasses.replace(plan.settings, **changed))


def _smaller_batches(plan: RunPlan) -> str:
    """The largest smaller micro-batch the layout's batch check takes, else shorter samples."""
    from mimo_data.loading.loader import variable_token_modalities
    run, preprocess = plan.config.train, plan.preprocess
    for size in range(run.micro_batch_size - 1, 0, -1):
        try:
            plan.layout.validate(plan.layout.world_size, run.global_batch_size, size,
                                 variable_token_modalities(preprocess),
                                 modalities=list(preprocess.modalities),
                                 split_media=plan.config.data.split_media)
        except LayoutError:
            continue
        return f"train.micro_batch_size={size} (the same global batch in more micro-batches)"
    return (f"a seq_length under {preprocess.seq_length} in {plan.config.data.preprocess} "
            "(fewer tokens a sample)")


def advisor_command(plan: RunPlan, gpu: str | None) -> str:
    """The layout advisor's command for the run of ``plan`` on the GPU named ``gpu``, with
    what it tells."""
    config, run = plan.config, plan.config.train
    # mimo-inspect plan --gpu's kind: the advisor's GPU whose peak's name the device's holds
    kind = next((k for k, spec in GPUS.items() if gpu and spec.peak.lower() in gpu.lower()), None)
    words = ["mimo-inspect", "plan", config.data.datasets[0], "--config",
             str(config.data.preprocess), "--model", "TRAIN.yaml", "--gpus",
             str(plan.layout.world_size), "--layout", str(plan.layout), "--global-batch-size",
             str(run.global_batch_size), "--micro-batch-size", str(run.micro_batch_size),
             *(["--packing"] if config.data.packing else []),
             *(["--gpu", kind] if kind else [])]
    return (f"{shlex.join(words)} (TRAIN.yaml: this run's training config with its "
            "overrides; each layout's memory per rank, this one's too, and the settings with "
            "which it fits)")
