"""The parts of a run's model as the config names them, and the one check that a config key
names the layout's modules.

A part (``model.freeze``, ``model.lora``) is ``language``, an encoder module (``image``: its
tower and its projection), or one of an encoder module's two parts: ``image.encoder`` (the
tower) or ``image.projection``. ``Part.parse`` reads one; ``prefix`` is where the part's
parameters sit in its module (megatron-core's ``ModalitySubmodules``: ``encoders.`` and
``input_projections.``); ``covers`` says whether an entry takes in a part (a whole module
takes in its tower and projection).

A LoRA target (``model.lora.<part>.targets``) names linear layers of its part: a layer name
(every layer of that name), a dotted path, an fnmatch pattern, or ``all-linear``
(``target_matches``); ``reaches_routed_experts`` says whether targets take in a mixture of
experts' routed experts.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from mimo_data.errors import listed, meant
from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_train.config import LoraConfig
from mimo_train.errors import TrainConfigError

# an encoder module's parts -> the prefix of their parameter names in the module
ENCODER_PARTS = {"encoder": "encoders.", "projection": "input_projections."}
# the LoRA target of every linear layer of a part but the language model's output layer and a
# mixture of experts' routed experts, as PEFT's all-linear (transformers holds the routed
# experts as fused parameters, not linear layers)
ALL_LINEAR = "all-linear"
# where megatron-core's mixture-of-experts layer holds each routed expert's linear layers
# (``decoder.layers.<i>.mlp.experts.local_experts.<e>.linear_fc1``, e the layer's global
# expert number)
ROUTED_EXPERTS = "mlp.experts.local_experts."


def target_matches(target: str, name: str) -> bool:
    """Whether the LoRA target ``target`` names the linear layer ``name`` (a path from its
    part's root): ``all-linear``, the layer's name (``linear_fc1``: every layer of that name),
    its path, or an fnmatch pattern over its path."""
    if target == ALL_LINEAR:
        return f".{ROUTED_EXPERTS}" not in f".{name}"
    return name == target or name.endswith("." + target) or fnmatch.fnmatchcase(name, target)


def routed_expert_layers(layers: int, experts: int) -> list[str]:
    """The linear layers of the routed experts of a mixture-of-experts language model of
    ``layers`` layers of ``experts`` experts each, named as LoRA targets name them."""
    return [f"decoder.layers.{i}.{ROUTED_EXPERTS}{e}.linear_fc{n}" for i in range(layers)
            for e in range(experts) for n in (1, 2)]


@lru_cache(maxsize=64)
def reaches_routed_experts(targets: tuple[str, ...], layers: int, experts: int) -> bool:
    """Whether the language model's LoRA ``targets`` take in a routed expert's linear layer
    (``layers`` layers of ``experts`` experts each)."""
    return any(target_matches(t, name) for name in routed_expert_layers(layers, experts)
               for t in targets)


@dataclass(frozen=True)
class Part:
    """A module of the layout, or one part of an encoder module (``part``)."""
    module: str
    part: str | None = None           # "encoder" | "projection"; None: the whole module

    @classmethod
    def parse(cls, entry: str, layout: Layout, key: str) -> Part:
        """The part ``entry`` of config key ``key`` names, or ``TrainConfigError``."""
        module, _, part = entry.partition(".")
        modules = [m.name for m in layout.modules]
        if module not in modules or (part and (part not in ENCODER_PARTS or module == LANGUAGE)):
            parts = [*modules, *(f"{m.name}.{p}" for m in layout.encoders for p in ENCODER_PARTS)]
            raise TrainConfigError(
                f"{key} names {entry!r}{meant([entry], parts)}, not a module of the layout "
                f"{layout} nor an encoder module's part: use one of {listed(modules)}, or "
                "<module>.encoder / <module>.projection for an encoder module")
        return cls(module, part or None)

    @property
    def name(self) -> str:
        """As the config writes it: ``image``, ``image.encoder``."""
        return f"{self.module}.{self.part}" if self.part else self.module

    @property
    def prefix(self) -> str:
        """The prefix of the part's parameter names in its module ("": all of them)."""
        return ENCODER_PARTS[self.part] if self.part else ""

    def covers(self, part: str) -> bool:
        """Whether this entry takes in ``part`` (``language``, ``<module>.encoder`` or
        ``<module>.projection``)."""
        return self.name == part or (self.part is None and part.split(".")[0] == self.module)


@dataclass(frozen=True)
class Adapted:
    """A part under LoRA (``model.lora``) and its settings."""
    part: Part
    spec: LoraConfig


def parse_parts(entries: Iterable[str], layout: Layout, key: str,
                one_per_module: bool = False) -> tuple[Part, ...]:
    """The parts of ``key``'s entries, each named once: a module and one of its parts, or the
    same part twice (``one_per_module``: any two of a module, whose parts together are the
    module), is ``TrainConfigError``."""
    found: list[Part] = []
    for entry in entries:
        part = Part.parse(entry, layout, key)
        clash = next((p for p in found if p.module == part.module and (
            one_per_module or p.part is None or part.part is None or p.part == part.part)),
            None)
        if clash is not None:
            raise TrainConfigError(
                f"{key} names {clash.name!r} and {part.name!r}: name the module "
                f"({part.module}) " + ("or one of its parts" if one_per_module else
                                       "or its parts, not both") +
                (f" (an override removes an entry the YAML gives: ~{key}.{clash.name})"
                 if isinstance(entries, dict) else ""))
        found.append(part)
    return tuple(found)


def check_module_names(key: str, names: Iterable[str], layout: Layout,
                       encoders_only: bool = False) -> None:
    """``TrainConfigError`` unless every name of ``key`` (``model.encoders``,
    ``optimizer.modules``) is a module of ``layout`` (an encoder module's with
    ``encoders_only``)."""
    modules = [m.name for m in (layout.encoders if encoders_only else layout.modules)]
    unknown = sorted(set(names) - set(modules))
    if unknown:
        kind = "encoder modules" if encoders_only else "modules"
        raise TrainConfigError(f"{key} has {listed(unknown)}{meant(unknown, modules)}, which "
                               f"the layout {layout} does not name: " + (
                                   f"use its {kind} {listed(modules)}" if modules else
                                   f"it has no {kind}: leave {key} out, or give the layout "
                                   "a module for each"))
