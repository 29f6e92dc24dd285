"""The LoRA adapters' parameters (``model.lora``, ``mimo_train.model.lora``) per rank, as the
trainer allocates them, read from a run's plan without building the model (an encoder's tower
is built on the meta device for its layers' names and shapes).

An adapted linear layer of ``in`` -> ``out`` features gets A [r, in] and B [out, r]: r·(in +
out) parameters at rank r, one pair per layer as megatron-core holds it (the fused
``linear_qkv``, SwiGLU's fused ``linear_fc1``, a gated delta-net's fused ``in_proj``: one A,
one B of all their rows; PEFT's adapters on transformers' separate q, k, v or gate and up
projections have one A each). Per rank:

- the language model's dense layers (attention, delta-net, dense MLP, shared expert): split
  over TP, each of the four shapes (a column-parallel layer's A by its r rows and B by its
  output rows, a row-parallel layer's A by its input columns and B by its output rows):
  r·(in + out) ÷ tp, of the stage's layers;
- a routed expert's (``linear_fc1``, ``linear_fc2`` of each expert a target names): split over
  the expert TP (etp) alike, held by the expert-parallel rank holding the expert (rank g the
  experts g·E/ep on): r·(in + out) ÷ etp each; the fullest rank's;
- an encoder module's (its tower, its projection): whole on each of its ranks.

They train where their layers' own weights stay fixed: their weights in the run's precision,
their gradients in DDP's fp32 buffer, fp32 main weights (bf16) and Adam's two moments
(``memory.state_bytes``, ``memory.adapter_state_bytes``), the distributed optimizer sharding
the dense adapters' over the language model's dp x cp ranks and the routed experts' over their
expert data parallelism (megatron-core's expert buffer: their ``allreduce`` is the expert's).
The output layer and a mixture's router get none. Checked against the trainer's own model and
optimizer in ``tests/test_planning.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from mimo_data.loading.layout import LANGUAGE
from mimo_train.plan import RunPlan
from mimo_train.plan.lora_targets import check_targets
from mimo_train.plan.parts import ROUTED_EXPERTS, reaches_routed_experts, target_matches
from mimo_train.planning.dims import FULL, Linear, Stack, language_stack, projection_linears


@dataclass(frozen=True)
class LanguageAdapters:
    """The language model's adapters: per layer, the parameters of its dense layers' (split
    over TP) and of each routed expert's (split over etp); () where none is adapted."""
    dense: tuple[int, ...] = ()
    experts: tuple[tuple[int, ...], ...] = ()

    @property
    def parameters(self) -> int:
        """All of them (one rank's at tp = ep = etp = pp = 1)."""
        return sum(self.dense) + sum(map(sum, self.experts))

    def rank_parameters(self, stack: Stack, tp: int = 1, pp: int = 1, stage: int = 0,
                        ep: int = 1, etp: int | None = None) -> tuple[float, float]:
        """(dense, routed experts') adapter parameters of one rank of pipeline ``stage``: its
        layers' dense ones ÷ tp, the fullest expert-parallel rank's experts' ÷ etp (None:
        tp)."""
        layers = stack.stage_layers(pp, stage)
        dense = sum(self.dense[i] for i in layers) / tp if self.dense else 0.0
        if not self.experts:
            return dense, 0.0
        held = stack.experts // ep
        experts = max(sum(sum(self.experts[i][g * held:(g + 1) * held]) for i in layers)
                      for g in range(ep))
        return dense, experts / (tp if etp is None else etp)


@dataclass(frozen=True)
class Adapters:
    """A run's LoRA adapters: the language model's, and each adapted encoder module's
    parameters (its tower's and projection's, whole on each rank)."""
    language: LanguageAdapters = field(default_factory=LanguageAdapters)
    encoders: Mapping[str, int] = field(default_factory=dict)

    def parameters(self) -> dict[str, int]:
        """Module -> all its adapters' parameters (only the modules with some)."""
        found = {LANGUAGE: self.language.parameters, **self.encoders}
        return {name: count for name, count in found.items() if count}

    def rank_parameters(self, name: str, stack: Stack, module, stage: int
                        ) -> tuple[float, float]:
        """(dense, routed experts') adapter parameters one rank of module ``name`` holds at
        pipeline ``stage`` (``module``: its layout, ``tp``/``pp``/``ep``/``etp``; ``stack``:
        the language model's); an encoder module's whole on each rank."""
        if name != LANGUAGE:
            return float(self.encoders.get(name, 0)), 0.0
        return self.language.rank_parameters(stack, module.tp, module.pp, stage, module.ep,
                                             module.etp)


def layer_linears(stack: Stack, layer: int) -> list[tuple[str, Linear, int | None]]:
    """The linear layers of the language model's ``layer`` as LoRA targets name them
    (``decoder.layers.<layer>.self_attention.linear_qkv``, ...; a routed expert's with its
    number), each with its features and its expert's number (None: a dense layer):
    attention's ``linear_qkv`` and ``linear_proj`` or a gated delta-net's ``in_proj`` and
    ``out_proj``, then the dense MLP's ``linear_fc1`` and ``linear_fc2``, or a mixture's
    shared expert's and each routed expert's (the router and the shared expert's gate are no
    linear layers in megatron-core)."""
    kind = stack.kind(layer)
    linears = stack.layer_linears(kind)
    prefix = f"decoder.layers.{layer}."
    attention = ("linear_qkv", "linear_proj") if kind == FULL else ("in_proj", "out_proj")
    found: list[tuple[str, Linear, int | None]] = [
        (f"{prefix}self_attention.{name}", linear, None)
        for name, linear in zip(attention, linears[:2])]
    first, second = linears[2:4]
    if not stack.experts:
        return found + [(f"{prefix}mlp.linear_fc1", first, None),
                        (f"{prefix}mlp.linear_fc2", second, None)]
    if stack.shared_expert_ffn:                 # after the router: gate_up, down, its gate
        shared_first, shared_second = linears[5:7]
        found += [(f"{prefix}mlp.shared_experts.linear_fc1", shared_first, None),
                  (f"{prefix}mlp.shared_experts.linear_fc2", shared_second, None)]
    return found + [(f"{prefix}{ROUTED_EXPERTS}{e}.linear_fc{n}", linear, e)
                    for e in range(stack.experts)
                    for n, linear in ((1, first), (2, second))]


def language_adapters(stack: Stack, rank: int, targets: tuple[str, ...]) -> LanguageAdapters:
    """The adapters of rank ``rank`` on the language model's layers ``targets`` name."""
    routed = bool(stack.experts) and reaches_routed_experts(targets, stack.layers,
                                                            stack.experts)
    dense, experts = [], []
    for layer in range(stack.layers):
        own, per_expert = 0, [0] * stack.experts
        for name, linear, expert in layer_linears(stack, layer):
            if expert is not None and not routed:
                continue
            if any(target_matches(t, name) for t in targets):
                count = rank * (linear.inputs + linear.outputs)
                if expert is None:
                    own += count
                else:
                    per_expert[expert] += count
        dense.append(own)
        experts.append(tuple(per_expert))
    return LanguageAdapters(tuple(dense), tuple(experts) if routed else ())


def encoder_adapters(setting, projection: tuple[Linear, ...], part: str | None, rank: int,
                     targets: tuple[str, ...]) -> int:
    """The adapters of rank ``rank`` on an encoder module's linear layers ``targets`` name:
    of its tower (``part`` "encoder": named from the tower's root as transformers names them,
    ``blocks.0.attn.qkv``), its projection (``projection``: by index, ``0``, ``2``) or both
    (None: named from the module's root, ``encoders.<modality>.encoder.model.blocks...``,
    ``input_projections.0.0``); ``setting``: its ``plan.encoders`` entry."""
    return _parameters(encoder_linears(setting, projection, part), rank, targets)


def _parameters(names: Mapping[str, tuple[int, int]], rank: int, targets: tuple[str, ...]
                ) -> int:
    """The adapters' parameters of rank ``rank`` on the layers of ``names`` (name -> in,
    out features) that ``targets`` name."""
    return sum(rank * (inputs + outputs) for name, (inputs, outputs) in names.items()
               if any(target_matches(t, name) for t in targets))


def encoder_linears(setting, projection: tuple[Linear, ...], part: str | None
                    ) -> dict[str, tuple[int, int]]:
    """An encoder module's linear layers as its part's LoRA targets name them (``part``:
    "encoder", "projection" or None, as ``encoder_adapters`` takes it): (in, out) features."""
    names: dict[str, tuple[int, int]] = {}
    if part in (None, "encoder"):
        head = "" if part else f"encoders.{setting.modality}.encoder.model."
        names.update({head + name: shape for name, shape in tower_linears(setting).items()})
    if part in (None, "projection"):
        head = "" if part else "input_projections.0."
        names.update({f"{head}{2 * i}": (linear.inputs, linear.outputs)
                      for i, linear in enumerate(projection)})
    return names


def check_encoder_targets(plan: RunPlan, projections: Mapping[str, tuple[Linear, ...]]
                          ) -> None:
    """``TrainConfigError`` for an encoder module's LoRA target that names none of its part's
    linear layers (the tower's named from a build on the meta device): the trainer's refusal,
    before any weight is read, and the layout advisor's."""
    for each in plan.adapted:
        if each.part.module != LANGUAGE:
            check_targets(each, set(encoder_linears(
                plan.encoders[each.part.module], projections.get(each.part.module, ()),
                each.part.part)))


def tower_linears(setting) -> dict[str, tuple[int, int]]:
    """The linear layers of an encoder module's tower (the transformers model its encoder
    holds, ``Encoder.model``) by name: (in, out) features, read from the tower its family
    builds from its config (``Encoder.build_tower``) on the meta device."""
    import torch

    from mimo_train.families.registry import ENCODERS, checkpoint_config
    kind, spec = setting.kind, setting.spec
    if spec.pretrained:
        config = checkpoint_config(spec.pretrained, "model.encoders.*.pretrained")
    else:
        config = ENCODERS[kind].random_config(setting.config, *setting.dims)
    with torch.device("meta"):
        tower = ENCODERS[kind].build_tower(config)
    return {name: (module.in_features, module.out_features)
            for name, module in tower.named_modules()
            if isinstance(module, torch.nn.Linear) and name}


def plan_adapters(plan: RunPlan, stack: Stack, projections: Mapping[str, tuple[Linear, ...]]
                  ) -> Adapters:
    """The adapters of ``plan``'s ``model.lora`` on a model whose language ``stack`` and
    encoder modules' projections (module -> its matmuls, ``EncoderModule.projection``) the
    dims give."""
    language = LanguageAdapters()
    encoders: dict[str, int] = {}
    for each in plan.adapted:
        spec, module = each.spec, each.part.module
        targets = tuple(spec.targets)
        if module == LANGUAGE:
            language = language_adapters(stack, spec.rank, targets)
        else:       # the tower's layers read once: checked (the trainer's refusal), counted
            names = encoder_linears(plan.encoders[module], projections.get(module, ()),
                                    each.part.part)
            check_targets(each, set(names))
            encoders[module] = encoders.get(module, 0) + _parameters(names, spec.rank, targets)
    return Adapters(language, encoders)


def run_adapters(plan: RunPlan) -> Adapters:
    """``plan_adapters`` with the dims read from ``plan`` alone, without the tokenizer (its
    size sets the output layer's rows, which take no adapter)."""
    return plan_adapters(plan, language_stack(plan.language, 1), _projections(plan))


def check_run_targets(plan: RunPlan) -> None:
    """``check_encoder_targets`` with the projections read from ``plan`` alone."""
    check_encoder_targets(plan, _projections(plan))


def _projections(plan: RunPlan) -> dict[str, tuple[Linear, ...]]:
    """Each encoder module's projection's matmuls, from ``plan``."""
    return {name: projection_linears(setting.projection, setting.output_size,
                                     plan.language.hidden_size)
            for name, setting in plan.encoders.items()}
