"""Which linear layers a run's LoRA targets (``model.lora.<part>.targets``) name, and their
refusal where a target names none: the language model's by name alone (megatron-core's, with
global layer numbers: ``mimo_train.model.lora``'s module docstring), checked as the run is
resolved (``plan.check_training``); an encoder's from its tower's layers (``planning.adapters``
names them without building the tower). No torch here: the start-up's config phase and the
layout advisor refuse what the trainer would."""

from __future__ import annotations

import re
from collections.abc import Iterable

from mimo_data.loading.layout import LANGUAGE
from mimo_train.errors import TrainConfigError
from mimo_train.plan.language import LanguagePlan
from mimo_train.plan.parts import Adapted, routed_expert_layers
from mimo_train.plan.parts import target_matches as matches

# the linear layers of each decoder layer of mimo's language model (megatron-core's local spec)
# (a gated delta-net layer's ``self_attention`` has ``in_proj`` and ``out_proj`` instead)
LANGUAGE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj",
                    "self_attention.in_proj", "self_attention.out_proj",
                    "mlp.linear_fc1", "mlp.linear_fc2")
# a mixture-of-experts layer's shared expert (Qwen3.5-MoE), beside its routed experts
SHARED_EXPERT_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")


def language_linears(num_layers: int, experts: int = 0, shared_expert: bool = False,
                     linear_layers: frozenset[int] = frozenset()) -> set[str]:
    """The linear layers of mimo's language model as LoRA targets name them (global layer
    numbers; the gated delta-net layers, ``linear_layers``, with their own attention's; a
    mixture of experts': the shared expert's and each routed expert's by its global number,
    no dense MLP)."""
    mlp = (SHARED_EXPERT_LINEARS if shared_expert else ()) if experts else LANGUAGE_LINEARS[4:]
    return {f"decoder.layers.{i}.{n}" for i in range(num_layers)
            for n in (LANGUAGE_LINEARS[2:4] if i in linear_layers else LANGUAGE_LINEARS[:2])
            + mlp} | set(routed_expert_layers(num_layers, experts))


def check_plan_targets(adapted: Iterable[Adapted], language: LanguagePlan) -> None:
    """``check_language_targets`` of a resolved run's language model (``plan.language``)."""
    arch = language.arch
    check_language_targets(adapted, language.num_layers, language.experts,
                           bool(arch and arch.shared_expert_ffn_hidden_size),
                           frozenset(i for i in range(language.num_layers)
                                     if arch and arch.linear_layer(i)))


def check_language_targets(adapted: Iterable[Adapted], num_layers: int, experts: int = 0,
                           shared_expert: bool = False,
                           linear_layers: frozenset[int] = frozenset()) -> None:
    """Every target of the language model's adapters names one of its linear layers (on
    every rank, whichever modules it holds); a mixture of experts' router is none (it stays
    un-adapted)."""
    for each in adapted:
        if each.part.module != LANGUAGE:
            continue
        names = language_linears(num_layers, experts, shared_expert, linear_layers)
        # megatron-core's name of the router, and transformers' (mlp.gate)
        routers = [f"decoder.layers.{i}.mlp.{name}" for i in range(num_layers)
                   for name in ("router", "gate")]
        for target in each.spec.targets:
            if experts and not any(matches(target, n) for n in names) and \
                    any(matches(target, n) for n in routers):
                shared = "shared_experts.linear_fc1 / linear_fc2, " if shared_expert else ""
                raise TrainConfigError(
                    f"model.lora.{each.part.name}.targets has {target!r}, the "
                    "mixture-of-experts router (mlp.router, transformers' mlp.gate): it stays "
                    "un-adapted (its logits choose each token's experts, a plain weight, not a "
                    f"linear layer); target the attention, {shared}or the routed experts "
                    "('*.local_experts.*.linear_fc1', '*.local_experts.*.linear_fc2') instead")
        check_targets(each, names)
        _check_routed_experts(each, num_layers, experts, stacked=not linear_layers)


def _check_routed_experts(adapted: Adapted, num_layers: int, experts: int,
                          stacked: bool) -> None:
    """``TrainConfigError`` for adapters on some of a layer's routed experts, or, where
    megatron-core stacks the decoder's layers (``stacked``: all alike, no gated delta-net
    layer), on a routed expert of some layers: megatron-core saves the experts' weights
    stacked along an expert axis (and then the layers'), which their adapters cannot fill
    in part."""
    targets = adapted.spec.targets
    # the taken experts counted by (layer, fc), or by fc where stacked: one pass, not a set of
    # every expert built per taken one (start-up at 48 layers of 128 experts)
    groups: dict[tuple[str, ...], int] = {}
    first: dict[tuple[str, ...], str] = {}
    for name in routed_expert_layers(num_layers, experts):
        if any(matches(t, name) for t in targets):
            layer, fc = name.split(".")[2], name.rpartition(".")[2]
            group: tuple[str, ...] = (fc,) if stacked else (layer, fc)
            groups[group] = groups.get(group, 0) + 1
            first.setdefault(group, name)
    for key, count in groups.items():
        if count != experts * (num_layers if stacked else 1):
            fc = key[-1]
            taken = experts * (num_layers if stacked else 1)
            raise TrainConfigError(
                f"model.lora.{adapted.part.name}.targets adapt {count} of the {taken} routed "
                f"experts' {fc} (the first {first[key]}), not the {fc} of every routed expert" +
                (" in every decoder layer" if stacked else " of its layer") +
                ": megatron-core saves the experts' weights stacked over the experts" +
                (" and the layers" if stacked else "") + ", which their adapters must fill: "
                f"target them all ('*.local_experts.*.{fc}') or none")


# transformers' (PEFT's) names of a language model's layers -> megatron-core's, which
# model.lora.language.targets takes (q, k and v are one fused layer there, gate and up too)
PEFT_NAMES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
              "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
              "down_proj": "linear_fc2", "gate_up_proj": "linear_fc1",   # (a fused one's)
              # a gated delta-net's (Qwen3.5's linear_attn): one fused in_proj
              "in_proj_qkv": "in_proj", "in_proj_z": "in_proj", "in_proj_b": "in_proj",
              "in_proj_a": "in_proj"}


def check_targets(adapted: Adapted, names: set[str]) -> None:
    """Every target of ``adapted`` names one of its part's linear layers ``names``."""
    for target in adapted.spec.targets:
        if not any(matches(target, n) for n in names):
            shown = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in names})
            ours = PEFT_NAMES.get(target.rpartition(".")[2])
            fused = {"linear_qkv": ", which holds q, k and v as one layer",
                     "linear_fc1": ", which holds gate and up as one layer",
                     "in_proj": ", which holds q, k, v, z, b and a as one layer",
                     }.get(ours or "", "")
            hint = (f" (transformers' {target} is megatron-core's {ours} here{fused}: give "
                    f"{ours})" if ours and any(matches(ours, n) for n in names) else "")
            raise TrainConfigError(f"model.lora.{adapted.part.name}.targets has {target!r}, "
                                   f"which names none of its linear layers: {shown[:12]}{hint}")
