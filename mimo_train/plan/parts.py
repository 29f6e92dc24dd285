"""The parts of a run's model as the config names them, and the one check that a config key
names the layout's modules.

A part (``model.freeze``, ``model.lora``) is ``language``, an encoder module (``image``: its
tower and its projection), or one of an encoder module's two parts: ``image.encoder`` (the
tower) or ``image.projection``. ``Part.parse`` reads one; ``prefix`` is where the part's
parameters sit in its module (megatron-core's ``ModalitySubmodules``: ``encoders.`` and
``input_projections.``); ``covers`` says whether an entry takes in a part (a whole module
takes in its tower and projection).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_train.errors import TrainConfigError

# an encoder module's parts -> the prefix of their parameter names in the module
ENCODER_PARTS = {"encoder": "encoders.", "projection": "input_projections."}


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
            raise TrainConfigError(
                f"{key} names {entry!r}, not a module of the layout {layout} nor an encoder "
                f"module's part: use one of {modules}, or <module>.encoder / "
                "<module>.projection for an encoder module")
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
                                       "or its parts, not both"))
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
        raise TrainConfigError(f"{key} has {unknown}, which the layout {layout} does not "
                               f"name: use its {kind} {modules}")
